"""A tiny job for the Slurm witness tests (tests/slurm/test_slurm_witness.py): it counts
steps, keeps a checkpoint every 2 steps in its working folder (written whole, then renamed),
and resumes from it when it finds one, saying so on its output as a user's job would.

``mode``: ``correct``; ``ignores_checkpoint``, which starts from step 0 after a requeue
although its checkpoint is there; ``claims_resume``, which says it resumed from step 4 on
its first run, which Slurm never requeued."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STEPS = 24
STEP_S = 0.3


def main(mode: str) -> None:
    checkpoint = Path("checkpoint.txt")
    start = 0
    if mode == "claims_resume":
        print("resumed from step 4", flush=True)
        start = 4
    elif checkpoint.exists() and mode != "ignores_checkpoint":
        start = int(checkpoint.read_text())
        print(f"resumed from step {start}", flush=True)
    for step in range(start, STEPS):
        print(f"step {step}", flush=True)
        time.sleep(STEP_S)
        if step % 2 == 0:
            partial = Path(f"checkpoint.txt.{os.getpid()}")
            partial.write_text(str(step + 1))
            partial.replace(checkpoint)
            print(f"saved step {step + 1}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
