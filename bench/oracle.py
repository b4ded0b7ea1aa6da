"""The bench's correctness check: each row's final parameters against the independent oracle.

:func:`expected` sends ``{"shape": {...}, "seed", "steps", "schedule"}`` to ``python -m
aftershock.harness.oracle.trainer_math`` and reads ``{"digests": {rank: sha256}}``: what every rank
must
end with, recomputed by the oracle (which restates the reference trainer's math and imports
nothing from ``reference_impl`` or ``bench``) for the bench's model shape. A recovery that is
fast but wrong then shows as wrong next to its times (docs/benchmarks.md, "What proves it").

The DDP rows train the same model on the same data with the same optimizer; a sum of two
replicas' gradients is the same bits whoever adds them (``a + b == b + a``), and DDP's
division of each replica's gradients by 2 before the sum is exact (barring subnormals), so
they are held to the same digests. torchft rows are not checked (``Peer.fixed_end``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def expected(shape: dict[str, int], seed: int, steps: int, schedule: list[list[Any]],
             cache: dict[str, dict[int, str]] | None = None, device: str = "cpu"
             ) -> dict[int, str]:
    """Each rank's final digest, computed in a fresh one-thread process (like a rank); on
    ``device="cuda"`` (one NCCL rank, ``python -m bench --gpu``) on the GPU, with the kernels
    the rank runs there."""
    request = {"shape": shape, "seed": seed, "steps": steps, "schedule": schedule,
               "device": device}
    key = json.dumps(request, sort_keys=True)
    if cache is not None and key in cache:
        return cache[key]
    proc = subprocess.run(
        [sys.executable, "-m", "aftershock.harness.oracle.trainer_math"],
        input=key,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    digests = {int(k): str(v) for k, v in json.loads(proc.stdout)["digests"].items()}
    if cache is not None:
        cache[key] = digests
    return digests
