"""Reports: the live view, plain progress lines, the check table, JSON and JUnit XML."""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from aftershock.harness.run import attempts
from aftershock.harness.run.records import Event, RunResult

if TYPE_CHECKING:
    from aftershock.harness.run.runner import Observer
    from aftershock.harness.search.explore import Attempt, Exploration, Stage

#: Events worth a line of their own in the plain and live views.
NOTABLE = {
    "launch", "fault_prepared", "fault_injected", "fault_healed", "failure_detected",
    "recovery_done",
    "checkpoint_loaded", "checkpoint_skipped", "timeout", "run_end", "fault_armed",
    "fault_failed", "serving_ready", "load_started", "load_not_ready", "load_finished",
    "request_migrated",
    "request_failed", "teardown", "trigger_late", "process_started", "process_exited",
    "probe_timeout", "log_unread", "slurm_left",
}


# Everything that comes from a run (names, paths, log lines, check messages) is data: it goes
# to the console as Text, never as a markup string, so `[/]` in a log line cannot raise
# MarkupError and `[link=...]` cannot restyle the report. Control characters (an ESC from a
# target's log, a NUL) are shown as escapes: raw, they would drive the terminal, and XML 1.0
# cannot hold them at all (the JUnit file would not parse).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def visible(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``); tab and newline kept."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _text(value: object, style: str = "") -> Text:
    return Text(visible(str(value)), style=style)


def describe(event: Event) -> str:
    f = event.fields
    who = f"rank {event.rank}" if event.rank is not None else event.source
    if event.rank is not None and isinstance(f.get("replica"), int):
        who = f"replica {f['replica']} {who}"  # each torchft replica group has its rank 0
    line = _fault_line(event.event, f)
    if line is None:
        line = _process_line(event, f, who)
    if line is None:
        line = _serving_line(event.event, f)
    return line if line is not None else f"{who} {event.event}"


def _fault_line(name: str, f: dict[str, Any]) -> str | None:
    """What the harness did with a fault, or what it warns of, in words."""
    match name:
        case "fault_injected":
            pid = f" (pid {f['pid']})" if isinstance(f.get("pid"), int) else ""
            return f"FAULT {f.get('kind')} -> {_hit(f)}{pid}: {f.get('detail', '')}"
        case "fault_prepared":
            return f"prepared {f.get('kind')}: {f.get('detail', '')}"
        case "fault_armed":
            return f"armed {f.get('kind')}: {f.get('detail', '')}"
        case "probe_timeout":
            return (f"WARNING probe {f.get('pattern')!r} ({f.get('kind')}) gave up on "
                    f"{f.get('where')} after {f.get('budget_s')} s: that line counts as unmatched")
        case "log_unread":
            return (f"WARNING the log reader was behind on {f.get('stream')} when the run "
                    f"ended: {f.get('why')}")
        case "trigger_late":
            why = (f"; the run's first step was {f.get('first_step')}: did it resume from "
                   "what an earlier run left?" if f.get("resumed") else "")
            return (f"WARNING fault {f.get('fault')} ({f.get('kind')}) fired at step "
                    f"{f.get('step')}, past its trigger `step: {f.get('at_step')}`{why}")
        case "fault_failed":
            return f"FAULT {f.get('kind')} could not be applied: {f.get('error')}"
        case "fault_healed":
            return f"healed {f.get('kind')}"
        case "slurm_left":
            return (f"WARNING Slurm job(s) named {f.get('name')} left in the queue: "
                    f"{f.get('error')}; `{f.get('heal')}` cancels them")
    return None


def _hit(f: dict[str, Any]) -> str:
    """Whom a fault hit. A label with a space names its own coordinate ("REPLICA_GROUP_ID=1
    role worker", "role launcher"); the pid says which process that was."""
    if "role" in f:
        return str(f["role"]) if " " in str(f["role"]) else f"role {f['role']}"
    if "ranks" in f:
        return f"ranks {', '.join(map(str, f['ranks']))}"
    return f"rank {f.get('rank')}"


