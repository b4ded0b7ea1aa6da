"""``python bench/results/profiles/serving_ab_show.py FILE``: an A/B of two servers packed
from ``reader_writes_ab.sh``'s output (``stream_writer_ab.json``): per side, the bench's
pairs (throughput and CPU cost of ``durable`` against ``bare``) and each row's medians over
every run, then the router's CPU by thread (as ``router_threads_show.py`` prints it)."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(path: str) -> None:
    with open(path) as file:
        packed: dict[str, Any] = json.load(file)
    tokens = packed["tokens_per_run"]
    for side in ("A", "B"):
        rounds = packed["bench"][side]
        pairs = [p for r in rounds for p in r["throughput_pairs"]]
        cpu = {part: _median([p for r in rounds for p in r["cpu_pairs"][part]])
               for part in ("server", "router", "workers")}
        checks = [run["passed"] for r in rounds for row in r["rows"].values() for run in row]
        print(f"{side} ({packed[side]}): {len(pairs)} pairs, throughput cost "
              f"{_median(pairs):+.1%} ({min(pairs):+.1%} to {max(pairs):+.1%}), CPU cost: "
              + ", ".join(f"{part} {value:+.1%}" for part, value in cpu.items())
              + f"; checks passed {sum(checks)}/{len(checks)}")
        for row in ("bare", "durable"):
            runs = [run for r in rounds for run in r["rows"][row]]
            figures = ", ".join(f"{key} {_median([run[key] for run in runs]):.4g}"
                                for key in runs[0] if key != "passed")
            print(f"  {row:8s} {figures}")
        for journal in (False, True):
            chosen = [run for run in packed["runs"][side] if run["journal"] is journal]
            roles = sorted({role for run in chosen for role in run["roles_s"]})
            per_token = {role: _median([r["roles_s"].get(role, 0.0) for r in chosen])
                         / tokens * 1e6 for role in roles}
            parts = ", ".join(f"{role} {us:.1f}" for role, us in per_token.items())
            total = _median([r["total_s"] for r in chosen]) / tokens * 1e6
            print(f"  router µs a token, {'journal' if journal else 'bare'}: total {total:.1f} "
                  f"({parts})")


if __name__ == "__main__":
    main(sys.argv[1])
