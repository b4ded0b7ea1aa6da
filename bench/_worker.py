"""What the peer workers (plain DDP, torchft) share with the reference trainer.

The same model (``aftershock.reference_impl.model.ParallelMLP``: replicas × tensor-parallel
shards), the
same data (``synthetic_batch`` keyed by seed, step and replica), the same optimizer, and the
same event stream (``aftershock.harness.probe`` lines in ``$AFTERSHOCK_EVENTS``), so every row of
the
benchmark is timed from the same kind of per-step timestamps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from aftershock.harness import probe


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The reference trainer's model and run flags, with its defaults."""
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--collective-timeout", type=float, default=10.0)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: each rank on cuda:LOCAL_RANK (with --backend nccl)")


def exit_on_sigterm() -> None:
    """torchrun stops survivors with SIGTERM: record that as their detection and leave at once.

    Mirrors the reference trainer, so "time to detect" means the same for every torchrun job.
    """

    def handler(signum: int, frame: Any) -> None:
        probe.detected(cause="terminated: SIGTERM from the launcher", signal=signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def fail(exc: BaseException) -> None:
    """A collective failed: record it and exit without running process-group destructors."""
    probe.detected(cause=f"collective_error: {str(exc).strip().splitlines()[0][:200]}")
    print(f"[rank {os.environ.get('RANK')}] failure: {exc}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)
