"""Schedules per minute: one fixed exploration per system, timed, with every verdict kept.

``python -m bench.explore`` runs ``aftershock explore`` with the same space, search seed and
number of schedules on three systems: the reference trainer's ``restart`` space (2 ranks,
``scenarios/explore/restart.yaml``), its ``hot_spare`` space (2 replicas × 2 shards,
``scenarios/explore/hot_spare.yaml``) and a plain torchrun command job
(``examples/torchrun_ddp/train.py`` with the space in ``bench/spaces/torchrun_ddp.yaml``).
Each exploration gets a fresh twin cache and no hypothesis database, so what it runs depends
only on the code, the space and the seed; shrinking is off by default (``--shrink-runs 0``)
so that a failure costs one re-run, not a search. Per system it reports the schedules per
minute (the explore's own figure: runs over the time spent in runs, and end to end: runs
over the CLI's whole wall time, twin and start-up included) and every run's verdict.

``--baseline-ref REF`` runs the same explorations on a ``git worktree`` of REF (a folder of
its own under /tmp, removed afterwards; this checkout's files are never touched), each
system's pair back to back in alternating order, prints both side by side with the ratio
this / baseline, and exits 1 when any run's schedule or verdict differs between the two.

``--split`` also says where each run's seconds went, from what the harness already records:
every run folder's timeline (``launch``, ``process_started``, ``hello``, ``step``,
``fault_injected``, ``params``, ``teardown``, ``run_end``), the attempt's duration in the
explore's JSON (the harness's work around the run), the CLI's wall time (the twin, the
CLI's start and hypothesis), and ``python -X importtime`` for what importing torch costs one
process here. Results go to ``bench/results/explore.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftershock.harness.search.team import searcher_seeds
from bench.status import code_identity

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
COMMAND_SPACE = REPO / "bench" / "spaces" / "torchrun_ddp.yaml"


@dataclass(frozen=True)
class System:
    """One row: a space shipped in the measured checkout, or the bench's command space
    copied next to that checkout's ``script``."""

    name: str
    scenario: str  # relative to the measured checkout, or "" for the bench's command space
    script: str = ""  # the command job's script, relative to the measured checkout


SYSTEMS = {
    "restart": System("restart", "scenarios/explore/restart.yaml"),
    "hot_spare": System("hot_spare", "scenarios/explore/hot_spare.yaml"),
    "command": System("command", "", "examples/torchrun_ddp/train.py"),
}

#: The phases of one run, in the order they happen; every second from the run's ``launch``
#: to its ``run_end`` is in exactly one of them (see :func:`split_events`).
PHASES = (
    "launcher start",  # launch -> the launcher's first worker seen: python, torch, its rendezvous
    "rank start",  # a rank process seen -> its hello: python, torch import, rendezvous
    "to first step",  # hello -> first step: the model, the data, a restore
    "training",  # steps, fault-free
    "recovery",  # a fault -> the first step past the last one before it (restarts included)
    "finish",  # first final parameters reported -> the last event of the job
    "launcher exit",  # the job's last event -> the harness's teardown (the launcher winding down)
    "harness checks",  # teardown -> run_end: ending the processes, reading the timeline, checks
)
#: The harness's time around a run (building it, preflight, judging, writing), per attempt.
AROUND = "harness around the run"


def cli_module(checkout: Path) -> str:
    """The CLI's module in ``checkout``: ``aftershock`` since the one import namespace,
    ``harness`` before it (so a baseline older than the move still runs)."""
    return "aftershock" if (checkout / "aftershock" / "__main__.py").exists() else "harness"


def scenario_for(system: System, checkout: Path, folder: Path) -> Path:
    """The scenario file to explore in ``checkout``; the command space is copied with the
    checkout's script into ``folder`` (its command names the script relative to itself)."""
    if system.scenario:
        return checkout / system.scenario
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(COMMAND_SPACE, folder / COMMAND_SPACE.name)
    shutil.copy(checkout / system.script, folder / Path(system.script).name)
    return folder / COMMAND_SPACE.name


