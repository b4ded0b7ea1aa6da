"""System kinds: what a scenario's ``system:`` may be, and how each one is run.

A system kind is one object (:class:`SystemKind`) that declares its ``system:`` block as a
pydantic model and everything the harness needs to run it: the command line, the target
that runs it (harness/run/target.py), its world size, what its job lets faults do (the
in-process probe), where file faults act by default, what its fault-free twin's result
depends on, and its own rules for a scenario. The scenario format (harness/scenario/spec.py), the
run loop (harness/run/runner.py), the baseline cache, goldens and the CLI ask the kind; none
of them names a system class.

Built-in kinds are the modules of this package (trainer.py, server.py, command.py), each
registering one kind; every module here whose name does not start with ``_`` is loaded.
Other packages add kinds through the ``aftershock.systems`` entry-point group (an object,
or a list of them). Each kind is checked against :data:`PROTOCOL` when it registers; a
plug-in it refuses is named in one line and skipped (faults/plugins.py). docs/extending.md
says how to write one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from aftershock.faults import plugins

if TYPE_CHECKING:
    from pydantic import BaseModel

    from aftershock.harness.run.logprobe import LogProbe
    from aftershock.harness.run.records import Event
    from aftershock.harness.run.target import Launch, Target
    from aftershock.harness.run.timeline import Timeline

ENTRY_POINT_GROUP = "aftershock.systems"


class Driver(Protocol):
    """Works a system from outside while it runs (the reference server's load generator).

    It sees every event of the run's timeline; the run ends when it is done, and it writes
    its closing record to the timeline then.
    """

    def observe(self, event: Event) -> None: ...

    def done(self) -> bool: ...

    def finish(self) -> Event | None:
        """The run is over because this driver is done: record what it saw."""
        ...

    def stop(self) -> None:
        """Stop driving (at teardown, whatever happened); bounded."""
        ...


class SystemKind(Protocol):
    """One kind of system under test. ``system`` arguments are instances of ``model``."""

    @property
    def name(self) -> str:
        """Its tag in the scenario union and in messages: ``trainer``."""
        ...

    @property
    def model(self) -> type[BaseModel]:
        """Its `system:` block."""
        ...

    @property
    def tag(self) -> tuple[str, str | None]:
        """The key and value that say a `system:` block is this kind's (value None: the key
        alone, e.g. `command:`)."""
        ...

    @property
    def shape(self) -> str:
        """How a scenario writes the tag, for messages: ```reference: trainer```."""
        ...

    @property
    def order(self) -> int:
        """Where it comes in lists and messages (lower first)."""
        ...

    @property
    def family(self) -> Literal["training", "serving"]:
        """Which expect checks mean something for it: training (steps, parameters) or
        serving (requests, tokens)."""
        ...

    @property
    def golden(self) -> Literal["digests", "outputs"] | None:
        """What a golden of its fault-free twin holds (harness/twin/golden.py); None: no goldens."""
        ...

    def launch(self, system: Any, *, run_dir: Path, scenario_dir: Path, seed: int,
               extra_args: tuple[str, ...] = ()) -> Launch:
        """What to start: command line, working folder, environment, log probes."""
        ...

    def target(self, launch: Launch, *, run_dir: Path, run_id: str,
               timeline: Timeline) -> Target:
        """The target that runs ``launch``."""
        ...

    def capabilities(self, system: Any | None) -> frozenset[str]:
        """What its target lets faults act through (aftershock.faults.registry.CAPABILITIES), known
        before anything runs (``system`` None: one as its defaults make it)."""
        ...

    def probe(self, system: Any | None, scenario_dir: Path | None) -> str | None:
        """None if its job calls aftershock.harness.probe.install() (in-process faults reach it),
        else
        why it is not known to (for the error that refuses an in-process fault; ``system``
        None: a plain one, as `aftershock faults --system` asks)."""
        ...

    def world(self, system: Any) -> int | None:
        """Ranks (or workers) at full strength; None: as seen before the fault."""
        ...

    def steps(self, system: Any) -> int | None:
        """How many steps it runs, when known (a progress bar)."""
        ...

    def default_root(self, system: Any, run_dir: Path) -> Path:
        """The folder file faults and file triggers act in when they name no ``root``."""
        ...

    def root_is_run_folder(self, system: Any) -> bool:
        """Whether that default is the run folder itself (which holds the timeline)."""
        ...

    def twin(self, system: Any) -> Any:
        """The system its fault-free twin runs (pacing removed: it never changes the math)."""
        ...

    def twin_key(self, system: Any) -> dict[str, Any]:
        """What decides the twin's result, as JSON, ``env`` aside: the fields that only pace
        the run, detect failures or serve recovery are left out (harness/twin/golden.py)."""
        ...

    def fingerprint(self, system: Any, scenario_dir: Path) -> str:
        """A digest of the code its twin runs, so editing it invalidates the twin."""
        ...

    def device(self, system: Any) -> str:
        """cpu or cuda: the device its math runs on (goldens are per platform)."""
        ...

    def driver(self, system: Any, *, seed: int, timeline: Timeline) -> Driver | None:
        """What works it from outside while it runs, if anything."""
        ...

    def log_probes(self, system: Any) -> list[LogProbe]:
        """The log probes that turn its output lines into events (a re-check may change
        them: harness/verdict/recheck.py)."""
        ...

    def replays(self, system: Any) -> bool:
        """Whether it records what `params_match: replay` recomputes (the membership of
        every generation: reference_impl's elastic recovery)."""
        ...

    def file_problems(self, system: Any, scenario_dir: Path
                      ) -> list[tuple[tuple[str | int, ...], str]]:
        """What it names on disk that is not there, relative to the scenario file's folder:
        (where in its block, the problem); checked when a scenario file is loaded."""
        ...

    def problems(self, scenario: Any) -> list[str]:
        """Its own rules for a whole scenario (what its `expect` checks need); each problem
        one sentence."""
        ...


class Unresolves(Protocol):
    """Optional on a system kind: why its target can never find the processes a fault's
    ``target`` names (``replica`` on a job that reports none), or None. ``probed``: whether
    its job runs the in-process probe."""

    def unresolved(self, system: Any, target: Any, probed: bool) -> str | None: ...


class Unawaited(Protocol):
    """Optional on a system kind: why it never reports the event a fault's ``at.after``
    waits for (its ``event``, ``rank`` and ``role``: a hello from a role it has not), or
    None, also where it cannot tell."""

    def unawaited(self, system: Any, after: Any) -> str | None: ...


def _is_model(value: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(value, type) and issubclass(value, BaseModel)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and not any(c.isspace() for c in value)


def _is_tag(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
            and (value[1] is None or isinstance(value[1], str)))


_METHODS = ("launch", "target", "capabilities", "probe", "world", "steps", "default_root",
            "root_is_run_folder", "twin", "twin_key", "fingerprint", "device", "driver",
            "log_probes", "replays", "file_problems", "problems")

#: The protocol every system kind is checked against when it registers (:class:`SystemKind`;
#: :class:`Unresolves` and :class:`Unawaited`, optional).
PROTOCOL: tuple[plugins.Attr, ...] = (
    plugins.required("name", "a name (a str without spaces)", _is_name),
    plugins.required("model", "a pydantic model (aftershock.harness.scenario.schema.Strict)",
                     _is_model),
    plugins.required("tag", "a (key, value or None) tuple", _is_tag),
    plugins.required("shape", "a str", plugins.is_str),
    plugins.required("order", "an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    plugins.required("family", "a str", plugins.is_str, allowed=("training", "serving")),
    plugins.required("golden", "a str or None", lambda v: True,
                     allowed=("digests", "outputs", None)),
    *(plugins.required(name, "a method", plugins.is_callable) for name in _METHODS),
    plugins.optional("unresolved", "a method: unresolved(system, target, probed)",
                     plugins.is_callable),
    plugins.optional("unawaited", "a method: unawaited(system, after)", plugins.is_callable),
)


def _claims(kind: Any) -> list[str]:
    # A scenario names a system kind by its tag's key (`script:`), messages by its name.
    tag = getattr(kind, "tag", None)
    return [tag[0] if tag is not None and _is_tag(tag) else "", str(getattr(kind, "name", ""))]


def _import_built_ins() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def _name(kind: Any) -> str:
    name: str = kind.name
    return name


#: Every system kind, by name: this package's modules' and the entry points'.
KINDS: plugins.Registry[SystemKind] = plugins.Registry(
    "system kind", ENTRY_POINT_GROUP, name=_name, protocol=PROTOCOL,
    built_ins=_import_built_ins, claims=_claims)


def register(kind: SystemKind) -> SystemKind:
    """Add ``kind``; ValueError (PluginProblem) when it does not follow the protocol or its
    name is taken."""
    return KINDS.register(kind)


def broken_for(raw: Mapping[str, Any]) -> plugins.Broken | None:
    """The skipped plug-in a raw ``system:`` mapping that no kind claims may be asking for
    (by one of its keys), if any."""
    if claimed(raw) is not None:
        return None
    skipped = KINDS.broken()
    return next((b for key in raw if isinstance(key, str)
                 for b in [plugins.provider(skipped, key)] if b is not None), None)


def unresolved(kind: SystemKind) -> Callable[[Any, Any, bool], str | None] | None:
    """``kind``'s ``unresolved`` (:class:`Unresolves`), or None when it gives none."""
    hook: Callable[[Any, Any, bool], str | None] | None = getattr(kind, "unresolved", None)
    return hook  # callable: checked when it registered


def unawaited(kind: SystemKind) -> Callable[[Any, Any], str | None] | None:
    """``kind``'s ``unawaited`` (:class:`Unawaited`), or None when it gives none."""
    hook: Callable[[Any, Any], str | None] | None = getattr(kind, "unawaited", None)
    return hook  # callable: checked when it registered


def kinds() -> list[SystemKind]:
    """Every system kind, in ``order``."""
    return sorted(KINDS.entries(), key=lambda k: (k.order, k.name))


def get(name: str) -> SystemKind:
    return KINDS.get(name)


def of(system: Any) -> SystemKind:
    """The kind of a ``system:`` model instance."""
    for kind in kinds():
        if isinstance(system, kind.model):
            return kind
    raise TypeError(f"{type(system).__name__} is not the model of any system kind")


def claimed(raw: Mapping[str, Any]) -> SystemKind | None:
    """The kind a raw ``system:`` mapping names by its tag, or None."""
    for kind in kinds():
        key, value = kind.tag
        if key in raw and (value is None or raw[key] == value):
            return kind
    return None
