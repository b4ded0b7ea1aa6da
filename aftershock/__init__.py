"""Aftershock: fault injection and reliability tests for distributed PyTorch training and LLM
serving.

What this package promises to keep (``__all__``; docs/ teach only these names):

    import aftershock

    scenario = aftershock.load("scenarios/training/kill_rank_restart.yaml")
    result = aftershock.run(scenario, seed=3)
    aftershock.check(result)          # AssertionError with the check table if it failed

- scenarios and runs: ``load``, ``loads``, ``from_dict``, ``run``, ``check``, ``Scenario``,
  ``LoadedScenario``, ``RunResult``, ``CheckResult``, ``FaultRecord``, ``Observer``;
- ``probe``: what a job imports to tell the harness its steps, checkpoints and recoveries
  (``from aftershock import probe``; standard library only, cheap in every rank);
- ``strategies``: hypothesis strategies over fault schedules, and ``run_schedule`` to run
  one (the ``explore`` extra);
- plug-ins (docs/extending.md): ``FaultKind`` with ``KindInfo``, ``Applied``, ``Setting``,
  ``FaultParams`` and ``Duration``; ``FaultUnavailable``, ``UndoContext``; ``Check`` with
  ``Run`` and ``CheckParams``.

The implementation lives in ``aftershock.harness``, ``aftershock.faults`` and
``aftershock.reference_impl``; nothing there is promised to stay as it is. Names are
imported on first use, so ``import aftershock`` costs a job nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the module it comes from (imported when first asked for).
_FROM = {
    "load": "aftershock.harness.api", "loads": "aftershock.harness.api",
    "from_dict": "aftershock.harness.api", "run": "aftershock.harness.api",
    "check": "aftershock.harness.api", "Scenario": "aftershock.harness.api",
    "LoadedScenario": "aftershock.harness.api", "RunResult": "aftershock.harness.api",
    "CheckResult": "aftershock.harness.api", "FaultRecord": "aftershock.harness.api",
    "Observer": "aftershock.harness.api",
    "FaultKind": "aftershock.faults.registry", "KindInfo": "aftershock.faults.registry",
    "Applied": "aftershock.faults.registry", "Setting": "aftershock.faults.registry",
    "FaultParams": "aftershock.faults.params", "Duration": "aftershock.faults.params",
    "FaultUnavailable": "aftershock.faults._errors",
    "UndoContext": "aftershock.faults.journal",
    "Check": "aftershock.harness.verdict.check_registry",
    "Run": "aftershock.harness.verdict.check_registry",
    "CheckParams": "aftershock.harness.verdict.check_registry",
}
#: Public modules.
_MODULES = {"probe": "aftershock.probe", "strategies": "aftershock.strategies"}

__all__ = sorted([*_FROM, *_MODULES, "__version__"])

if TYPE_CHECKING:
    from aftershock import probe as probe
    from aftershock import strategies as strategies
    from aftershock.faults._errors import FaultUnavailable as FaultUnavailable
    from aftershock.faults.journal import UndoContext as UndoContext
    from aftershock.faults.params import Duration as Duration
    from aftershock.faults.params import FaultParams as FaultParams
    from aftershock.faults.registry import Applied as Applied
    from aftershock.faults.registry import FaultKind as FaultKind
    from aftershock.faults.registry import KindInfo as KindInfo
    from aftershock.faults.registry import Setting as Setting
    from aftershock.harness.api import CheckResult as CheckResult
    from aftershock.harness.api import FaultRecord as FaultRecord
    from aftershock.harness.api import LoadedScenario as LoadedScenario
    from aftershock.harness.api import Observer as Observer
    from aftershock.harness.api import RunResult as RunResult
    from aftershock.harness.api import Scenario as Scenario
    from aftershock.harness.api import check as check
    from aftershock.harness.api import from_dict as from_dict
    from aftershock.harness.api import load as load
    from aftershock.harness.api import loads as loads
    from aftershock.harness.api import run as run
    from aftershock.harness.verdict.check_registry import Check as Check
    from aftershock.harness.verdict.check_registry import CheckParams as CheckParams
    from aftershock.harness.verdict.check_registry import Run as Run


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _FROM:
        value = getattr(importlib.import_module(_FROM[name]), name)
    else:
        raise AttributeError(f"module 'aftershock' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