def explore_once(checkout: Path, scenario: Path, work: Path, *, runs: int, seed: int,
                 shrink_runs: int, max_faults: int | None, workers: int = 1,
                 cache: Path | None = None) -> dict[str, Any]:
    """Run ``aftershock explore`` of ``checkout`` once on ``scenario``, with a fresh twin cache
    (``cache``, default one under ``work``) and no example database under ``work``, with
    ``workers`` searchers side by side; what it did, timed from outside, with the CPU
    seconds it and every process it waited for used."""
    work.mkdir(parents=True, exist_ok=True)
    report = work / "explore.json"
    argv = [sys.executable, "-m", cli_module(checkout), "explore", str(scenario),
            "--runs", str(runs), "--seed", str(seed), "--shrink-runs", str(shrink_runs),
            "--no-db", "--plain", "--out", str(work / "out"), "--json", str(report)]
    if max_faults is not None:
        argv += ["--max-faults", str(max_faults)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    env = {**os.environ, "AFTERSHOCK_CACHE_DIR": str(cache or work / "cache"),
           # The measured checkout first: its ranks are started with its own root first too.
           "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout),
                                                       os.environ.get("PYTHONPATH")]))}
    load_start = os.getloadavg()[0]
    # A file, not a pipe: the CLI must never block on a full pipe.
    with open(work / "cli.out", "w+") as out:
        cpu = _children_cpu_s()
        started = time.monotonic()
        code = subprocess.run(argv, cwd=checkout, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False).returncode
        wall = time.monotonic() - started
        cpu = _children_cpu_s() - cpu
        out.seek(0)
        output = out.read()
    found = json.loads(report.read_text()) if report.exists() else []
    exploration: dict[str, Any] = found[0] if found else {}
    # A team's runs, searcher by searcher: the order of the same seeds explored in turn.
    attempts = sorted(exploration.get("attempts", []),
                      key=lambda a: (a.get("searcher", 0), a["index"]))
    return {
        "exit": code,
        # 0: budget spent, nothing failed; 1: a failure found and written; both measured.
        "error": None if code in (0, 1) and exploration else output[-2000:],
        "wall_s": round(wall, 2),
        "runs": len(attempts),
        "runs_per_minute": exploration.get("runs_per_minute"),
        "end_to_end_per_minute": round(60 * len(attempts) / wall, 2) if wall > 0 else None,
        "runs_s": round(sum(a["duration_s"] for a in attempts), 2),
        "cpu_s": round(cpu, 1),
        "cpu_s_per_run": round(cpu / len(attempts), 2) if attempts else None,
        "twin": exploration.get("twin"),
        "stopped": exploration.get("stopped"),
        "verdicts": [[a["stage"], a["schedule"], a["verdict"]] for a in attempts],
        "attempts": attempts,
        "loadavg_start": round(load_start, 1),
        "loadavg_end": round(os.getloadavg()[0], 1),
        "out": str(work / "out"),
    }


