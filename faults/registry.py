"""The registry of fault kinds and the protocol each kind follows."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from faults._proc import ProcessRef
from faults.journal import Journal

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
