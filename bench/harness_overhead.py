"""What ``aftershock run`` costs beyond the job it runs, per shipped scenario.

``python -m bench.harness_overhead [SCENARIO ...]`` (default: the shipped 2-rank training
scenario ``scenarios/faults/process_term_restart.yaml``) runs each scenario through the CLI
with a fresh cache folder: once first, which pays the one-off work (the fault-free twin, the
platform line of the goldens), then ``--repeat`` times cached, which is what every later run
of the scenario costs. For each run it reports the CLI process's wall time, the job's span
(the harness's ``launch`` event to its ``teardown`` event, which comes right after the job's
launcher has exited) and their difference: the harness's own time (start-up, preflight, the
reaper, checks, report) plus any twin or oracle it ran. That difference is split into the
time from the CLI's start to ``launch`` and from ``teardown`` to the CLI's exit (one
monotonic clock for every process), and the CLI process's own CPU time (user + system, its
children excluded; read from ``/proc/PID/stat`` once it has exited, before it is reaped) is
given beside it: the wall times grow with the machine's load, the CPU time much less.

Bytecode: the CLI gets a private ``PYTHONPYCACHEPREFIX`` (in the temporary folder) and no
``PYTHONDONTWRITEBYTECODE``, so the first run compiles the sources and the later ones load
``.pyc`` files, as an installed aftershock does (pip writes them at install). With
``--env-bytecode`` the caller's environment decides (``PYTHONDONTWRITEBYTECODE=1`` compiles
every harness module again on every run).

``--against DIR`` measures another checkout (e.g. ``git worktree add /tmp/before COMMIT``)
side by side: its runs alternate with this checkout's, each with a cache of its own.
``--startup N`` times ``aftershock --help`` and ``aftershock validate scenarios/`` N times
(in each checkout, alternating; CPU from ``wait4``). Results go to
``bench/results/harness_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from bench.stats import verdict

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT = REPO / "scenarios" / "faults" / "process_term_restart.yaml"
#: The cached run must cost at most this much beyond its job (docs/benchmarks.md, targets).
TARGET_S = 1.0


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` itself (not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the name: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cli_env(repo: Path, pycache: Path | None) -> dict[str, str]:
    """The CLI's environment: ``repo`` first on the path; a private .pyc cache unless None."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


POLL_S = 0.005


def watch(pid: int, run_dir: Path) -> dict[str, float]:
    """Wait for ``pid`` to exit without reaping it (its /proc entry, and its CPU times, stay
    until it is reaped); meanwhile tail the run's timeline and note the CLI's own CPU time
    when its ``launch`` and ``teardown`` events appear."""
    cpu_at: dict[str, float] = {}
    timeline: Path | None = None
    reader: IO[bytes] | None = None
    tail = b""
    try:
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if timeline is None:
                # --run-dir is the parent of the run's own folder (named after the scenario);
                # a fault-free twin's timeline is one level deeper, and is not this one.
                timeline = next(iter(run_dir.glob("*/events.jsonl")), None)
                reader = None if timeline is None else open(timeline, "rb")  # noqa: SIM115
            if reader is not None and len(cpu_at) < 2:
                tail = tail[-200:] + reader.read()
                for name in ("launch", "teardown"):
                    if name not in cpu_at and _HARNESS_EVENT % name.encode() in tail:
                        cpu_at[name] = own_cpu_s(pid)
            time.sleep(POLL_S)
    finally:
        if reader is not None:
            reader.close()
    return cpu_at


#: How the harness's own events start on the timeline (harness.run.timeline: compact JSON, in
#: the order t, event, source).
_HARNESS_EVENT = b'"event":"%s","source":"harness"'


