"""What ``aftershock run`` costs beyond the job it runs, per shipped scenario.

``python -m bench.harness_overhead [SCENARIO ...]`` (default: the shipped 2-rank training
scenario ``scenarios/faults/process_term_restart.yaml``) runs each scenario through the CLI
twice with a fresh cache folder: the first run pays the one-off work (the fault-free twin,
the platform line of the goldens), the second is what every later run of the scenario
costs. For each run it reports the CLI process's wall time, the job's span (the harness's
``launch`` event to its ``teardown`` event, which comes right after the job's launcher has
exited) and their difference: the harness's own time (start-up, preflight, the reaper,
checks, report) plus any twin or oracle it ran. Results go to
``bench/results/harness_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT = REPO / "scenarios" / "faults" / "process_term_restart.yaml"


def one_run(scenario: Path, cache: Path, run_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "AFTERSHOCK_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(scenario),
                           "--run-dir", str(run_dir)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=900, check=False)
    wall = time.monotonic() - started
    # --run-dir is the parent of the run's own folder (named after the scenario).
    found = sorted(run_dir.glob("*/events.jsonl"))
    if not found:
        raise SystemExit(f"no run folder under {run_dir} (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    events = [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]
    harness = {e["event"]: e["t"] for e in events if e.get("source") == "harness"}
    job = harness["teardown"] - harness["launch"] if {"launch", "teardown"} <= set(harness) \
        else None
    return {"exit": proc.returncode, "wall_s": round(wall, 2),
            "job_s": None if job is None else round(job, 2),
            "harness_s": None if job is None else round(wall - job, 2),
            "loadavg": round(os.getloadavg()[0], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", type=Path, default=[DEFAULT])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="aftershock-harness-overhead-") as tmp:
        for scenario in args.scenarios:
            cache = Path(tmp) / f"cache-{scenario.stem}"
            for attempt in ("first", "cached"):
                result = one_run(scenario, cache, Path(tmp) / f"{scenario.stem}-{attempt}")
                rows.append({"scenario": str(scenario.relative_to(REPO)
                                             if scenario.is_relative_to(REPO) else scenario),
                             "run": attempt, **result})
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| scenario | run | exit | CLI wall s | job s (launch → teardown) | harness s | "
             "load average |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| `{r['scenario']}` | {r['run']} | {r['exit']} | {r['wall_s']} | {r['job_s']} "
              f"| {r['harness_s']} | {r['loadavg']} |" for r in rows]
    lines.append("")
    for r in rows:
        if r["run"] == "cached":
            value, met = r["harness_s"], r["harness_s"] is not None and r["harness_s"] <= 1.0
            lines.append(f"- `{r['scenario']}`: harness time beyond the job, twin cached, "
                         f"<= 1 s: {value} -> {'met' if met else 'NOT met'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "harness_overhead.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "harness_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