def _process_line(event: Event, f: dict[str, Any], who: str) -> str | None:
    """What the run and its processes did, in words."""
    match event.event:
        case "launch":
            return f"launched ({f.get('phase', 'run')}, seed {f.get('seed')})"
        case "failure_detected":
            return f"{who} detected failure: {str(f.get('cause', '?'))[:120]}"
        case "recovery_done":
            return f"{who} recovered"
        case "checkpoint_loaded":
            return f"{who} resumed from checkpoint at step {f.get('step')}"
        case "checkpoint_skipped":
            return f"{who} skipped checkpoint {f.get('path')}: {f.get('reason')}"
        case "checkpoint_saved":
            return f"checkpoint saved at step {f.get('step')}"
        case "timeout":
            return f"TIMEOUT after {f.get('after_s')}s"
        case "run_end":
            return ("run ended: timed out" if f.get("timed_out") else
                    f"run ended (exit {f.get('exit_code')})")
        case "process_started":
            return _started(f, who)
        case "process_exited":
            return attempts.line(event)
        case "teardown":
            return _describe_teardown(f)
        case "step":
            return f"{who} step {f.get('step')}"
    return None


def _started(f: dict[str, Any], who: str) -> str:
    # Its launcher names it: each torchft replica group's torchrun has its own rank 0.
    if isinstance(f.get("agent"), int):
        who = f"{who} of launcher pid {f['agent']}"
    return (f"{who} started (pid {f.get('pid')}, restart {f.get('generation')})"
            if f.get("generation") else f"{who} started (pid {f.get('pid')})")


def _serving_line(name: str, f: dict[str, Any]) -> str | None:
    """What the server and its load did, in words."""
    match name:
        case "serving_ready":
            return f"server ready at {f.get('url')} ({f.get('workers')} workers)"
        case "load_started":
            return f"load: {f.get('requests')} requests to {f.get('url')}"
        case "load_finished":
            return "load finished"
        case "load_not_ready":
            return f"load NOT STARTED: {str(f.get('error'))[:200]}"
        case "request_migrated":
            return (f"request {f.get('request_id')} moved from worker {f.get('from_worker')} "
                    f"to worker {f.get('to_worker')} after {f.get('emitted')} tokens")
        case "request_failed":
            return f"request {f.get('request')} LOST: {str(f.get('error'))[:120]}"
    return None


def _describe_teardown(f: dict[str, object]) -> str:
    said = ("ended every process of the run (its cgroup and run id)"
            if f.get("tracking") == "cgroup" else
            "removed the run's containers and ended every process found by its run id"
            if f.get("tracking") == "containers" else
            "ended every process found by the run id (no cgroup: one that dropped it is out "
            "of reach)")
    if f.get("survivors"):
        said = f"could not end processes {f.get('survivors')} of the run"
    held = f.get("logs_open")
    if isinstance(held, list) and held:
        said += f"; a process the harness could not end still holds its {'/'.join(held)}"
    overran = f.get("overran")
    if isinstance(overran, list) and overran:
        said += (f"; SIGTERM's grace ({f.get('grace_s', '?')} s) ran out with "
                 + "; ".join(_overran(p) for p in overran if isinstance(p, dict))
                 + ", then SIGKILL")
    return said


def _overran(p: dict[str, Any]) -> str:
    """One process that outlived SIGTERM: what it is and where its threads waited."""
    pending = ", one pending" if p.get("sigterm_pending") else ""
    listed = p.get("threads")
    threads: list[Any] = listed if isinstance(listed, list) else []
    waits = ", ".join(f"{t.get('name')} {str(t.get('state', ''))[:1]} in {t.get('wchan')}"
                      for t in threads[:4] if isinstance(t, dict))
    more = len(threads) - 4
    return (f"pid {p.get('pid')} ({p.get('name')}) still running: SIGTERM "
            f"{p.get('sigterm')}{pending}; threads: {waits}"
            + (f" and {more} more" if more > 0 else ""))


