"""A fault kind's parameters: the base of their pydantic model, durations and limits.

Each kind declares its parameters once, as a :class:`FaultParams` model: names, types,
bounds, defaults and a description per field. The scenario format (harness/scenario/spec.py adds
``kind``, ``target``, ``at`` and ``every``), ``aftershock faults`` and docs/faults.md are
built from it, and the kind reads its parameters through it (:meth:`FaultParams.bind`),
so a default is written in one place.

Conventions the harness relies on:

- ``duration`` (a :data:`Duration`, default None): the fault is healed (``revert``) this
  long after it was applied; None: when the run ends.
- ``root`` (``str | None``): a kind that acts on files (it needs ``files``) names them
  relative to ``root``; the harness passes the folder, resolved (``${run_dir}``
  expanded; default: the system's own, e.g. the reference trainer's checkpoint folder).

This module imports pydantic: the probe (harness/probe.py) and the in-process engine
(faults/inproc.py) never import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, Self

from pydantic import BaseModel, ConfigDict

from aftershock.faults._duration import (
    DURATION_HELP,
    MAX_DURATION,
    Duration,
    format_duration,
    parse_duration,
)

__all__ = [
    "DURATION_HELP", "MAX_DURATION", "MAX_INDEX", "MAX_SEED", "MAX_STEPS", "MAX_WORLD",
    "Duration", "FaultParams", "format_duration", "parse_duration", "relative_glob",
]

#: Numeric bounds (docs/scenarios.md, "Limits"): what one host can run, with room to spare.
#: A value past them is a typo or an attack, and was accepted until it broke something later
#: (10**400 steps; a 64 × 64 world of 4,096 processes).
MAX_WORLD = 256  # processes of one scenario on one host: replicas × shards, or a command's
MAX_STEPS = 10_000_000  # steps, and counts of steps, calls or events
MAX_SEED = 2**32 - 1  # the range every seeded generator in the stack accepts (numpy's)
MAX_INDEX = 2**63 - 1  # offsets, sizes and element indexes (a signed 64-bit off_t)


class FaultParams(BaseModel):
    """The base of every kind's parameter model: strict (an unknown key is an error) and
    frozen. Validators may read the rest of the fault (``at``, ``target``) with
    ``getattr(self, "at", None)``: in a scenario the model is part of the fault's."""

    # allow_inf_nan: `.inf` and `.nan` are YAML floats, and no float in a scenario means them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def bind(cls, params: Mapping[str, Any]) -> Self:
        """This model from what ``inject`` was given (JSON values, durations in seconds):
        defaults filled in, values checked (a bad one raises ValueError). Keys the model does
        not name are the harness's (``root`` resolved, ``prepared``, ``at_step``, ...)."""
        return cls.model_validate({k: v for k, v in params.items() if k in cls.model_fields})

    @classmethod
    def default(cls, name: str) -> Any:
        """The declared default of parameter ``name``."""
        return cls.model_fields[name].get_default(call_default_factory=True)


def relative_glob(value: str, what: str) -> str:
    """A path (or glob) that stays under the folder it is relative to."""
    pure = PurePosixPath(value)
    if not value or pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"{what} must be a relative path under the fault's root, without "
                         f"'..' (got {value!r})")
    return value