def _children_cpu_s() -> float:
    """CPU seconds (user and system) of the processes this one has waited for, and theirs."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def explore_in_turn(checkout: Path, scenario: Path, work: Path, *, runs: int, seeds: Sequence[int],
                    shrink_runs: int, max_faults: int | None) -> dict[str, Any]:
    """What a team of ``len(seeds)`` searchers runs, explored one seed after the other by
    ``checkout`` (code without ``--workers``): one exploration per seed sharing one twin
    cache (the twin is paid once, as a team pays it), summed as one."""
    parts = [explore_once(checkout, scenario, work / f"seed-{k}", runs=runs, seed=seed,
                          shrink_runs=shrink_runs, max_faults=max_faults, cache=work / "cache")
             for k, seed in enumerate(seeds)]
    total = sum(p["runs"] for p in parts)
    search_s = sum(60 * p["runs"] / p["runs_per_minute"] for p in parts
                   if p["runs_per_minute"])
    wall = sum(p["wall_s"] for p in parts)
    cpu = sum(p["cpu_s"] for p in parts)
    return {
        "exit": max(p["exit"] for p in parts),
        "error": next((p["error"] for p in parts if p["error"]), None),
        "wall_s": round(wall, 2),
        "runs": total,
        "runs_per_minute": round(60 * total / search_s, 2) if search_s > 0 else None,
        "end_to_end_per_minute": round(60 * total / wall, 2) if wall > 0 else None,
        "runs_s": round(sum(p["runs_s"] for p in parts), 2),
        "cpu_s": round(cpu, 1),
        "cpu_s_per_run": round(cpu / total, 2) if total else None,
        "twin": parts[0]["twin"],
        "stopped": ", ".join(str(p["stopped"]) for p in parts),
        "verdicts": [v for p in parts for v in p["verdicts"]],
        "attempts": [a for p in parts for a in p["attempts"]],
        "loadavg_start": parts[0]["loadavg_start"],
        "loadavg_end": parts[-1]["loadavg_end"],
        "out": parts[0]["out"],
        "parts": parts,
    }


def verdict_differences(this: Sequence[Sequence[str]],
                        base: Sequence[Sequence[str]]) -> list[str]:
    """Each run whose stage, schedule or verdict differs between two explorations of one
    space and seed, in a line; runs one has and the other not count too."""
    lines = []
    for index in range(max(len(this), len(base))):
        a = tuple(this[index]) if index < len(this) else None
        b = tuple(base[index]) if index < len(base) else None
        if a != b:
            shown = [" ".join(x) if x is not None else "(no run)" for x in (a, b)]
            lines.append(f"run {index + 1}: this {shown[0]}; baseline {shown[1]}")
    return lines


def compare(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per system, this code's figures over the baseline's and the runs whose verdicts
    differ; a system one of the two did not run counts as differing."""
    found = []
    for name in names:
        this, base = ({"verdicts": [], "runs_per_minute": None, "end_to_end_per_minute": None,
                       **next((r for r in rows if r["system"] == name and r["code"] == code),
                              {"missing": True})} for code in ("this", "baseline"))
        differences = verdict_differences(this["verdicts"], base["verdicts"])
        differences += [f"{code} did not run" for code, row in (("this", this),
                                                                ("baseline", base))
                        if row.get("missing")]
        found.append({
            "system": name,
            "runs_per_minute": ratio(this["runs_per_minute"], base["runs_per_minute"]),
            "end_to_end_per_minute": ratio(this["end_to_end_per_minute"],
                                           base["end_to_end_per_minute"]),
            "differences": differences,
        })
    return found


