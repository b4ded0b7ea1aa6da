"""Each overhead row's pairs split by the order of their repetition.

``python bench/results/profiles/order_split.py REV [REV ...]`` reads
``REV:bench/results/partial.json`` (``make bench-targets`` records kept in git) and prints,
per record and pooled over all of them, the median overhead against ``ddp`` of each row in
the repetitions run in the given order (0, 2, 4, ...: ``ddp`` first, ``trainer_no_ckpt``
right after it) and in the reversed ones (``trainer_no_ckpt`` right after ``hot_spare``,
``ddp`` last) (``bench.stats.run_order``). A row that a faulted row's aftermath slowed would
show it in the reversed repetitions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

ROWS = ("trainer_no_ckpt", "hot_spare", "elastic")


def overheads(rev: str, row: str) -> tuple[list[float], list[float]]:
    """(given order, reversed order) overheads of ``row`` in the record at ``rev``."""
    record = json.loads(subprocess.check_output(
        ["git", "show", f"{rev}:bench/results/partial.json"]))
    values = [run.get("overhead") for run in record["runs"][row]]
    given = [v for i, v in enumerate(values) if i % 2 == 0 and v is not None]
    reversed_ = [v for i, v in enumerate(values) if i % 2 == 1 and v is not None]
    return given, reversed_


def main(revs: list[str]) -> None:
    pooled: dict[str, tuple[list[float], list[float]]] = {row: ([], []) for row in ROWS}
    for rev in revs:
        parts = []
        for row in ROWS:
            given, reversed_ = overheads(rev, row)
            pooled[row][0].extend(given)
            pooled[row][1].extend(reversed_)
            parts.append(f"{row} {statistics.median(given):+.1%} / "
                         f"{statistics.median(reversed_):+.1%}")
        print(rev, " | ".join(parts))
    for row, (given, reversed_) in pooled.items():
        print(f"all {row}: given order {statistics.median(given):+.1%} ({len(given)} pairs), "
              f"reversed {statistics.median(reversed_):+.1%} ({len(reversed_)} pairs)")


if __name__ == "__main__":
    main(sys.argv[1:])
