"""``python bench/results/profiles/heavier_trainer_show.py FILE``: the trainer's loop
(`trainer_no_ckpt`) against DDP on the bench's model and on a heavier one, from runs packed
in ``heavier_trainer_ab.json`` or ``keep_freed_ab.json`` (each a ``python -m bench --only
ddp,trainer_no_ckpt`` record, with ``heavier_trainer.patch`` applied; in the second, each
run also names its side: the code before or after the trainer kept freed memory). Per
run, in the order they ran: the model, DDP's steps/s, the loop's overhead in time and CPU
with the bench's verdict, and the phases that differ (rank 0's wall / all ranks'
main-thread CPU, ms per step, medians)."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

PHASES = ("forward", "backward", "average", "vote", "optimizer")


def _phases(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    out = {}
    for phase in {p for run in runs for p in run.get("phases") or {}}:
        found = [run["phases"][phase] for run in runs if phase in (run.get("phases") or {})]
        out[phase] = (statistics.median(f["wall_ms"] for f in found),
                      statistics.median(f["cpu_ms"] for f in found))
    return out


def main(path: str) -> None:
    with open(path) as file:
        packed: dict[str, Any] = json.load(file)
    print(f"{packed['command']}\n")
    for run in packed["runs"]:
        record = run["record"]
        targets = {t["target"]: t for t in record["targets"]}
        time_t = targets["trainer loop alone (trainer_no_ckpt) ≤ 3% vs plain DDP"]
        cpu_t = targets["trainer loop alone (trainer_no_ckpt) CPU ≤ 3% over plain DDP "
                        "(shows only over)"]
        summary = record["summary"]
        matched = [summary[row]["params"]["match"] for row in ("ddp", "trainer_no_ckpt")]
        side = f", {run['side']}" if "side" in run else ""
        print(f"{run['shape']}{side}: {record['model']['description']}; round {run['round']}")
        print(f"  ddp {summary['ddp']['steps_per_s']['median']:.1f} steps/s; params = oracle "
              f"{matched[0]} and {matched[1]} of {record['settings'].get('repeat', '?')}")
        print(f"  trainer_no_ckpt over DDP, time {time_t['value']:+.1%}: {time_t['note']}")
        print(f"  trainer_no_ckpt over DDP, CPU {cpu_t['value']:+.1%}: {cpu_t['note']}")
        ddp, loop = (_phases(record["runs"][row]) for row in ("ddp", "trainer_no_ckpt"))
        for phase in PHASES:
            left = "{:.2f} / {:.2f}".format(*ddp[phase]) if phase in ddp else "-"
            right = "{:.2f} / {:.2f}".format(*loop[phase]) if phase in loop else "-"
            print(f"    {phase:10s} ddp {left:>14s}   trainer_no_ckpt {right:>14s}")


if __name__ == "__main__":
    main(sys.argv[1])