def ratio(this: float | None, base: float | None) -> float | None:
    """this / base, or None when either is missing or the base is zero."""
    if this is None or base is None or base <= 0:
        return None
    return round(this / base, 2)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's timeline as dicts, the lines that are not JSON objects left out (a line a
    killed writer cut short)."""
    events: list[dict[str, Any]] = []
    path = run_dir / "events.jsonl"
    if not path.exists():
        return events
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and isinstance(event.get("t"), int | float):
                events.append(event)
    return events


def split_events(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds of one run per phase of :data:`PHASES`, from its timeline: each event that
    moves the run on starts a phase, which lasts until the next one starts. Empty when the
    run has no ``launch`` or no ``run_end``."""
    harness: dict[str, float] = {}
    for event in events:
        if event.get("source") == "harness":
            harness.setdefault(event["event"], event["t"])
    if "launch" not in harness or "run_end" not in harness:
        return {}
    launch, end = harness["launch"], harness["run_end"]
    teardown = harness.get("teardown", end)
    job = sorted((e for e in events if launch <= e["t"] <= teardown
                  and (e.get("source") not in ("harness", "launcher", "client")
                       or e["event"] == "fault_injected")),
                 key=lambda e: e["t"])
    started = sorted((e["t"], e.get("generation")) for e in events
                     if e["event"] == "process_started")
    marks: list[tuple[float, str]] = [(launch, "launcher start")]

    def enter(t: float, phase: str) -> None:
        if marks[-1][1] != phase:
            marks.append((t, phase))

    recovering, top, top_before, generation = False, -1, -1, None
    for event in job:
        t, name = event["t"], event["event"]
        # A worker the launcher started in another world than the last step's: the world
        # (re)starts, and that is start-up again, whatever caused it.
        while started and started[0][0] <= t:
            seen, world = started.pop(0)
            if marks[-1][1] != "rank start" and (top < 0 or world != generation):
                if top >= 0 and not recovering:
                    recovering, top_before = True, top
                enter(max(seen, marks[-1][0]), "rank start")
        if name == "hello" and marks[-1][1] in ("launcher start", "rank start"):
            if marks[-1][1] == "launcher start":
                # No launcher saw the ranks start (they are its own children): launcher and
                # ranks started together, which is the ranks' start.
                marks[-1] = (marks[-1][0], "rank start")
            enter(t, "to first step")
        elif name == "step" and isinstance(event.get("step"), int):
            step, generation = event["step"], event.get("generation")
            if recovering and step > top_before:
                recovering = False
            enter(t, "recovery" if recovering else "training")
            top = max(top, step)
        elif name in ("fault_injected", "failure_detected") and top >= 0 and not recovering:
            # A fault, or a failure seen without one: recovery lasts until a step past the
            # last one committed before it (what a restart recomputes is recovery too).
            recovering, top_before = True, top
            if marks[-1][1] in ("training", "to first step", "finish"):
                enter(t, "recovery")
        elif name == "params" and not recovering:
            enter(t, "finish")
    if job and job[-1]["t"] > marks[-1][0]:
        enter(job[-1]["t"], "launcher exit")
    if teardown > marks[-1][0]:
        enter(teardown, "harness checks")
    spans: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    for (t, phase), (t_next, _) in zip(marks, [*marks[1:], (end, "")], strict=True):
        spans[phase] += max(0.0, t_next - t)
    return {phase: round(seconds, 3) for phase, seconds in spans.items()}


def cpu_pressure(events: Sequence[dict[str, Any]]) -> float | None:
    """The mean of the run's ``machine_load`` samples' cpu_pressure (PSI: the share of the
    time some task of the machine waited for a CPU), or None without samples."""
    found = [e["cpu_pressure"] for e in events if e["event"] == "machine_load"
             and isinstance(e.get("cpu_pressure"), int | float)]
    return round(statistics.fmean(found), 2) if found else None


def split_exploration(result: dict[str, Any]) -> dict[str, Any]:
    """Where one exploration's wall time went: each run's phases (its folder's timeline) and
    the harness around it (the attempt's duration less the run's span), the twin's run when
    it ran, and the rest of the CLI's wall time (its start, hypothesis, the twin's lookup)."""
    runs: list[dict[str, Any]] = []
    out = Path(result["out"])
    twin = next(out.glob("runs/*/fault-free"), None)
    folders: list[tuple[str, Path, float | None]] = []
    if twin is not None and (twin / "events.jsonl").exists():
        folders.append(("twin", twin, None))
    folders += [((f"searcher {a['searcher']}, " if a.get("searcher") else "")
                 + f"{a['index']} {a['stage']}", Path(a["run_dir"]), a["duration_s"])
                for a in result["attempts"]]
    for label, folder, duration in folders:
        events = read_events(folder)
        phases = split_events(events)
        span = sum(phases.values())
        if duration is not None:
            # A run that found no twin in the cache (the code changed under the search)
            # ran its own in its folder, before its launch.
            again = sum(split_events(read_events(folder / "fault_free")).values())
            if again:
                phases["twin"] = round(again, 3)
            phases[AROUND] = round(max(0.0, duration - span - again), 3)
        runs.append({"run": label, "phases": phases, "span_s": round(span, 3),
                     "cpu_pressure": cpu_pressure(events)})
    counted = sum(sum(r["phases"].values()) for r in runs)
    totals: dict[str, float] = {}
    for run in runs:
        key = "twin" if run["run"] == "twin" else None
        for phase, seconds in run["phases"].items():
            name = key or phase
            totals[name] = round(totals.get(name, 0.0) + seconds, 3)
    totals["CLI start, hypothesis, between runs"] = round(
        max(0.0, result["wall_s"] - counted), 3)
    return {"runs": runs, "totals": totals, "wall_s": result["wall_s"]}


