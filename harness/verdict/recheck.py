"""Re-check a recorded run without re-running it.

`aftershock report RUN_DIR --recheck [--scenario FIXED.yaml]` re-reads the saved
process logs with the (possibly corrected) log probes, rebuilds the events they
derive, keeps every event the probes and the harness wrote, and judges the
timeline through `runner.assess`, the function a run judges through. The
fault-free baseline comes from the cache (or from the run's own ``fault_free/``
folder); when neither has it, the check that needs it fails with "not available".
Nothing is launched.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aftershock.harness import systems
from aftershock.harness.errors import SpecError
from aftershock.harness.run import _files
from aftershock.harness.run.logprobe import (
    LINE_SHOWN,
    TAILED_TIMES,
    StreamStamps,
    compile_probes,
    count_matches,
    file_fields,
    line_events,
)
from aftershock.harness.run.records import Event, RunResult
from aftershock.harness.run.rundir import ProcessLog, RecordedRun, load_run
from aftershock.harness.run.runner import (
    NullObserver,
    assess,
    baseline_key,
    cache_dir,
    replay_digests,
)
from aftershock.harness.run.target import LINE_LIMIT, LOG_LIMIT
from aftershock.harness.run.timeline import read_events
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario, LogProbe
from aftershock.harness.twin._paths import untrusted
from aftershock.harness.twin.baseline import read_cached
from aftershock.harness.verdict import metrics as _metrics
from aftershock.harness.verdict.checks import Outcome


@dataclass(frozen=True, slots=True)
class Recheck:
    recorded: RunResult  # the verdict as the run gave it
    result: RunResult  # the verdict now
    notes: tuple[str, ...]  # what the re-check could not do, or did differently
    events: tuple[Event, ...]  # the timeline it judged (log-derived events rebuilt)
    scenario_text: str  # the scenario it judged by

    def changed(self) -> list[tuple[str, str, str]]:
        """(check, verdict then, verdict now) for each check whose verdict differs."""
        before = {c.name: c.passed for c in self.recorded.checks}
        now = {c.name: c.passed for c in self.result.checks}
        shown = {True: "PASS", False: "FAIL", None: "absent"}
        return [(name, shown[before.get(name)], shown[now.get(name)])
                for name in [*now, *(n for n in before if n not in now)]
                if before.get(name) != now.get(name)]


def reprobe(run: Path, events: Sequence[Event], probes: Sequence[LogProbe]
            ) -> tuple[list[Event], list[str]]:
    """The run's timeline with its log-derived events rebuilt by ``probes`` from the
    launcher's saved output, and what could not be rebuilt.

    A new event needs the time its line was read. The run's ``<log>.times`` files give
    it for every line; without them, a line an earlier probe matched is known by the
    event that probe wrote (when its text is unique in the logs). A match on a line of
    unknown time makes no event: a guessed time could pass a budget the system missed.
    """
    kept = [e for e in events if e.source != "log"]
    known = _known_lines(events)
    launch = next((e for e in events if e.event == "launch"), None)
    started = launch.t if launch is not None else -math.inf
    offset = launch.fields.get("wall_offset") if launch is not None else None
    clock_offset = float(offset) if isinstance(offset, int | float) else math.nan
    launcher = {name: run / "logs" / f"launcher.{name}.log" for name in ("stdout", "stderr")}
    seen = _untimed_counts(run, list(launcher.values()))
    rebuilt: list[Event] = []
    untimed = 0
    for name, path in launcher.items():
        compiled = compile_probes(probes, name)
        for number, (text, t) in enumerate(_lines(run, path), 1):
            when = t
            if when is None and seen[text[:LINE_SHOWN]] == 1:
                when = known.get(text[:LINE_SHOWN])
            if when is None:
                untimed += count_matches(compiled, text)
                continue
            # The same judgement as the live run's (harness/run/logprobe.py): a `time` group, a
            # Unix clock converted with the run's recorded offset, every match of the line,
            # each probe within its time per line.
            rebuilt.extend(line_events(text, compiled, read_t=when, clock_offset=clock_offset,
                                       started=started, where=f"logs/{path.name}:{number}"))
    from_files, untimed_in_files = _tailed(run, probes, clock_offset=clock_offset,
                                           started=started)
    rebuilt.extend(from_files)
    untimed += untimed_in_files
    notes = []
    if untimed:
        notes.append(f"{untimed} probe match(es) on log lines with no recorded capture time "
                     "were left out (the run kept no logs/*.log.times for them); a check that "
                     "needs them fails as not observed")
    return sorted([*kept, *rebuilt], key=lambda e: e.t), notes


def _known_lines(events: Sequence[Event]) -> dict[str, float]:
    """Each log line an earlier probe matched, with the earliest time it was read."""
    known: dict[str, float] = {}
    for e in events:
        line = e.fields.get("line")
        if e.source == "log" and isinstance(line, str):
            known[line] = min(e.t, known.get(line, e.t))
    return known


def _untimed_counts(run: Path, paths: Sequence[Path]) -> Counter[str]:
    """How often the text of each line with no capture time occurs in the logs at all."""
    # A line with no capture time is known by the event an earlier probe wrote for it, when
    # its text is unique in the logs: only such lines are counted (a first pass, streamed).
    seen: Counter[str] = Counter()
    for path in paths:
        for text, t in _lines(run, path):
            if t is None:
                seen[text[:LINE_SHOWN]] += 1
    if seen:
        for path in paths:
            for text, t in _lines(run, path):
                if t is not None and text[:LINE_SHOWN] in seen:
                    seen[text[:LINE_SHOWN]] += 1
    return seen


def _tailed(run: Path, probes: Sequence[LogProbe], *, clock_offset: float, started: float
            ) -> tuple[list[Event], int]:
    """The events of each per-process file the run followed (a command's ``logs:``), each at
    the time the live run read its line, and how many matches had no such time. The files
    are read as they are now, streamed, only while they are regular files, and no further
    than the launcher logs' own cap."""
    compiled = compile_probes(probes, "logs")
    times: dict[str, dict[int, float]] = {}
    for _, raw_row in _files.lines(run / "logs" / TAILED_TIMES, line_limit=LINE_LIMIT,
                                   total_limit=LOG_LIMIT):
        row = raw_row.decode(errors="replace")
        at, _, rest = row.partition(" ")
        when, _, path = rest.partition(" ")
        try:
            times.setdefault(path, {})[int(at)] = float(when)
        except ValueError:
            continue  # a torn last row: that line has no capture time
    events: list[Event] = []
    untimed = 0
    for path, known in times.items():
        stamps = StreamStamps()  # the file's newest own time, as the live run kept it
        for number, (offset, raw) in enumerate(_files.lines(Path(path), line_limit=LINE_LIMIT,
                                                            total_limit=LOG_LIMIT), 1):
            text = raw.decode(errors="replace")
            t = known.get(offset)
            if t is None:
                untimed += count_matches(compiled, text)
                continue
            events.extend(line_events(text, compiled, read_t=t, clock_offset=clock_offset,
                                      started=started, defaults=file_fields(path),
                                      stamps=stamps, where=f"{path}:{number}"))
    return events, untimed


def _lines(run: Path, path: Path) -> Iterator[tuple[str, float | None]]:
    """A saved launcher log's lines with their capture times, streamed; nothing from a log
    that is a link or not a regular file (docs/security.md)."""
    if _files.refusal(path, within=run) is not None:
        return
    log = ProcessLog(path.name, path, path.lstat().st_size)
    for line in log.lines():
        yield line.text.rstrip("\r"), line.t


def _outcome(run: RecordedRun) -> Outcome:
    end = next((e for e in reversed(run.events) if e.event == "run_end"), None)
    exit_code = end.fields.get("exit_code") if end is not None else None
    timed_out = bool(end.fields.get("timed_out")) if end is not None else False
    duration = (end.t - run.t0) if end is not None else run.result.duration_s
    return Outcome(exit_code if isinstance(exit_code, int) else None, timed_out,
                   round(duration, 3))


def _comparable(loaded: LoadedScenario) -> dict[str, Any]:
    """What a re-check cannot change: everything but the checks and the log probes."""
    data = loaded.spec.model_dump(mode="json", exclude={"expect", "description"})
    if systems.of(loaded.spec.system).log_probes(loaded.spec.system):
        data["system"].pop("probes", None)
    return data


def _cached(loaded: LoadedScenario, seed: int, what: str) -> dict[str, Any] | None:
    """The cached twin's result, only where the run would believe it (_paths.untrusted)."""
    key = baseline_key(loaded.spec, seed, scenario_dir=loaded.path.parent)
    path = cache_dir() / "fault_free" / f"{key}.json"
    if not os.path.lexists(path) or untrusted(path) is not None:
        return None
    try:
        return read_cached(path, what)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _baseline(
    run: Path, fixed: LoadedScenario, recorded: LoadedScenario | None, seed: int, what: str,
) -> tuple[dict[str, Any] | None, str]:
    """The fault-free twin's ``digests`` or ``outputs``: from the cache under the fixed
    scenario's key, or under the recorded one's when the probes that make them are the
    same, or re-derived from the run's own ``fault_free/`` folder. Never re-run."""
    found = _cached(fixed, seed, what)
    if found is not None:
        return found, "fault-free baseline from the cache"
    if recorded is not None and _probes_of(recorded, what) == _probes_of(fixed, what):
        found = _cached(recorded, seed, what)
        if found is not None:
            return found, "fault-free baseline from the cache (as recorded)"
    twin = run / "fault_free" / "events.jsonl"
    if twin.is_file():
        events = read_events(twin)
        probes = _probes_of(fixed, "all")
        if probes:
            events, _ = reprobe(twin.parent, events, probes)
        end = next((e for e in reversed(events) if e.event == "run_end"), None)
        if end is None or end.fields.get("exit_code") != 0:
            return None, "fault-free baseline not available: its run in fault_free/ failed"
        if what == "outputs":
            return ({k: v.to_json() for k, v in _metrics.outputs(events).items()},
                    "fault-free baseline re-read from fault_free/")
        digests = {str(k): v for k, v in _metrics.final_digests(events).items()}
        return digests or None, "fault-free baseline re-read from fault_free/"
    return None, ("fault-free baseline not available: not in the cache for this scenario and "
                  "the run has no fault_free/ folder (`aftershock run` computes it)")


def _probes_of(loaded: LoadedScenario, what: str) -> list[LogProbe]:
    probes = systems.of(loaded.spec.system).log_probes(loaded.spec.system)
    if what == "digests":
        return [p for p in probes if p.event == "params"]
    return probes


def _scenarios(run: RecordedRun, run_dir: Path, scenario: Path | None
               ) -> tuple[LoadedScenario | None, LoadedScenario]:
    """The scenario the run recorded (if it kept one) and the one it is judged by now:
    ``scenario``, else the recorded one. Refused if they differ in what was run."""
    recorded_loaded: LoadedScenario | None = None
    if run.scenario_text is not None:
        recorded_loaded = LoadedScenario(
            parse_scenario(run.scenario_text, str(run_dir / "scenario.yaml")),
            Path(run.result.file), run.scenario_text)
    if scenario is not None:
        fixed = load_scenario(scenario)
    elif recorded_loaded is not None:
        fixed = recorded_loaded
    else:
        raise SpecError([f"{run_dir}:1:1: the run kept no scenario.yaml; give --scenario"])
    if recorded_loaded is not None and _comparable(recorded_loaded) != _comparable(fixed):
        differ = sorted(k for k, v in _comparable(fixed).items()
                        if _comparable(recorded_loaded).get(k) != v)
        raise SpecError([
            f"{fixed.path}:1:1: changes what was run ({', '.join(differ)}), not only its "
            "checks or log probes; a re-check re-reads a run, it cannot re-run it "
            "(use `aftershock run`)"])
    return recorded_loaded, fixed


def _baselines(run_dir: Path, fixed: LoadedScenario, recorded_loaded: LoadedScenario | None,
               seed: int) -> tuple[dict[int, str] | None, dict[str, _metrics.Output] | None,
                                   str]:
    """What the checks compare with: the fault-free digests (or the replayed ones), the
    fault-free outputs, and a note on where they came from or why they are missing."""
    expect = fixed.spec.expect
    baseline: dict[int, str] | None = None
    baseline_outputs: dict[str, _metrics.Output] | None = None
    note = ""
    if expect.params_match == "fault_free":
        found, note = _baseline(run_dir, fixed, recorded_loaded, seed, "digests")
        baseline = None if found is None else {int(k): str(v) for k, v in found.items()}
    elif expect.params_match == "replay":
        # The independent oracle recomputes the recorded membership in this process: the
        # same judgement the run made, and nothing is launched.
        baseline, note = replay_digests(fixed, seed=seed, run_dir=run_dir,
                                        observer=NullObserver())
    if expect.outputs_match == "fault_free":
        found, note = _baseline(run_dir, fixed, recorded_loaded, seed, "outputs")
        try:
            baseline_outputs = (None if found is None else
                                {k: _metrics.Output.from_json(v) for k, v in found.items()})
        except (TypeError, ValueError) as exc:
            baseline_outputs, note = None, f"unreadable fault-free outputs ({exc}); {note}"
    return baseline, baseline_outputs, note


def recheck(run_dir: Path, *, scenario: Path | None = None) -> Recheck:
    """Judge a recorded run again with the current probes and checks (docs/report.md)."""
    run = load_run(run_dir)
    recorded_loaded, fixed = _scenarios(run, run_dir, scenario)
    notes: list[str] = []
    events = run.events
    probes = systems.of(fixed.spec.system).log_probes(fixed.spec.system)
    if probes:
        events, notes = reprobe(run_dir, events, probes)
    baseline, baseline_outputs, note = _baselines(run_dir, fixed, recorded_loaded,
                                                  run.result.seed)
    if note:
        notes.append(note)
    metrics, checks = assess(
        fixed.spec, events=events, outcome=_outcome(run), faults=run.result.faults,
        baseline=baseline, baseline_outputs=baseline_outputs, baseline_note=note,
    )
    result = replace(run.result, name=fixed.spec.name, file=str(fixed.path),
                     passed=all(c.passed for c in checks) and not run.result.error,
                     checks=tuple(checks),
                     metrics=metrics, run_dir=str(run_dir),
                     proofs=_metrics.metric_proofs(events, systems.of(fixed.spec.system)
                                                   .world(fixed.spec.system)))
    return Recheck(recorded=run.result, result=result, notes=tuple(notes), events=tuple(events),
                   scenario_text=fixed.text)