class PlainObserver:
    """One line per notable event, for logs and CI (no TTY)."""

    def __init__(self, console: Console, step_every: int = 50) -> None:
        self.console = console
        self.step_every = step_every
        self._scenario = ""
        self._t0: float | None = None
        self._last_step = 0

    def phase(self, scenario: str, phase: str, detail: str = "") -> None:
        self._scenario = scenario
        self._t0 = None
        self._last_step = 0
        self.console.print(_text(f"[{scenario}] {phase}: {detail}"), highlight=False)

    def event(self, event: Event) -> None:
        if self._t0 is None:
            self._t0 = event.t
        step = event.fields.get("step")
        if event.event == "step" and isinstance(step, int):
            if step >= self._last_step + self.step_every:
                self._last_step = step
            else:
                return
        elif event.event not in NOTABLE:
            return
        elapsed = event.t - self._t0
        line = f"[{self._scenario}] +{elapsed:7.3f}s {describe(event)}"
        self.console.print(_text(line), highlight=False)

    def finished(self, result: RunResult) -> None:
        render_result(result, self.console)


@dataclass
class _RankState:
    pid: int | None = None
    step: int = 0
    generation: int = 0
    status: Text = field(default_factory=lambda: Text("starting"))


@dataclass
class _LiveState:
    scenario: str = ""
    phase: str = ""
    total_steps: int | None = None
    ranks: dict[int, _RankState] = field(default_factory=dict)
    log: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    t0: float | None = None


class LiveObserver:
    """A rich live view: ranks, step progress, faults and recovery as they happen."""

    def __init__(self, console: Console, total_steps: int | None = None) -> None:
        self.console = console
        self.state = _LiveState(total_steps=total_steps)
        self.live = Live(self._render(), console=console, refresh_per_second=8, transient=True)
        self._started = False

    def __enter__(self) -> LiveObserver:
        self.live.start()
        self._started = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def set_total_steps(self, total: int | None) -> None:
        self.state.total_steps = total

    def phase(self, scenario: str, phase: str, detail: str = "") -> None:
        self.state = _LiveState(scenario=scenario, phase=phase,
                                total_steps=self.state.total_steps)
        self._refresh()

    def event(self, event: Event) -> None:
        s = self.state
        if s.t0 is None:
            s.t0 = event.t
        rank = event.rank
        if (rank is not None and event.source != "harness") or event.event == "fault_injected":
            _update_rank(s.ranks.setdefault(rank if rank is not None else 0, _RankState()),
                         event)
        if event.event == "run_end":
            code, timed_out = event.fields.get("exit_code"), event.fields.get("timed_out")
            for r in s.ranks.values():
                r.status = (Text("timed out", style="red") if timed_out else
                            Text(f"exited {code}", style="green" if code == 0 else "red"))
        if event.event in NOTABLE:
            s.log.append(f"+{event.t - s.t0:7.3f}s {describe(event)}")
        self._refresh()

    def finished(self, result: RunResult) -> None:
        if self._started:
            self.live.stop()
            self._started = False
        render_result(result, self.console)

    def _refresh(self) -> None:
        if self._started:
            self.live.update(self._render())

    def _render(self) -> Panel:
        s = self.state
        table = Table(expand=True, box=None)
        for name in ("rank", "pid", "gen", "step"):
            table.add_column(name, justify="right", no_wrap=True)
        table.add_column("progress", ratio=1, no_wrap=True)
        table.add_column("status", no_wrap=True, overflow="ellipsis")
        # The bar gives way first on a narrow terminal: 80 columns keep every other column.
        width = max(8, min(30, self.console.width - 52))
        for rank in sorted(s.ranks):
            r = s.ranks[rank]
            bar = ""
            if s.total_steps:
                done = int(width * min(r.step, s.total_steps) / s.total_steps)
                bar = "█" * done + "·" * (width - done)
            table.add_row(_text(rank), _text(r.pid or ""), _text(r.generation), _text(r.step),
                          bar, r.status)
        # One line per event, cut rather than wrapped: a wrapped line scrolls the others away.
        lines = [Text(visible(line), style="dim", no_wrap=True, overflow="ellipsis")
                 for line in s.log]
        log = Group(*lines) if lines else Text("waiting for events...", style="dim")
        return Panel(Group(table, log), title=_text(f"{s.scenario} · {s.phase}"),
                     border_style="blue")


