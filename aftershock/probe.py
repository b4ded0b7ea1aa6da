"""What a job calls to tell Aftershock its steps, checkpoints and recoveries, and where
in-process faults may act: ``from aftershock import probe`` (or ``import aftershock.probe``).

Standard library only, and a no-op unless the harness launched the process, so a trainer
can keep these calls in production code (docs/own-job.md). The implementation and its
state live in ``aftershock.harness.probe``; these are its public names.
"""

from __future__ import annotations

from aftershock.harness.probe import (
    checkpoint_loaded,
    checkpoint_saved,
    checkpoint_skipped,
    detected,
    emit,
    enabled,
    fault_point,
    hello,
    install,
    output_dir,
    params,
    recovered,
    set_rank,
    step,
    wrap_group,
)

__all__ = ["checkpoint_loaded", "checkpoint_saved", "checkpoint_skipped", "detected", "emit",
           "enabled", "fault_point", "hello", "install", "output_dir", "params", "recovered",
           "set_rank", "step", "wrap_group"]
