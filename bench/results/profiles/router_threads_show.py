"""``python bench/results/profiles/router_threads_show.py DIR [TOKENS]``: the router
processes sampled by ``router_threads/sitecustomize.py``, in the order they ran, each one's
CPU by role in µs per token (TOKENS: tokens per run, 240 requests x 32 by default), then the
median of each role over the journaling runs and over the others."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path


def main(folder: str, tokens: int) -> None:
    runs = [json.loads(p.read_text()) for p in
            sorted(Path(folder).glob("*.json"), key=os.path.getmtime)]
    roles = sorted({role for run in runs for role in run["roles_s"]})
    for run in runs:
        parts = " ".join(f"{role} {run['roles_s'].get(role, 0.0) / tokens * 1e6:.1f}"
                         for role in roles)
        print(f"{'journal' if run['journal'] else 'bare   '} total "
              f"{run['total_s'] / tokens * 1e6:.1f} | {parts}")
    for journal in (True, False):
        chosen = [run for run in runs if run["journal"] is journal]
        if chosen:
            medians = {role: statistics.median(r["roles_s"].get(role, 0.0) for r in chosen)
                       for role in roles}
            parts = " ".join(f"{role} {s / tokens * 1e6:.1f}" for role, s in medians.items())
            print(f"median {'journal' if journal else 'bare'} ({len(chosen)} runs): total "
                  f"{statistics.median(r['total_s'] for r in chosen) / tokens * 1e6:.1f} | "
                  f"{parts}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 240 * 32)
