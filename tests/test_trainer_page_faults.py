"""A training rank does not fault its step's memory in again every step.

Each step frees and allocates the same megabytes again (autograd's fresh gradients, freed
once copied into the flat buffer; the optimizer's temporaries). With glibc's defaults that
memory went back to the kernel at each free and came back as page faults at the next
allocation: hundreds per step and rank with a model of a few million parameters, a few
percent of the step (bench/results/history-2026-12.md, "Page faults every step"). The
trainer keeps what it frees (``aftershock.reference_impl._memory.keep_freed``). A real one-rank job
(a Gloo group over env://, no torchrun) runs twice, short and long; the difference is what
the extra steps faulted, read from the kernel's accounting of the finished process (``wait4``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aftershock.reference_impl import _memory
from tests._helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: 2.1 M parameters, 2 MB per weight: large enough for glibc to hand the gradients' memory
#: back to the kernel between steps (the bench's 0.5 M-parameter model stays under it).
SHAPE = ["--d-model=256", "--hidden=2048", "--blocks=2"]
SHORT, LONG = 20, 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _minor_faults(steps: int, tmp_path: Path) -> int:
    """Minor page faults of a whole one-rank training job of ``steps`` steps."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": str(ROOT)}
    for name in ("AFTERSHOCK_EVENTS", "AFTERSHOCK_COMMANDS"):
        env.pop(name, None)  # a plain job: no probe, no fault engine
    log = tmp_path / f"steps-{steps}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aftershock.reference_impl.trainer",
                "--replicas=1",
                "--shards=1",
                *SHAPE,
                f"--steps={steps}",
                "--checkpoint-every=0",
                "--device=cpu",
                f"--checkpoint-dir={tmp_path / f'ckpt-{steps}'}",
            ],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.returncode is None and proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    return usage.ru_minflt


@pytest.mark.skipif(_memory._mallopt() is None, reason="no glibc mallopt here")
def test_a_training_step_does_not_fault_its_memory_in_again(tmp_path: Path) -> None:
    """Without ``keep_freed`` the extra steps faulted 1,900-2,750 pages each (checked with
    the call taken out of ``trainer.main``, two runs); with it, ~10."""
    short, long = _minor_faults(SHORT, tmp_path), _minor_faults(LONG, tmp_path)
    per_step = (long - short) / (LONG - SHORT)
    assert per_step < 50, (short, long, per_step)
