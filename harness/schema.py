"""The building blocks of scenario models, shared by the scenario format (harness/spec.py)
and the system kinds (harness/systems/): the strict, frozen base model, the numeric
limits and durations.

Numeric bounds (docs/scenarios.md, "Limits"): what one host can run, with room to spare.
A value past them is a typo or an attack, and was accepted until it broke something later
(10**400 steps; a 64 × 64 world of 4,096 processes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from harness._duration import Duration

__all__ = ["MAX_INDEX", "MAX_SEED", "MAX_STEPS", "MAX_WORLD", "Duration", "Strict"]

MAX_WORLD = 256  # processes of one scenario on one host: replicas × shards, or a command's
MAX_STEPS = 10_000_000  # steps, and counts of steps, calls or events
MAX_SEED = 2**32 - 1  # the range every seeded generator in the stack accepts (numpy's)
MAX_INDEX = 2**63 - 1  # offsets, sizes and element indexes (a signed 64-bit off_t)


class Strict(BaseModel):
    """Every scenario model: unknown keys are errors, values are frozen."""

    # allow_inf_nan: `.inf` and `.nan` are YAML floats, and no float in a scenario means them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