def render_result(result: RunResult, console: Console) -> None:
    if result.error:
        line = Text("NO VERDICT", style="red bold")
        line.append(visible(f" {result.name}: {result.error}"))
        console.print(line, highlight=False)
        _render_ends(result, console)
        console.print(_text(f"run dir {result.run_dir}"), soft_wrap=True, highlight=False)
        return
    # The messages are a column only where every row then fits on one line; otherwise
    # (80 columns, most runs at 120) each message gets lines of its own under the table,
    # since a message squeezed into a column wraps into a narrow, hard to read strip. Where
    # even the boxed table would wrap a cell, it loses its lines (12 columns back).
    layouts: list[tuple[bool, box.Box | None]] = [
        (True, box.HEAVY_HEAD), (False, box.HEAVY_HEAD), (False, None)]
    narrow, style = next(((not column, style) for column, style in layouts
                          if _fits(_check_table(result, column, style), console)),
                         (True, None))
    console.print(_check_table(result, not narrow, style))
    if style is None and result.checks:
        console.print()  # no bottom line: a blank one ends the table
    if narrow and result.checks:
        messages = Table(box=None, show_header=False, padding=(0, 1, 0, 0))
        messages.add_column(no_wrap=True)
        messages.add_column()
        for check in result.checks:
            messages.add_row(_text(f"{check.name}:", "bold"), _text(check.message))
        console.print(messages)
    # Each time metric says what proves it: its events' own clocks, or a read time that
    # only bounds it from above (docs/metrics.md).
    shown = ", ".join(f"{k}={_show(v)}" + (f" (proof: {result.proofs[k]})"
                                           if k in result.proofs else "")
                      for k, v in result.metrics.items())
    # Word-wrapped at the console's width, whatever the console's soft_wrap says.
    console.print(_text(f"metrics: {shown}"), highlight=False, soft_wrap=False)
    _render_ends(result, console)
    summary = Text("PASSED", style="green") if result.passed else Text("FAILED", "red bold")
    summary.append(visible(f" {result.name} in {result.duration_s:.1f}s, seed {result.seed}"))
    console.print(summary, soft_wrap=False)
    # On a line of its own and never folded by us: the path must stay copyable in one piece.
    console.print(_text(f"run dir {result.run_dir}"), soft_wrap=True, highlight=False)


def _check_table(result: RunResult, with_messages: bool, style: box.Box | None) -> Table:
    table = Table(title=_text(f"{result.name}  ({result.file})"), title_justify="left",
                  box=style, pad_edge=style is not None)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("observed")
    table.add_column("expected")
    if with_messages:
        table.add_column("message", no_wrap=True)
    for check in result.checks:
        verdict = Text("PASS", style="green") if check.passed else Text("FAIL", style="red bold")
        row = [_text(check.name), verdict, _text(_show(check.observed)),
               _text(_show(check.expected))]
        table.add_row(*row, *([_text(check.message)] if with_messages else []))
    return table


def _fits(table: Table, console: Console) -> bool:
    """Whether ``table`` fits ``console`` with no cell wrapped: its natural width, measured
    as if the console were unbounded."""
    unbounded = console.options.update_width(1_000_000)
    return Measurement.get(console, unbounded, table).maximum <= console.width


