"""Hypothesis strategies over fault schedules, for your own ``@given`` tests
(docs/explore.md): ``from aftershock.strategies import fault_schedules``. Needs the
``explore`` extra (``pip install 'aftershock[explore]'``). The implementation lives in
``aftershock.harness.search.strategies``; these are its public names.
"""

from __future__ import annotations

from aftershock.harness.search.explore import run_schedule
from aftershock.harness.search.strategies import (
    fault_schedules,
    faults,
    scenarios,
    space_of,
    system_options,
)

__all__ = ["fault_schedules", "faults", "run_schedule", "scenarios", "space_of",
           "system_options"]
