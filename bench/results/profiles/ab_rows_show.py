"""Two sides of ab_rounds.sh compared.

``python ab_rows_show.py OUT ROW`` (OUT: ab_rounds.sh's folder) or ``python ab_rows_show.py
prefault_ab_ROW.json ROW`` (a packed record of one) prints, per metric, each side's median
(range) over every job, the difference of the medians, the share of (A, B) job pairs in which
B is lower, a two-sided permutation test of the difference of the medians (4,000 shuffles,
seeded), and the difference of the medians round by round.
"""

from __future__ import annotations

import glob
import json
import random
import statistics
import sys
from pathlib import Path

METRICS = ("resume_s", "full_s", "steps_per_s", "overhead", "cpu_ms_per_step")


def rounds_of(where: str, side: str, metric: str, row: str) -> list[list[float]]:
    """Each round's job values of ``metric`` on ``side``, in round order."""
    if where.endswith(".json"):  # a packed record
        packed = json.loads(Path(where).read_text())["rounds"]
        return [r[metric] for r in sorted(packed, key=lambda r: r["round"])
                if r["side"] == side and r.get(metric)]
    out = []
    files = sorted(glob.glob(f"{where}/{side}-*.json"),
                   key=lambda p: int(p.rsplit("-", 1)[1][:-5]))
    for path in files:
        summary = json.loads(Path(path).read_text())["summary"][row]
        if summary.get(metric):
            out.append(summary[metric]["values"])
    return out


def permutation_p(a: list[float], b: list[float], shuffles: int = 4000) -> float:
    observed = abs(statistics.median(b) - statistics.median(a))
    pool, n, rnd, hits = a + b, len(a), random.Random(1), 0
    for _ in range(shuffles):
        rnd.shuffle(pool)
        if abs(statistics.median(pool[n:]) - statistics.median(pool[:n])) >= observed:
            hits += 1
    return hits / shuffles


def main() -> None:
    where, row = sys.argv[1], sys.argv[2]
    for metric in METRICS:
        side_a, side_b = rounds_of(where, "A", metric, row), rounds_of(where, "B", metric, row)
        if not side_a or not side_b:
            continue
        a = [x for r in side_a for x in r]
        b = [x for r in side_b for x in r]
        lower = sum((y < x) + 0.5 * (y == x) for x in a for y in b) / (len(a) * len(b))
        diff = statistics.median(b) - statistics.median(a)
        by_round = [round(statistics.median(y) - statistics.median(x), 4)
                    for x, y in zip(side_a, side_b, strict=False)]
        print(f"{metric:15s} A {statistics.median(a):.4f} ({min(a):.3f}-{max(a):.3f})  "
              f"B {statistics.median(b):.4f} ({min(b):.3f}-{max(b):.3f})  diff {diff:+.4f}  "
              f"B lower {lower:.2f}  permutation p {permutation_p(a, b):.4f}  "
              f"by round {by_round}")


if __name__ == "__main__":
    main()