def one_run(scenario: Path, cache: Path, run_dir: Path, env_bytecode: bool,
            repo: Path = REPO) -> dict[str, Any]:
    env = {**cli_env(repo, None if env_bytecode else cache.parent / "pycache"),
           "AFTERSHOCK_CACHE_DIR": str(cache)}
    run_dir.mkdir(parents=True, exist_ok=True)
    # Files, not pipes: the CLI must never block on a full pipe while it is being waited for.
    with open(run_dir / "cli.out", "w+") as out:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenario),
                                 "--run-dir", str(run_dir)], env=env, cwd=repo,
                                stdout=out, stderr=subprocess.STDOUT)
        cpu_at = watch(proc.pid, run_dir)
        exited = time.monotonic()
        cpu = own_cpu_s(proc.pid)
        code = proc.wait(timeout=60)
        out.seek(0)
        output = out.read()
    wall = exited - started
    # --run-dir is the parent of the run's own folder (named after the scenario).
    found = sorted(run_dir.glob("*/events.jsonl"))
    if not found:
        raise SystemExit(f"no run folder under {run_dir} (exit {code}):\n{output[-4000:]}")
    events = [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]
    # The verdict too: a fast run that checked nothing, or got recovery wrong, is no result.
    record = found[0].parent / "result.json"
    checks = json.loads(record.read_text()).get("checks", []) if record.exists() else []
    failed = [c["name"] for c in checks if not c["passed"]]
    harness = {e["event"]: e["t"] for e in events if e.get("source") == "harness"}
    spans = {"launch", "teardown"} <= set(harness)
    job = harness["teardown"] - harness["launch"] if spans else None
    return {"exit": code, "failed": failed if checks else ["no result.json"],
            "wall_s": round(wall, 2),
            "job_s": None if job is None else round(job, 2),
            "harness_s": None if job is None else round(wall - job, 2),
            "to_launch_s": round(harness["launch"] - started, 3) if spans else None,
            "after_teardown_s": round(exited - harness["teardown"], 3) if spans else None,
            "cli_cpu_s": round(cpu, 2),
            # The CLI's CPU up to its launch event, and after its teardown event (sampled
            # within POLL_S of each event appearing on the timeline).
            "cpu_to_launch_s": round(cpu_at["launch"], 3) if "launch" in cpu_at else None,
            "cpu_after_teardown_s": round(cpu - cpu_at["teardown"], 3)
            if "teardown" in cpu_at else None,
            "loadavg": round(os.getloadavg()[0], 1)}