def import_cost(checkout: Path, repeat: int = 3) -> dict[str, float]:
    """What one process here spends to start Python and to import torch (with
    torch.distributed), median of ``repeat``: ``python -X importtime``'s cumulative time of
    each top-level import, summed."""
    starts, imports = [], []
    for _ in range(repeat):
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], cwd=checkout, check=True)
        starts.append(time.monotonic() - began)
        done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                               "import torch, torch.distributed"], cwd=checkout, check=True,
                              capture_output=True, text=True)
        imports.append(importtime_total(done.stderr))
    return {"python_start_s": round(statistics.median(starts), 3),
            "torch_import_s": round(statistics.median(imports), 3),
            "loadavg": round(os.getloadavg()[0], 1)}


def importtime_total(stderr: str) -> float:
    """Seconds of the top-level imports in ``python -X importtime`` output (each line
    ``import time: SELF | CUMULATIVE | NAME``, nested imports indented under NAME)."""
    total = 0
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        fields = line[len("import time:"):].split("|")
        if len(fields) != 3 or not fields[1].strip().isdigit():
            continue  # the header line
        name = fields[2]
        if name.startswith(" ") and not name.startswith("  "):
            total += int(fields[1])
    return total / 1e6


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached ``git worktree`` of ``ref`` in a folder of its own under /tmp, removed
    afterwards; this checkout's files are not touched (git notes the worktree in .git)."""
    folder = Path(tempfile.mkdtemp(prefix="aftershock-bench-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(folder), ref],
                   cwd=REPO, check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO,
                       check=False)
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=False)


def _machine() -> dict[str, Any]:
    import torch  # only for its version

    load = os.getloadavg()
    return {"description": f"{platform.machine()}, {os.cpu_count()} cores, Linux "
                           f"{platform.release()}, Python {platform.python_version()}, torch "
                           f"{torch.__version__}, load average at start {load[0]:.1f}",
            "cores": os.cpu_count(), "torch": torch.__version__, "loadavg_start": load}


def _num(value: Any) -> str:
    return "–" if value is None else str(value)


def _verdict_counts(verdicts: Sequence[Sequence[str]]) -> str:
    counts = {v: sum(1 for *_, x in verdicts if x == v) for v in ("pass", "fail", "discarded")}
    return " / ".join(str(counts[v]) for v in counts)


def busy_because(record: dict[str, Any]) -> str | None:
    """Why the record's figures are not a measurement of speed, or None: other work was
    running when the bench began (a load average over the cores). Not the load average
    or the CPU pressure during it: the explorations' own processes raise those (a 2-rank
    run to 3 on two cores; hot_spare's 2x2 ranks wait for a CPU ~70% of the time)."""
    cores = record["machine"].get("cores") or 1
    start = record["machine"]["loadavg_start"][0]
    if start > cores:
        return f"The load average was {start:.1f} on {cores} cores when the bench began"
    return None


