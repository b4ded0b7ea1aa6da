"""Where a hot_spare recovery goes on the standby's code, from jobs run with
recovery_steps_standby.patch applied to a scratch copy and ``--keep-logs``.

``python recovery_steps_standby_show.py 'DIR/rep*/hot_spare/events.jsonl'`` prints, for each
moment (``surv``: the survivors, ``spare``: the spare that takes the dead rank's place;
``first``/``last``: the first and the last process to reach it in a job), the median and the
range over the jobs of the milliseconds after the SIGKILL (docs/benchmarks.md, "Where a
`hot_spare` recovery goes with the standby"). recovery_steps_standby.json holds the 16 jobs'
events of the kill's first 300 ms, by job.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def moments(path: str) -> dict[str, list[float]]:
    events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    t0 = next(e["t"] for e in events if e["event"] == "fault_injected")
    spares = {e["pid"] for e in events
              if e["event"] == "hello" and e.get("role") == "spare" and e["t"] < t0}
    found: dict[str, list[float]] = {}
    for e in events:
        if not t0 <= e["t"] <= t0 + 1:
            continue
        who = "spare" if e["pid"] in spares else "surv"
        if e["event"] == "dbg":
            key = f"{who}:{e['phase']}"
        elif e["event"] in ("recovery_done", "failure_detected", "membership", "hello"):
            key = f"{who}:{e['event']}:{e.get('source', '')[:4]}"
        elif e["event"] == "step" and e.get("generation", 0) > 0:
            key = f"{who}:step{e['step']}"
        else:
            continue
        found.setdefault(key, []).append((e["t"] - t0) * 1000)
    return found


def main() -> None:
    merged: dict[str, list[float]] = defaultdict(list)
    for path in sorted(glob.glob(sys.argv[1])):
        for key, values in moments(path).items():
            merged[key + ":first"].append(min(values))
            merged[key + ":last"].append(max(values))
    for key in sorted(merged, key=lambda k: statistics.median(merged[k])):
        values = merged[key]
        print(f"{key:45s} {statistics.median(values):7.1f}  "
              f"({min(values):.1f}-{max(values):.1f}) n={len(values)}")


if __name__ == "__main__":
    main()
