"""Where the copy of a `hot_spare` recovery's sync spent its time, thread CPU against run
queue wait against page faults, from jobs run with recovery_faults.patch applied to a
scratch copy of 4617a4d (recovery_steps_standby.patch's moments, each event also carrying the
thread's /proc/thread-self/schedstat and the process's minor faults) and ``--keep-logs``.

``python recovery_faults_show.py recovery_faults.json`` prints, for each job, the two members
of the spare's data-parallel group (``spare``: the one that prepared a model for the plan,
``surv``: its live peer) and each part of their copy: wall ms, the thread's CPU ms (``run``),
its time runnable but waiting for a core (``wait``) and the process's minor page faults
(``flt``). docs/benchmarks.md, "Recovery: where the time went", reads them.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PARTS = (("c0", "c1-flat", "flat state"), ("c1-flat", "c2-bcast", "broadcast"),
         ("c2-bcast", "kept", "rollback copy"))


def main() -> None:
    jobs: dict[str, list[dict[str, Any]]] = json.loads(Path(sys.argv[1]).read_text())
    for job, events in jobs.items():
        t0 = next(e["t"] for e in events if e["event"] == "fault_injected")
        moments: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        for e in events:
            if e["event"] == "dbg" and e.get("gen") == 1:
                moments[e["pid"]][e["phase"]] = e
        commit = min((e["t"] - t0) * 1000 for e in events
                     if e["event"] == "step" and e.get("generation") == 1)
        print(f"{job}: survivors commit {commit:.0f} ms")
        for seen in moments.values():
            if "c0" not in seen:
                continue
            who = "spare" if "prepared" in seen else "surv "
            cells = []
            for start, end, name in PARTS:
                a, b = seen[start], seen[end]
                cells.append(f"{name} {1000 * (b['t'] - a['t']):5.1f} "
                             f"(run {(b['run_ns'] - a['run_ns']) / 1e6:4.1f}, "
                             f"wait {(b['delay_ns'] - a['delay_ns']) / 1e6:4.1f}, "
                             f"flt {b['minflt'] - a['minflt']:4d})")
            print(f"  {who} " + " | ".join(cells))


if __name__ == "__main__":
    main()