def markdown(record: dict[str, Any]) -> str:
    """The record as the Markdown next to its JSON."""
    settings = record["settings"]
    lines = [
        "# Schedules per minute (`python -m bench.explore`)", "",
        f"Command: `{record['command']}`  ",
        f"Machine: {record['machine']['description']}, at the end "
        f"{record['machine']['loadavg_end'][0]:.1f}  ",
        f"Exploration: seed {settings['seed']}, {settings['runs']} schedule(s) per system"
        + (f" and searcher ({settings['workers']} searchers: this code side by side "
           "(`--workers`), the baseline their seeds in turn, sharing one twin)"
           if settings.get("workers", 1) > 1 else "") + ", "
        f"shrink runs {settings['shrink_runs']}, max faults "
        f"{_num(settings['max_faults']) if settings['max_faults'] else 'the space’s'}; a fresh "
        "twin cache and no example database per exploration", "",
    ]
    busy = busy_because(record)
    if busy:
        # Other work had the cores: the figures and ratios say the tool works, not how fast
        # either code is.
        lines += [f"{busy}: the figures below are not a measurement of speed.", ""]
    lines += [
        "| system | code | how | exit | runs | pass / fail / discarded | runs/min (runs only) "
        "| schedules/min (end to end) | CLI wall s | CPU s per run | twin | load average |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in record["rows"]:
        twin = (row["twin"] or "–").split(" (")[0]
        lines.append(
            f"| `{row['system']}` | {row['code']} | {row.get('how', 'one search')} "
            f"| {row['exit']} | {row['runs']} "
            f"| {_verdict_counts(row['verdicts'])} | {_num(row['runs_per_minute'])} "
            f"| {_num(row['end_to_end_per_minute'])} | {row['wall_s']} "
            f"| {_num(row.get('cpu_s_per_run'))} | {twin} "
            f"| {row['loadavg_start']}–{row['loadavg_end']} |")
    if record.get("comparisons"):
        lines += ["", f"Baseline: `{record['baseline_ref']}`. Ratios this / baseline:", "",
                  "| system | runs/min | schedules/min end to end | verdicts equal |",
                  "| --- | ---: | ---: | --- |"]
        for c in record["comparisons"]:
            equal = "yes" if not c["differences"] else "NO: " + "; ".join(c["differences"])
            lines.append(f"| `{c['system']}` | {_num(c['runs_per_minute'])} "
                         f"| {_num(c['end_to_end_per_minute'])} | {equal} |")
    lines += ["", "Every run:", "", "| system | code | run | stage | schedule | verdict |",
              "| --- | --- | ---: | --- | --- | --- |"]
    for row in record["rows"]:
        for index, (stage, schedule, verdict) in enumerate(row["verdicts"], 1):
            lines.append(f"| `{row['system']}` | {row['code']} | {index} | {stage} "
                         f"| {schedule} | {verdict} |")
    for row in record["rows"]:
        if row.get("error"):
            lines += ["", f"`{row['system']}` ({row['code']}) did not finish:", "", "```",
                      row["error"].strip(), "```"]
    if record.get("split"):
        lines += ["", *split_markdown(record["split"], record.get("import_cost"))]
    return "\n".join(lines) + "\n"


def split_markdown(splits: Sequence[dict[str, Any]],
                   imports: dict[str, float] | None) -> list[str]:
    """Per exploration, each run's seconds by phase and the sum per phase."""
    lines = ["## Where the seconds go (`--split`)", ""]
    if imports:
        lines += [f"One process here, measured apart: Python's start {imports['python_start_s']} s,"
                  f" importing torch and torch.distributed {imports['torch_import_s']} s "
                  f"(`python -X importtime`, load average {imports['loadavg']}); a run's "
                  "`rank start` holds that per world started, plus the rendezvous.", ""]
    columns = [*PHASES, "twin", AROUND]
    for split in splits:
        lines += [f"`{split['system']}` ({split['code']}), CLI wall {split['wall_s']} s:", "",
                  "| run | " + " | ".join(columns) + " | span s | cpu_pressure |",
                  "| --- |" + " ---: |" * (len(columns) + 2)]
        for run in split["runs"]:
            cells = [_num(run["phases"].get(c)) for c in columns]
            lines.append(f"| {run['run']} | " + " | ".join(cells)
                         + f" | {run['span_s']} | {_num(run['cpu_pressure'])} |")
        total = sum(split["totals"].values())
        lines += ["", "| phase | s | share |", "| --- | ---: | ---: |"]
        lines += [f"| {name} | {seconds} | {seconds / total:.0%} |"
                  for name, seconds in split["totals"].items() if total > 0]
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.explore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="restart,hot_spare,command",
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--runs", type=int, default=2, help="schedules per system")
    parser.add_argument("--seed", type=int, default=1, help="the search's seed")
    parser.add_argument("--shrink-runs", type=int, default=0)
    parser.add_argument("--max-faults", type=int, default=None)
    parser.add_argument("--baseline-ref", metavar="GIT_REF",
                        help="also run the explorations on a worktree of this ref")
    parser.add_argument("--workers", type=int, default=1,
                        help="searchers: this code's side by side (`explore --workers`), the "
                             "baseline's the same seeds in turn; --runs is each one's")
    parser.add_argument("--split", action="store_true", help="where each run's seconds go")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the explorations' run folders here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names or args.runs < 1 or args.workers < 1:
        parser.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}"
                     if unknown else "give at least one system and one run")
    machine = _machine()
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="aftershock-bench-explore-"))) if args.keep is None else args.keep
        codes = {"this": REPO}
        if args.baseline_ref:
            codes["baseline"] = stack.enter_context(worktree(args.baseline_ref))
        for index, name in enumerate(names):
            # Alternate which code goes first, so a load that changes hurts both alike.
            for code in list(codes)[:: 1 if index % 2 == 0 else -1]:
                work = tmp / f"{name}-{code}"
                scenario = scenario_for(SYSTEMS[name], codes[code], work / "space")
                if args.workers > 1 and code == "baseline":
                    result = explore_in_turn(
                        codes[code], scenario, work, runs=args.runs,
                        seeds=searcher_seeds(args.seed, args.workers),
                        shrink_runs=args.shrink_runs, max_faults=args.max_faults)
                    how = f"{args.workers} seeds in turn"
                else:
                    result = explore_once(codes[code], scenario, work, runs=args.runs,
                                          seed=args.seed, shrink_runs=args.shrink_runs,
                                          max_faults=args.max_faults, workers=args.workers)
                    how = (f"{args.workers} searchers side by side" if args.workers > 1
                           else "one search")
                result.pop("parts", None)
                row = {"system": name, "code": code, "how": how, **result}
                if args.split:
                    row["split"] = split_exploration(result)
                rows.append(row)
                print(f"{name} ({code}): exit {row['exit']}, {row['runs']} runs, "
                      f"{row['runs_per_minute']} runs/min, {row['end_to_end_per_minute']} "
                      f"end to end, verdicts {_verdict_counts(row['verdicts'])}", flush=True)
        imports = import_cost(REPO) if args.split else None
    comparisons = compare(rows, names) if args.baseline_ref else []
    record = {
        "command": "python -m bench.explore " + " ".join(argv if argv is not None
                                                         else sys.argv[1:]),
        "machine": {**machine, "loadavg_end": os.getloadavg()},
        "code": code_identity(),
        "baseline_ref": args.baseline_ref,
        "settings": {"systems": names, "runs": args.runs, "seed": args.seed,
                     "workers": args.workers,
                     "shrink_runs": args.shrink_runs, "max_faults": args.max_faults},
        "rows": [{k: v for k, v in r.items() if k not in ("attempts", "split", "out")}
                 for r in rows],
        "comparisons": comparisons,
        "split": [{"system": r["system"], "code": r["code"], **r["split"]}
                  for r in rows if "split" in r],
        "import_cost": imports,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "explore.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "explore.md").write_text(markdown(record))
    print(markdown(record))
    if any(r["error"] for r in rows):
        return 3
    return 1 if any(c["differences"] for c in comparisons) else 0


if __name__ == "__main__":
    sys.exit(main())
