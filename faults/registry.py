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

Every kind is checked against :data:`PROTOCOL` when it registers, and its optional parts
are read then into :class:`Hooks` (:func:`hooks`): the harness looks them up there and
nowhere else. A plug-in the protocol refuses is named in one line and skipped
(faults/plugins.py); a scenario that uses it fails with that line.

This module imports the standard library only (the probe imports the package).

A kind that journals an undo record also gives ``validate(undo, context)``
(:class:`Validates`): a heal, often run as root, calls it on every record before
``revert`` and refuses the record unless it names only what the run can be
proven to have made (docs/security.md). A kind without one has its records
refused: that is the safe default for third-party kinds.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

from aftershock.faults import plugins
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, UndoContext

if TYPE_CHECKING:
    from aftershock.faults.params import FaultParams

ENTRY_POINT_GROUP = "aftershock.faults"
_BUILTIN_MODULES = (
    "aftershock.faults.process",
    "aftershock.faults.xid",
    "aftershock.faults.memory",
    "aftershock.faults.collective",
    "aftershock.faults.net",
    "aftershock.faults.storage",
    "aftershock.faults.straggle",
    "aftershock.faults.node",
    "aftershock.faults.slurm",
)

#: What a target lets faults act through. A kind names those it needs (``needs``); a
#: target those it offers (harness/run/target.py); a system's job may add ``probe``. A scenario
#: whose fault needs what its system lacks is refused when it is validated.
CAPABILITIES: Mapping[str, str] = {
    "signals": "signals to the target's processes by pid (kill, stop, continue)",
    "memory": "the target's memory through /proc/PID/mem",
    "network": "the target's sockets, in the harness's own network namespace",
    "files": "the target's files, at the paths the harness sees",
    "probe": "the in-process probe: the job calls aftershock.probe.install()",
    "containers": "the target's nodes are containers of a Docker engine (docs/nodes.md)",
    "slurm": "the target is a Slurm job, its processes' environment names it (scale-out.md)",
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

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        """Apply the fault. Anything to undo is journaled *before* it is done."""
        ...

    def revert(self, undo: Mapping[str, Any]) -> None:
        """Undo the fault from its journal record alone; idempotent."""
        ...


class Validates(Protocol):
    """A kind whose undo records a heal can check before acting on them."""

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        """Return if ``undo`` names only what ``context``'s run made, else raise
        ``aftershock.faults.journal.UndoRefused`` saying why. Build it from the context's checks
        (``process``, ``path``, ``state_path``, ``name``, ``cgroup``); any other error
        raised here (a missing key, a wrong type) also refuses the record."""
        ...


def validator(kind: FaultKind) -> Callable[[Mapping[str, Any], UndoContext], None] | None:
    """The kind's ``validate``, or None when it gives none (its records are refused)."""
    return hooks(kind).validate


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

    def resolve(
        self, params: Mapping[str, Any], published: Mapping[str, Any]
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


class NeedsFor(Protocol):
    """Optional on a kind whose needs depend on its parameters (instead of ``needs``)."""

    def needs_for(self, params: Any, phase: str | None) -> frozenset[str]: ...


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a kind declares beyond ``info``, ``inject`` and ``revert``, read once when it
    registers (:func:`check`): the one place the harness looks its optional parts up.
    None (or the default) where the kind leaves a part out."""

    acts: Acts = "outside"
    needs: frozenset[str] = frozenset()
    params: type[FaultParams] | None = None  # None: used from Python only, not in scenarios
    inside: Callable[[Any, str | None], bool] | None = None  # ActsEither
    inside_when: str = ""  # ActsEither
    needs_for: Callable[[Any, str | None], Any] | None = None  # NeedsFor
    validate: Callable[[Mapping[str, Any], UndoContext], None] | None = None  # Validates
    preflight: Callable[[Mapping[str, Any]], list[str]] | None = None  # Preflight
    resolve: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None
    check: Callable[[Sequence[Any], Setting], list[str]] | None = None  # ChecksScenario
    aim: Callable[[], tuple[str, bool]] | None = None  # AimsAtFiles
    #: where it acts when a scenario's fault names no ``target`` (``{"role": "launcher"}``),
    #: and why, for the scenario schema
    default_target: Mapping[str, Any] | None = None
    target_help: str | None = None


#: A kind's name: dotted, lower case (``process.kill``, ``storage.lose_unsynced``).
_KIND_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")


def _is_info(value: Any) -> bool:
    return (
        isinstance(value, KindInfo)
        and all(
            isinstance(getattr(value, name), str) and getattr(value, name).strip()
            for name in ("kind", "summary", "caused_by")
        )
        and _KIND_NAME.fullmatch(value.kind) is not None
        and isinstance(value.reverted_by, str)
        and isinstance(value.details, str)
        and isinstance(value.params, Mapping)
    )


def _is_params(value: Any) -> bool:
    from aftershock.faults.params import FaultParams  # pydantic: only once a kind declares a model

    return isinstance(value, type) and issubclass(value, FaultParams)


def _is_needs(value: Any) -> bool:
    return isinstance(value, frozenset | set) and set(value) <= set(CAPABILITIES)


def _is_optional(kind: type) -> Callable[[Any], bool]:
    return lambda value: value is None or isinstance(value, kind)


#: The protocol every kind is checked against when it registers (FaultKind, and the
#: optional parts of :class:`Hooks`).
PROTOCOL: tuple[plugins.Attr, ...] = (
    plugins.required(
        "info",
        "a faults.KindInfo with a dotted lower-case `kind`, a `summary` and `caused_by`",
        _is_info,
    ),
    plugins.required("inject", "a method: inject(target, params, journal)", plugins.is_callable),
    plugins.required("revert", "a method: revert(undo)", plugins.is_callable),
    plugins.optional("params", "an aftershock.faults.params.FaultParams model", _is_params),
    plugins.optional("acts", "where it acts", plugins.is_str, allowed=get_args(Acts)),
    plugins.optional("needs", f"a frozenset of {', '.join(CAPABILITIES)}", _is_needs),
    plugins.optional("inside", "a method: inside(params, phase)", plugins.is_callable),
    plugins.optional("inside_when", "a str", plugins.is_str),
    plugins.optional("needs_for", "a method: needs_for(params, phase)", plugins.is_callable),
    plugins.optional("validate", "a method: validate(undo, context)", plugins.is_callable),
    plugins.optional("preflight", "a method: preflight(params)", plugins.is_callable),
    plugins.optional("resolve", "a method: resolve(params, published)", plugins.is_callable),
    plugins.optional("check", "a method: check(faults, setting)", plugins.is_callable),
    plugins.optional("aim", "a method: aim()", plugins.is_callable),
    plugins.optional("prepare", "a method: prepare(params, journal)", plugins.is_callable),
    plugins.optional(
        "inject_group", "a method: inject_group(targets, params, journal)", plugins.is_callable
    ),
    plugins.optional("default_target", "a mapping or None", _is_optional(Mapping)),
    plugins.optional("target_help", "a str or None", _is_optional(str)),
)


def check(kind: Any) -> Hooks:
    """``kind``'s optional parts; PluginProblem (a ValueError) naming everything about it
    that the protocol does not allow."""
    return _read_hooks(plugins.check(kind, "fault kind", PROTOCOL, _kind_name))


def _read_hooks(found: dict[str, Any]) -> Hooks:
    if found.get("acts") == "either" and "inside" not in found:
        raise plugins.PluginProblem(
            f"fault kind {found['info'].kind}: `acts` is 'either' "
            "but it gives no `inside(params, phase)`"
        )
    if "needs" in found:
        found["needs"] = frozenset(found["needs"])
    return Hooks(**{f.name: found[f.name] for f in fields(Hooks) if f.name in found})


def _kind_name(kind: Any) -> str:
    name: str = kind.info.kind
    return name


def hooks(kind: FaultKind) -> Hooks:
    """``kind``'s optional parts, as read when it registered (checked now if it never did)."""
    known = _hooks.get(id(kind))
    if known is not None and known[0] is kind:
        return known[1]
    return check(kind)


def acts_inside(kind: FaultKind, params: Any, phase: str | None) -> bool:
    """Whether ``kind`` with ``params`` (its model, or the fault's) acts inside the target."""
    found = hooks(kind)
    if found.acts == "either" and found.inside is not None:
        return bool(found.inside(params, phase))
    return found.acts == "inside"


def needs(kind: FaultKind, params: Any, phase: str | None) -> frozenset[str]:
    """What ``kind`` with ``params`` needs from the target (CAPABILITIES)."""
    found = hooks(kind)
    if found.needs_for is not None:
        return frozenset(found.needs_for(params, phase))
    if acts_inside(kind, params, phase):
        return frozenset({"probe"})
    return found.needs


_hooks: dict[int, tuple[FaultKind, Hooks]] = {}  # by id(kind): a kind object stays alive


def _accept(kind: Any, found: dict[str, Any]) -> FaultKind:
    # Its optional parts are read once, here: the harness looks them up nowhere else.
    _hooks[id(kind)] = (kind, _read_hooks(found))
    registered: FaultKind = kind
    return registered


def _needs_params(kind: FaultKind) -> None:
    # From another package, a kind is for scenarios: without a parameter model it would be
    # listed nowhere and refused as unknown, so it is refused here, saying why.
    if hooks(kind).params is None:
        raise plugins.PluginProblem(
            f"fault kind {kind.info.kind}: no `params` (an aftershock.faults.params.FaultParams "
            f"model; "
            "`params = FaultParams` for a kind without parameters), so no scenario can use it"
        )


def _import_built_ins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


#: Every fault kind, by its dotted name: the built-in modules' and the entry points'.
KINDS: plugins.Registry[FaultKind] = plugins.Registry(
    "fault kind", ENTRY_POINT_GROUP, name=_kind_name, protocol=PROTOCOL, accept=_accept,
    from_plugin=_needs_params, built_ins=_import_built_ins)


def register(kind: FaultKind) -> FaultKind:
    """Add ``kind``; ValueError (PluginProblem) when it does not follow the protocol or its
    name is taken."""
    return KINDS.register(kind)


def broken() -> list[plugins.Broken]:
    """The entry points of ``aftershock.faults`` that were skipped, and why."""
    return KINDS.broken()


def broken_kind(kind: str) -> plugins.Broken | None:
    """The skipped plug-in that fault kind ``kind`` may come from, if any."""
    return KINDS.broken_for(kind)


def get(kind: str) -> FaultKind:
    return KINDS.get(kind)


def kinds() -> list[FaultKind]:
    """Every fault kind, by name."""
    return [KINDS.get(name) for name in KINDS.names()]


def declared(kind: FaultKind) -> bool:
    """Whether ``kind`` declares its parameters (and so has a place in scenarios)."""
    return hooks(kind).params is not None


def preflight(kind: str, params: Mapping[str, Any]) -> list[str]:
    """What this machine lacks for ``kind`` with ``params``: nothing for a kind without a
    ``preflight`` hook (it says at inject time, through FaultUnavailable)."""
    lacks = hooks(get(kind)).preflight
    return list(lacks(params)) if lacks is not None else []