def startup(repo: Path, argv: list[str], pycache: Path | None) -> tuple[float, float]:
    """CPU (user + system, from wait4) and wall seconds of ``python -m aftershock ARGV``."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "aftershock", *argv], cwd=repo,
                            env=cli_env(repo, pycache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", type=Path, default=[DEFAULT])
    parser.add_argument("--repeat", type=int, default=3,
                        help="cached runs per scenario (the verdict takes their median)")
    parser.add_argument("--env-bytecode", action="store_true",
                        help="leave bytecode caching to the environment (see above)")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="another checkout, measured side by side (see above)")
    parser.add_argument("--startup", type=int, default=0, metavar="N",
                        help="time --help and validate N times (in each checkout)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    codes = {"this": REPO} if args.against is None else {"this": REPO,
                                                         "against": args.against.resolve()}
    rows: list[dict[str, Any]] = []
    starts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aftershock-harness-overhead-") as tmp:
        for scenario in args.scenarios:
            relative = scenario.resolve().relative_to(REPO) \
                if scenario.resolve().is_relative_to(REPO) else None
            for index, attempt in enumerate(
                    ["first"] + [f"cached {i + 1}" for i in range(args.repeat)]):
                # Alternate which code goes first, so a load that changes hurts both alike.
                for code in list(codes)[:: 1 if index % 2 == 0 else -1]:
                    repo = codes[code]
                    path = repo / relative if relative is not None else scenario
                    cache = Path(tmp) / f"cache-{code}-{scenario.stem}"
                    result = one_run(path, cache, Path(tmp) / f"{code}-{scenario.stem}-{index}",
                                     args.env_bytecode, repo)
                    rows.append({"scenario": str(relative or scenario), "code": code,
                                 "run": attempt, **result})
                    print(json.dumps(rows[-1]), flush=True)
        for index in range(args.startup):
            for code in list(codes)[:: 1 if index % 2 == 0 else -1]:
                # The runs' .pyc cache (one_run), so the first startup compiles nothing.
                pycache = None if args.env_bytecode else Path(tmp) / "pycache"
                for command in (["--help"], ["validate", "scenarios"]):
                    cpu, wall = startup(codes[code], command, pycache)
                    starts.append({"code": code, "command": " ".join(command),
                                   "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                                   "loadavg": round(os.getloadavg()[0], 1)})
    bytecode = ("as the environment says (PYTHONDONTWRITEBYTECODE="
                f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r})" if args.env_bytecode
                else "private .pyc cache, written by the first run")
    lines = [f"bytecode: {bytecode}", ""]
    if args.against is not None:
        lines += [f"this: this checkout; against: {args.against}", ""]
    lines += ["| scenario | code | run | exit | failed checks | CLI wall s "
              "| job s (launch → teardown) | harness s | start → launch s | teardown → exit s "
              "| CLI CPU s | of it to launch | of it after teardown | load average |",
              "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: |"]
    lines += [f"| `{r['scenario']}` | {r['code']} | {r['run']} | {r['exit']} "
              f"| {', '.join(r['failed']) or '–'} | {r['wall_s']} "
              f"| {r['job_s']} | {r['harness_s']} | {r['to_launch_s']} "
              f"| {r['after_teardown_s']} | {r['cli_cpu_s']} | {r['cpu_to_launch_s']} "
              f"| {r['cpu_after_teardown_s']} | {r['loadavg']} |" for r in rows]
    lines.append("")
    for name in dict.fromkeys(r["scenario"] for r in rows):
        for code in codes:
            cached = [r for r in rows if r["scenario"] == name and r["code"] == code
                      and r["run"].startswith("cached") and r["harness_s"] is not None]
            if not cached:
                lines.append(f"- `{name}` ({code}): no cached run recorded its launch and "
                             "teardown")
                continue
            med = {k: round(statistics.median(r[k] for r in cached), 3)
                   for k in ("harness_s", "to_launch_s", "after_teardown_s", "cli_cpu_s")}
            spent = {k: round(statistics.median(r[k] for r in cached if r[k] is not None), 3)
                   if any(r[k] is not None for r in cached) else None
                   for k in ("cpu_to_launch_s", "cpu_after_teardown_s")}
            met, why = verdict([r["harness_s"] for r in cached], TARGET_S)
            said = "met" if met else "NOT met" if met is False else str(why)
            lines.append(
                f"- `{name}` ({code}): harness time beyond the job, twin cached (median of "
                f"{len(cached)}), <= {TARGET_S:g} s: {med['harness_s']} -> "
                f"{said}; start → launch {med['to_launch_s']} s, "
                f"teardown → exit {med['after_teardown_s']} s; CLI CPU {med['cli_cpu_s']} s, "
                f"{spent['cpu_to_launch_s']} s of it to launch, {spent['cpu_after_teardown_s']} s "
                "after teardown")
    if starts:
        lines += ["", "| command | code | CPU s (median) | wall s (median) | runs | load average |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for command in dict.fromkeys(r["command"] for r in starts):
            for code in codes:
                mine = [r for r in starts if r["command"] == command and r["code"] == code]
                lines.append(
                    f"| `aftershock {command}` | {code} "
                    f"| {statistics.median(r['cpu_s'] for r in mine):.3f} "
                    f"| {statistics.median(r['wall_s'] for r in mine):.3f} | {len(mine)} "
                    f"| {min(r['loadavg'] for r in mine)}–{max(r['loadavg'] for r in mine)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "harness_overhead.json").write_text(
        json.dumps({"runs": rows, "startup": starts}, indent=1) + "\n")
    (args.out / "harness_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
