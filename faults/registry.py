"""The registry of fault kinds and the protocols each kind follows.

A fault kind is one object that declares everything about it (:class:`FaultKind`): its
name and catalogue text (``info``), its parameters as a pydantic model (``params``,
faults/params.py), where it acts (``acts``: from outside the target's processes, inside
them through the in-process probe, or either, depending on its parameters), what the
target must let it do (``needs``, :data:`CAPABILITIES`), and its steps: ``prepare``
(optional, before launch), ``inject`` (or ``inject_group``), ``revert``, ``validate``.
The scenario format, ``aftershock faults`` and docs/faults.md are built from these
declarations. Built-in kinds live in this package; other packages add kinds through the
``aftershock.faults`` entry-point group (docs/extending.md).

This module imports the standard library only (the probe imports the package).

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
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from faults._proc import ProcessRef
from faults.journal import Journal, UndoContext

if TYPE_CHECKING:
    from faults.params import FaultParams

ENTRY_POINT_GROUP = "aftershock.faults"
_BUILTIN_MODULES = (
    "faults.process", "faults.xid", "faults.memory", "faults.collective",
    "faults.net", "faults.storage", "faults.straggle", "faults.node",
)

#: What a target lets faults act through. A kind names those it needs (``needs``); a
#: target those it offers (harness/target.py); a system's job may add ``probe``. A scenario
#: whose fault needs what its system lacks is refused when it is validated.
CAPABILITIES: Mapping[str, str] = {
    "signals": "signals to the target's processes by pid (kill, stop, continue)",
    "memory": "the target's memory through /proc/PID/mem",
    "network": "the target's sockets, in the harness's own network namespace",
    "files": "the target's files, at the paths the harness sees",
    "probe": "the in-process probe: the job calls harness.probe.install()",
    "containers": "the target's nodes are containers of a Docker engine (docs/nodes.md)",
}

#: Where a kind acts: from outside the target's processes, inside them (the in-process probe
#: applies it at an exact step, phase or call), or either, depending on its parameters.
Acts = Literal["outside", "inside", "either"]


@dataclass(frozen=True, slots=True)
class KindInfo:
    """What `aftershock faults` prints about a kind."""

    kind: str
    summary: str
    caused_by: str  # how the fault is really caused, in one or two sentences
    #: name -> meaning, for a kind without a ``params`` model (its parameters' own
    #: descriptions are the text otherwise)
    params: Mapping[str, str] = field(default_factory=dict)
    reverted_by: str = "nothing to undo"
    details: str = ""  # more, in Markdown, for docs/faults.md (a section of its own)


@dataclass(frozen=True, slots=True)
class Applied:
    """A fault that was applied; ``journal_id`` is None when there is nothing to undo."""

    kind: str
    journal_id: str | None
    undo: Mapping[str, Any]
    detail: str


class FaultKind(Protocol):
    """A fault kind. ``params`` may be absent on a kind used only from Python (a test's):
    it then has no place in scenarios."""

    @property
    def info(self) -> KindInfo: ...

    @property
    def params(self) -> type[FaultParams]:
        """Its parameters (faults/params.py)."""
        ...

    @property
    def acts(self) -> Acts: ...

    @property
    def needs(self) -> frozenset[str]:
        """The CAPABILITIES it needs when it acts from outside (inside: ``probe``)."""
        ...

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


class ActsEither(Protocol):
    """A kind that acts inside or outside depending on its parameters (``acts: either``)."""

    inside_when: str  # when it acts inside, for messages: "with `tensor`"

    def inside(self, params: FaultParams, phase: str | None) -> bool:
        """Whether, with these parameters and the trigger's ``at.phase``, it acts inside."""
        ...


class Resolves(Protocol):
    """Optional on a kind: parameters that name something a rank published at start-up
    (the probe's ``tensors`` event: where each parameter lives) become what ``inject``
    takes, for that rank, just before it is applied."""

    def resolve(self, params: Mapping[str, Any], published: Mapping[str, Any]
                ) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Setting:
    """What a kind's scenario check may know about the system it is used against."""

    system: str  # the system kind: trainer, server, command, ...
    root_is_run_folder: bool  # `root` defaults to the run folder itself (the timeline's)


class AimsAtFiles(Protocol):
    """Optional on a kind that acts on files under a ``root``: the parameter that names them
    (a glob under ``root``) and whether it acts on what matches as a whole (a folder
    deleted, or a mount over it). `validate` refuses a fault whose aim can reach the
    harness's own records; at the fault the kind refuses what resolves into ``guarded``."""

    def aim(self) -> tuple[str, bool]: ...


class ChecksScenario(Protocol):
    """Optional on a kind: its rules across a whole scenario (at most one per scenario,
    a parameter a system needs); each problem one sentence."""

    def check(self, faults: Sequence[Any], setting: Setting) -> list[str]: ...


def acts_inside(kind: FaultKind, params: Any, phase: str | None) -> bool:
    """Whether ``kind`` with ``params`` (its model, or the fault's) acts inside the target."""
    acts = getattr(kind, "acts", "outside")
    if acts == "either":
        return bool(kind.inside(params, phase))  # type: ignore[attr-defined]
    return bool(acts == "inside")


def needs(kind: FaultKind, params: Any, phase: str | None) -> frozenset[str]:
    """What ``kind`` with ``params`` needs from the target (CAPABILITIES)."""
    custom = getattr(kind, "needs_for", None)
    if callable(custom):
        return frozenset(custom(params, phase))
    if acts_inside(kind, params, phase):
        return frozenset({"probe"})
    return frozenset(getattr(kind, "needs", frozenset()))


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


def declared(kind: FaultKind) -> bool:
    """Whether ``kind`` declares its parameters (and so has a place in scenarios)."""
    return isinstance(getattr(kind, "params", None), type)


def preflight(kind: str, params: Mapping[str, Any]) -> list[str]:
    """What this machine lacks for ``kind`` with ``params``: nothing for a kind without a
    ``preflight`` hook (it says at inject time, through FaultUnavailable)."""
    check = getattr(get(kind), "preflight", None)
    return list(check(params)) if callable(check) else []
