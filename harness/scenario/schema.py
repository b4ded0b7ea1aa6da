"""The building blocks of scenario models, shared by the scenario format (harness/scenario/spec.py)
and the system kinds (harness/systems/): the strict, frozen base model, the numeric
limits (docs/scenarios.md, "Limits") and durations.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# One definition each, shared with the fault kinds' parameters (faults/params.py).
from aftershock.faults.params import MAX_INDEX, MAX_SEED, MAX_STEPS, MAX_WORLD, Duration

__all__ = ["MAX_INDEX", "MAX_SEED", "MAX_STEPS", "MAX_WORLD", "Duration", "Strict"]


class Strict(BaseModel):
    """Every scenario model: unknown keys are errors, values are frozen."""

    # allow_inf_nan: `.inf` and `.nan` are YAML floats, and no float in a scenario means them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