def _show(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def end_lines(result: RunResult) -> list[str]:
    """How the system's processes ended, where any ended abnormally (harness/run/attempts.py),
    and the crash loop's one line last."""
    lines = [f"ended: {line}" for line in attempts.report_lines(result.ends)]
    if result.crash_loop:
        lines.append(f"crash loop: {result.crash_loop}")
    return lines


def _render_ends(result: RunResult, console: Console) -> None:
    for line in end_lines(result):
        style = "red bold" if line.startswith("crash loop:") else ""
        # Whole lines, never folded by us: a user greps for the exception they know.
        console.print(_text(line, style), highlight=False, soft_wrap=True)


def check_table_text(result: RunResult) -> str:
    """The check table as plain text (for pytest failure messages)."""
    rows = [("check", "result", "observed", "expected", "message")]
    rows += [
        (c.name, "PASS" if c.passed else "FAIL", _show(c.observed), _show(c.expected), c.message)
        for c in result.checks
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines += end_lines(result)
    return "\n".join(lines) + f"\nrun dir: {result.run_dir}"


def write_json(results: Sequence[RunResult], out: IO[str]) -> None:
    json.dump([r.to_json() for r in results], out, indent=2)
    out.write("\n")


def _update_rank(r: _RankState, event: Event) -> None:
    """A rank's row of the live view after one of its events."""
    if event.event in ("hello", "process_started"):
        r.pid = event.fields.get("pid")
        generation = event.fields.get("generation", 0)
        r.generation = generation if isinstance(generation, int) else 0
        r.status = Text("running")
    elif event.event == "step" and isinstance(event.fields.get("step"), int):
        r.step = event.fields["step"]
        r.status = Text("running")
    elif event.event == "fault_injected":
        r.status = _text(event.fields.get("kind"), "red")
    elif event.event == "failure_detected":
        r.status = Text("detected failure", style="yellow")
    elif event.event == "checkpoint_loaded":
        r.status = _text(f"resumed @ {event.fields.get('step')}", "cyan")
    elif event.event == "exit":
        r.status = Text("done", style="green")


def junit_xml(results: Sequence[RunResult], html: Path | None = None) -> str:
    """One <testcase> per scenario run; a failed check is a <failure>. Each carries its run
    folder and, with ``html``, the HTML report (``#run-N`` for the Nth run of several) as
    properties, for a CI page to link."""
    # Here, not at the top: most runs write no JUnit, and ElementTree costs ~4 ms to import.
    from xml.etree import ElementTree as ET

    suite = ET.Element(
        "testsuite",
        name="aftershock",
        tests=str(len(results)),
        failures=str(sum(1 for r in results if not r.passed and not r.error)),
        errors=str(sum(1 for r in results if r.error)),
        time=f"{sum(r.duration_s for r in results):.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    for index, r in enumerate(results, start=1):
        case = ET.SubElement(suite, "testcase", classname=visible(Path(r.file).stem),
                             name=visible(r.name), time=f"{r.duration_s:.3f}",
                             file=visible(r.file))
        _junit_verdict(case, r)
        props = ET.SubElement(case, "properties")
        _junit_properties(props, r)
        if html is not None:
            where = str(html.resolve()) + (f"#run-{index}" if len(results) > 1 else "")
            ET.SubElement(props, "property", name="html", value=visible(where))
        ends = end_lines(r)
        if ends:
            ET.SubElement(case, "system-out").text = visible("\n".join(ends))
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"



def _junit_verdict(case: Any, r: RunResult) -> None:
    """A run's <error> (no verdict) or <failure> (a failed check), if it has one."""
    from xml.etree import ElementTree as ET

    failed = r.failed_checks()
    if r.error:
        # Not a failed check: the run never got to a verdict (interrupted, harness error).
        error = ET.SubElement(case, "error", message=visible(r.error),
                              type="Interrupted" if r.interrupted else "HarnessError")
        if end_lines(r):
            error.text = visible("\n".join(end_lines(r)))
    elif failed:
        failure = ET.SubElement(
            case, "failure",
            message=visible("; ".join(
                [f"{c.name}: {c.message}" for c in failed]
                + ([f"crash loop: {r.crash_loop}"] if r.crash_loop else []))),
            type="CheckFailed",
        )
        failure.text = visible(check_table_text(r))


def _junit_properties(props: Any, r: RunResult) -> None:
    """A run's metrics (each with its proof), seed and run folder as <property>s."""
    from xml.etree import ElementTree as ET

    for key, value in r.metrics.items():
        ET.SubElement(props, "property", name=visible(key), value=visible(_show(value)))
        if key in r.proofs:
            ET.SubElement(props, "property", name=visible(f"{key}_proof"),
                          value=visible(r.proofs[key]))
    ET.SubElement(props, "property", name="seed", value=str(r.seed))
    ET.SubElement(props, "property", name="run_dir", value=visible(r.run_dir))


# ------------------------------------------------------------------------------ explore


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class _RunProgress:
    """The runner's observer for one run of an exploration: its phase and newest step."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self.what = "starting"
        self.step: int | None = None
        self._on_change = on_change

    def phase(self, scenario: str, phase: str, detail: str = "") -> None:
        self.what = phase
        self._on_change()

    def event(self, event: Event) -> None:
        step = event.fields.get("step")
        if event.event == "step" and isinstance(step, int) and (self.step or 0) < step:
            self.step = step
            self._on_change()

    def finished(self, result: RunResult) -> None:
        pass


def _attempt_line(attempt: Attempt, name: str = "", *, team: bool = False) -> str:
    verdict = {"pass": "pass", "fail": "FAIL", "discarded": "discarded"}[attempt.verdict]
    why = f"  {attempt.reason}" if attempt.reason else ""
    head = (f"[{name}] " if name else "") + (f"searcher {attempt.searcher} " if team else "")
    return (f"{head}run {attempt.index:3d} {attempt.stage:8} {verdict:9} "
            f"{attempt.duration_s:6.1f}s  {attempt.schedule}{why}")


class ExplorePlainObserver:
    """`aftershock explore` off a terminal: a line per run and per stage."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.name = ""
        self.team = False

    def _line(self, text: str) -> None:
        self.console.print(_text(text), highlight=False)

    def started(self, exploration: Exploration, *, time_limit_s: float | None,
                shrink_runs: int) -> None:
        self.name = exploration.name
        self.team = exploration.workers > 1
        limit = f", at most {_clock(time_limit_s)}" if time_limit_s is not None else ""
        self._line(f"[{self.name}] exploring {exploration.file}: up to "
                   f"{exploration.budget_runs} schedules of 1..{exploration.max_faults} "
                   f"fault(s){limit}, shrinking in up to {shrink_runs} runs, seed "
                   f"{exploration.seed}")

    def running(self, index: int, stage: Stage, schedule: str) -> Observer:
        return _RunProgress(lambda: None)

    def finished_run(self, attempt: Attempt) -> None:
        self._line(_attempt_line(attempt, self.name, team=self.team))

    def note(self, text: str) -> None:
        self._line(f"[{self.name}] {text}")

    def done(self, exploration: Exploration) -> None:
        render_exploration(exploration, self.console)


class ExploreLiveObserver:
    """`aftershock explore` on a terminal: runs done, failures found, the schedule now
    running and how far it got, the shrinking, time left; the finished runs scroll above."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.exploration: Exploration | None = None
        self.time_limit_s: float | None = None
        self.shrink_runs = 0
        self.current: tuple[int, str, str] | None = None
        self.progress: _RunProgress | None = None
        self.notes: deque[str] = deque(maxlen=2)
        self.live = Live(Text(""), console=console, refresh_per_second=4, transient=True,
                         get_renderable=self._render)

    def __enter__(self) -> ExploreLiveObserver:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def started(self, exploration: Exploration, *, time_limit_s: float | None,
                shrink_runs: int) -> None:
        self.exploration = exploration
        self.time_limit_s, self.shrink_runs = time_limit_s, shrink_runs

    def running(self, index: int, stage: Stage, schedule: str) -> Observer:
        self.current = (index, stage, schedule)
        self.progress = _RunProgress(self.live.refresh)
        self.live.refresh()
        return self.progress

    def finished_run(self, attempt: Attempt) -> None:
        self.current = None
        style = "red" if attempt.verdict == "fail" else "dim" if attempt.verdict == "discarded" \
            else ""
        team = self.exploration is not None and self.exploration.workers > 1
        self.live.console.print(Text(visible(_attempt_line(attempt, team=team)), style=style),
                                highlight=False)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.live.refresh()

    def done(self, exploration: Exploration) -> None:
        self.live.stop()
        render_exploration(exploration, self.console)

    def _render(self) -> Panel:
        ex = self.exploration
        if ex is None:
            return Panel(Text("starting...", style="dim"), border_style="blue")
        elapsed = time.monotonic() - ex.started
        searched = ex.count("search")
        shrinking = ex.count("shrink") + ex.count("minimize")
        failures = ex.count(verdict="fail")
        rate = ex.runs_per_minute
        left = (f"{_clock(self.time_limit_s - elapsed)} left" if self.time_limit_s is not None
                else f"{_clock(elapsed)} elapsed")
        lines = [
            Text(visible(f"runs {searched}/{ex.budget_runs} searched · failures {failures} · "
                         f"shrink runs {shrinking}/{self.shrink_runs} · "
                         f"{rate if rate is not None else '-'} runs/min · {left}")),
        ]
        if self.current is not None:
            index, stage, schedule = self.current
            progress = self.progress
            where = ""
            if progress is not None:
                where = f" ({progress.what}" + (f", step {progress.step}" if progress.step
                                                 else "") + ")"
            lines.append(Text(visible(f"run {index} {stage}{where}: {schedule}"),
                              no_wrap=True, overflow="ellipsis"))
        lines += [Text(visible(n), style="dim", no_wrap=True, overflow="ellipsis")
                  for n in self.notes]
        return Panel(Group(*lines), title=_text(f"explore {ex.name} · seed {ex.seed}"),
                     border_style="blue")


def render_exploration(exploration: Exploration, console: Console) -> None:
    """What an exploration found, and what it cost."""
    ex = exploration
    stages = ", ".join(f"{ex.count(s)} {s}" for s in ("search", "shrink", "minimize",
                                                        "confirm", "replay") if ex.count(s))
    discarded = ex.count(verdict="discarded")
    rate = ex.runs_per_minute
    console.print(_text(
        f"{ex.name}: {ex.runs} runs ({stages or 'none'}"
        f"{f'; {discarded} discarded' if discarded else ''}) in {_clock(ex.elapsed_s)}, "
        f"{rate if rate is not None else '-'} runs/min; stopped: {ex.stopped}; "
        f"fault-free twin: {ex.twin}"), highlight=False, soft_wrap=False)
    if not ex.findings:
        console.print(_text(f"no failing schedule found (seed {ex.seed})", "green"),
                      highlight=False)
    for f in ex.findings:
        style = {"confirmed": "red bold", "flaky": "yellow", "unconfirmed": "yellow"}[f.status]
        label = {"confirmed": "FAILING SCHEDULE", "flaky": "FLAKY SCHEDULE (not a verdict)",
                 "unconfirmed": "UNCONFIRMED (interrupted)"}[f.status]
        console.print(_text(f"{label}: {f.schedule}", style), highlight=False, soft_wrap=False)
        console.print(_text(f"  failed {f.failures} of {f.failures + f.passes} run(s): "
                            f"{f.message}"), highlight=False, soft_wrap=False)
        console.print(_text(f"  written to {f.file}"), soft_wrap=True, highlight=False)
