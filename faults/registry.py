"""The registry of fault kinds and the protocols each kind follows.

A kind that journals an undo record also gives ``validate(undo, context)``
(:class:`Validates`): a heal, often run as root, calls it on every record before
``revert`` and refuses the record unless it names only what the run can be
proven to have made (docs/security.md). A kind without one has its records
refused: that is the safe default for third-party kinds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from faults._proc import ProcessRef
from faults.journal import Journal, UndoContext

ENTRY_POINT_GROUP = "aftershock.faults"
_BUILTIN_MODULES = (
    "faults.process", "faults.xid", "faults.memory", "faults.inproc",
    "faults.net", "faults.storage", "faults.straggle",
)


@dataclass(frozen=True, slots=True)
class KindInfo:
    """What `aftershock faults` prints about a kind."""

    kind: str
    summary: str
    caused_by: str  # how the fault is really caused, in one or two sentences
    params: Mapping[str, str] = field(default_factory=dict)  # name -> meaning and default
    reverted_by: str = "nothing to undo"


@dataclass(frozen=True, slots=True)
class Applied:
    """A fault that was applied; ``journal_id`` is None when there is nothing to undo."""

    kind: str
    journal_id: str | None
    undo: Mapping[str, Any]
    detail: str


class FaultKind(Protocol):
    info: KindInfo

    def inject(
        self, target: ProcessRef, params: Mapping[str, Any], journal: Journal
    ) -> Applied:
        """Apply the fault. Anything to undo is journaled *before* it is done."""
        ...

    def revert(self, undo: Mapping[str, Any]) -> None:
        """Undo the fault from its journal record alone; idempotent."""
        ...


class Validates(Protocol):
    """A kind whose undo records a heal can check before acting on them."""

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        """Return if ``undo`` names only what ``context``'s run made, else raise
        ``faults.journal.UndoRefused`` saying why. Build it from the context's checks
        (``process``, ``path``, ``state_path``, ``name``, ``cgroup``); any other error
        raised here (a missing key, a wrong type) also refuses the record."""
        ...


def validator(kind: FaultKind) -> Callable[[Mapping[str, Any], UndoContext], None] | None:
    """The kind's ``validate``, or None when it gives none (its records are refused)."""
    check = getattr(kind, "validate", None)
    return check if callable(check) else None


class Preflight(Protocol):
    """Optional on a kind: what this machine lacks to cause the fault with ``params``.

    Each problem is one line naming what is missing and how to get it (a tool and its
    package, a kernel feature, a privilege). Called before anything is launched, so a
    scenario that cannot work here fails at once instead of after its system ran.
    """

    def preflight(self, params: Mapping[str, Any]) -> list[str]: ...


@runtime_checkable
class PreparedKind(Protocol):
    """A kind that needs something in place before the system starts (a filesystem under its
    checkpoint folder). The runner calls ``prepare`` before launch, passes the returned
    ``undo`` to ``inject`` as ``params["prepared"]``, and reverts it (``revert(undo)``) once
    the system is gone. Journaled before it is made, like any fault."""

    def prepare(self, params: Mapping[str, Any], journal: Journal) -> Applied: ...


@runtime_checkable
class GroupKind(Protocol):
    """A kind whose targets must all be hit at one instant (a power loss takes every process
    down together), so the runner hands it every chosen target in one call."""

    def inject_group(
        self, targets: Sequence[ProcessRef], params: Mapping[str, Any], journal: Journal
    ) -> Applied: ...


_registry: dict[str, FaultKind] = {}
_loaded = False


def register(kind: FaultKind) -> FaultKind:
    if kind.info.kind in _registry and _registry[kind.info.kind] is not kind:
        raise ValueError(f"fault kind {kind.info.kind!r} is registered twice")
    _registry[kind.info.kind] = kind
    return kind


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        loaded = entry.load()
        for kind in loaded if isinstance(loaded, list | tuple) else [loaded]:
            register(kind)


def get(kind: str) -> FaultKind:
    _load()
    try:
        return _registry[kind]
    except KeyError:
        raise KeyError(
            f"unknown fault kind {kind!r} (known: {', '.join(sorted(_registry))})"
        ) from None


def kinds() -> list[FaultKind]:
    _load()
    return [_registry[name] for name in sorted(_registry)]


def preflight(kind: str, params: Mapping[str, Any]) -> list[str]:
    """What this machine lacks for ``kind`` with ``params``: nothing for a kind without a
    ``preflight`` hook (it says at inject time, through FaultUnavailable)."""
    check = getattr(get(kind), "preflight", None)
    return list(check(params)) if callable(check) else []
