"""Where a hot_spare recovery goes, from jobs run with recovery_steps.patch and --keep-logs.

``python recovery_steps_show.py 'DIR*/rep1/hot_spare/events.jsonl'`` prints, per job and as
medians, the milliseconds after the SIGKILL at which each moment came (docs/benchmarks.md,
"Where a `hot_spare` recovery goes now").
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from typing import Any

COLUMNS = ["detect", "plan (spare)", "teardown end (last survivor)", "arrived (spare)",
           "world", "tp", "dp", "star", "built (spare)", "last recovery_done",
           "last step 301"]


def moments(events: list[dict[str, Any]]) -> list[float]:
    kill = next(e["t"] for e in events if e["event"] == "fault_injected")
    detected = next(e["t"] for e in events if e["event"] == "failure_detected")
    dbg = [e for e in events if e["event"] == "dbg" and e["t"] > kill]
    spare = next(e["slot"] for e in events if e["event"] == "hello"
                 and e.get("role") == "trainer" and e.get("generation") == 1)

    def at(phase: str, slot: int | None = None) -> float:
        times = [e["t"] for e in dbg if e["phase"] == phase and slot in (None, e["slot"])]
        return (max(times) - kill) * 1000 if times else float("nan")

    done = max(e["t"] for e in events
               if e["event"] == "recovery_done" and e.get("generation") == 1)
    first = max(e["t"] for e in events if e["event"] == "step"
                and e.get("generation") == 1 and e.get("step") == 301)
    return [(detected - kill) * 1000, at("plan", spare), at("teardown-end"),
            at("arrived", spare), at("world", spare), at("tp", spare), at("dp", spare),
            at("star", spare), at("built", spare), (done - kill) * 1000,
            (first - kill) * 1000]


def main() -> None:
    rows = []
    for path in sorted(glob.glob(sys.argv[1])):
        with open(path) as f:
            rows.append(moments([json.loads(line) for line in f]))
        print(" ".join(f"{v:6.1f}" for v in rows[-1]))
    print("median:")
    for name, values in zip(COLUMNS, zip(*rows, strict=True), strict=True):
        print(f"  {name:30} {statistics.median(values):6.1f} ms "
              f"({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
