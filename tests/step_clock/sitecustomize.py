"""Test-only, outside the harness: records from inside each worker of a job the moment of
its first optimizer step, the independent truth a recovery time is compared against
(tests/test_recovery_proof.py).

A test puts this folder on the job's ``PYTHONPATH`` and a file's path in
``AFTERSHOCK_TEST_STEP_CLOCK``; Python imports ``sitecustomize`` at start-up in every process
of the job. In a worker (torchrun sets ``LOCAL_RANK``) it registers a global optimizer
step post-hook that appends one JSON line at the first ``Optimizer.step()`` that returns:
``time.monotonic()`` (CLOCK_MONOTONIC, the timeline's clock on this host), the pid, ``RANK``
and ``TORCHELASTIC_RESTART_COUNT``. The job's own code is not touched.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

FILE_ENV = "AFTERSHOCK_TEST_STEP_CLOCK"


def _install(path: str) -> None:
    # The worker imports torch on its first line anyway: importing it here costs it nothing.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    recorded = False

    def first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal recorded
        if recorded:
            return
        recorded = True
        line = {"t": time.monotonic(), "pid": os.getpid(),
                "rank": int(os.environ.get("RANK", "-1")),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        # One short append per process: whole lines, whatever the other ranks write.
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")

    register_optimizer_step_post_hook(first_step)


if os.environ.get(FILE_ENV) and "LOCAL_RANK" in os.environ:
    _install(os.environ[FILE_ENV])
