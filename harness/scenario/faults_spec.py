"""The faults of a scenario: which process a fault hits (``target``), when it fires (``at``,
``every``), how long it holds, and each fault kind's model, built from the kind's own
parameters (reached by name too: ``ProcessFreeze``, ``StorageLoseUnsynced``).
"""

from __future__ import annotations

import re
import typing
from datetime import timedelta
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, create_model, field_validator, model_validator

from aftershock import faults
from aftershock.faults import registry
from aftershock.faults.params import relative_glob
from aftershock.harness.scenario.schema import MAX_STEPS, MAX_WORLD, Duration
from aftershock.harness.scenario.schema import Strict as _Strict


class Target(_Strict):
    """Which process a fault hits: a rank, a role, a seeded pick among the ranks, or any
    coordinate a job has (an environment variable, its command line, its place in the
    process tree).

    Ranks are the ranks the system reports through the probe's ``hello`` or a log probe's
    ``event: hello`` line (a warm spare that took over rank 1 *is* rank 1), else the
    ``RANK`` environment variable of each process.
    """

    rank: int | None = Field(None, ge=0, lt=MAX_WORLD)
    worker: int | None = Field(None, ge=0, lt=MAX_WORLD, description="a worker of the reference "
                               "server (its index, which the worker reports as its rank)")
    replica: int | None = Field(None, ge=0, lt=MAX_WORLD,
                                description="every rank of this replica")
    shard: int | None = Field(None, ge=0, lt=MAX_WORLD, description="every rank holding this shard "
                              "(with `replica`: the one rank at both)")
    env: dict[str, str] | None = Field(
        None, min_length=1, description="the processes whose environment has each of these "
        "variables at this value (`{REPLICA_GROUP_ID: '1'}`); of a process and its children "
        "that all match, the topmost. Combines with `cmdline`, `role` and `pick`",
    )
    cmdline: str | None = Field(
        None, min_length=1, description="the processes whose command line (arguments joined "
        "by spaces) matches this regular expression (searched, not anchored); of a process "
        "and its children that all match, the topmost. Combines with `env`, `role`, `pick`",
    )
    role: Literal["launcher", "agent", "worker", "spare", "router"] | None = Field(
        None, description="launcher: the launched command itself (e.g. torchrun's agent, the "
        "reference server's launcher); worker: a process a launcher started as a rank (it "
        "has LOCAL_RANK in its environment, as torchrun's workers do; the topmost); agent: "
        "the process that started a worker (torchrun's elastic agent, one per replica group "
        "of a torchft job); spare: a warm standby process; router: the reference server's "
        "router process (HTTP front end, journal), which its launcher restarts"
    )
    pick: Literal["random", "all"] | None = Field(
        None, description="random: one rank (or, with `env`/`cmdline`/`role: agent|worker`, "
        "one of the processes they name) chosen with the run's seed; all: every one (the "
        "default for `env`, `cmdline` and `role: agent|worker`)"
    )
    node: int | None = Field(None, ge=0, lt=MAX_WORLD, description="a node of a multi-node "
                             "system (`nodes: N`, docs/nodes.md): its container, named by its "
                             "init process; what node.* faults act on")

    @field_validator("cmdline")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except (re.error, OverflowError, RecursionError) as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> Target:
        coordinates = self.replica is not None or self.shard is not None
        if self.filters:
            if (coordinates or self.rank is not None or self.worker is not None
                    or self.node is not None):
                raise ValueError("`env`, `cmdline` and `role: agent|worker` name processes "
                                 "themselves: combine them with each other and with `role` or "
                                 "`pick`, not with `rank`, `worker`, `replica`, `shard` or "
                                 "`node`")
            return self
        given = [x for x in (self.rank, self.worker, self.role, self.pick, self.node)
                 if x is not None]
        if len(given) + coordinates != 1:
            raise ValueError("give exactly one of `rank: N`, `worker: N`, `replica`/`shard`, "
                             "`role: launcher|agent|worker|spare|router`, `pick: random|all`, "
                             "`node: N`, or `env`/`cmdline` (which combine with `role` and "
                             "`pick`)")
        return self

    @property
    def filters(self) -> bool:
        """Whether it names processes by what they are (environment, command line, place in
        the process tree) rather than by rank."""
        return (self.env is not None or self.cmdline is not None
                or self.role in ("agent", "worker"))

    @property
    def index(self) -> int | None:
        """The rank this target names: `worker: N` is the server's rank N."""
        return self.rank if self.rank is not None else self.worker

    def describe(self) -> str:
        if self.filters:
            return self._describe_filters()
        if self.rank is not None:
            return f"rank {self.rank}"
        if self.worker is not None:
            return f"worker {self.worker}"
        if self.replica is not None or self.shard is not None:
            parts = [f"replica {self.replica}" if self.replica is not None else "",
                     f"shard {self.shard}" if self.shard is not None else ""]
            return " ".join(p for p in parts if p)
        if self.node is not None:
            return f"node {self.node}"
        return f"role {self.role}" if self.role is not None else f"pick {self.pick}"

    def _describe_filters(self) -> str:
        parts = [f"{k}={v}" for k, v in (self.env or {}).items()]
        if self.cmdline is not None:
            parts.append(f"cmdline /{self.cmdline}/")
        if self.role is not None:
            parts.append(f"role {self.role}")
        if self.pick == "random":
            parts.append("(one, seeded)")
        return " ".join(parts)


#: Fault points of the reference systems (``harness.probe.fault_point``): a training step's
#: forward, backward and optimizer; ``save``: every rank's checkpoint shard is durable and the step
#: is not committed yet; ``join``: a member of a new membership generation that passed its start
#: line, before it builds the generation's groups (hot_spare and elastic; the step and rank it
#: holds: a spare taking a rank over is no rank yet); ``restore``: a rank rejoining after a
#: failure, before it trains again (the step it restores); ``finish``: the last step is committed
#: and the rank has not reported its final parameters yet; ``exit``: the rank has reported them and
#: left the job, on its way out; ``decode``: a serving engine step. The serving router's durability
#: path, in order, its step being the count of token records: ``token_produced`` (a worker's tokens
#: accepted, not yet journaled), ``journal_appended`` (written, not fsynced), ``journal_synced``
#: (durable, not yet sent), ``token_sent`` (sent to clients).
Phase = Literal["forward", "backward", "optimizer", "save", "join", "restore", "finish", "exit",
                "decode", "token_produced", "journal_appended", "journal_synced", "token_sent"]


FileWhen = Literal["created", "opened", "modified", "closed", "deleted"]
#: File triggers whose moment lies inside the file's write (`expect: {faults_landed}`).
WINDOWED: tuple[str, ...] = ("created", "opened", "modified")


class Awaited(_Strict):
    """``at: {step: 20, after: {event: hello, role: spare}}``: a timeline event the system
    must have reported (its k-th occurrence, optionally one rank's or one role's) before the
    fault may fire. The fault then fires at the first moment both hold, so it hits the state
    the scenario means to test however slowly a loaded machine brings the system there; if
    the event never comes, the fault never fires and `faults_injected` says what it waited
    for."""

    event: str = Field(pattern=r"^[a-z_]+$", description="a timeline event, e.g. hello")
    rank: int | None = Field(None, ge=0, lt=MAX_WORLD,
                             description="only this rank's event (its `rank` field)")
    role: str | None = Field(None, pattern=r"^[a-z_]+$",
                             description="only events with this `role` field (a warm spare's "
                             "hello says role: spare)")
    count: int = Field(1, ge=1, le=MAX_STEPS, description="its k-th occurrence")

    def matches(self, event: str, rank: int | None, role: Any) -> bool:
        return (event == self.event and (self.rank is None or rank == self.rank)
                and (self.role is None or role == self.role))

    def describe(self) -> str:
        who = [f"rank {self.rank}" if self.rank is not None else "",
               f"role {self.role}" if self.role is not None else ""]
        return (self.event + "".join(f" of {w}" for w in who if w)
                + (f" #{self.count}" if self.count > 1 else ""))


class At(_Strict):
    """When a fault fires: once step N is committed (optionally at a phase of that step,
    for in-process faults), at a time after launch, on the k-th timeline event of a kind, or
    on the k-th time a file matching a glob is created, opened for writing, modified, closed or
    deleted; with ``after``, not before the system has also reported a given event."""

    step: int | None = Field(None, ge=0, le=MAX_STEPS)
    phase: Phase | None = Field(
        None, description="with `step`: the fault point (forward, backward, optimizer, save, "
        "join, restore, finish, exit, decode; the serving router's token_produced, "
        "journal_appended, journal_synced, token_sent) of that step or a later one "
        "(in-process faults only)"
    )
    time: Duration | None = None
    event: str | None = Field(
        None, pattern=r"^[a-z_]+$", description="a timeline event, e.g. checkpoint_started"
    )
    file: str | None = Field(
        None, description="a glob relative to the fault's root (a storage fault's `root`, "
        "else the reference trainer's checkpoint folder or the run folder), one folder level "
        "per component (`**`: any number), e.g. 'step_*/COMMIT'; watched with inotify from "
        "launch on, so it needs no cooperation from the system (`created`, as root: the "
        "job's first open of the match waits until the fault is in)"
    )
    # Not `on`: YAML 1.1 (PyYAML) reads a bare `on` key as the boolean true.
    when: FileWhen = Field(
        "created", description="with `file`: created (the name appears: open(O_CREAT), mkdir, "
        "or a rename onto it, as atomic writers publish), opened (opened for writing, e.g. a "
        "save over an existing file), modified (its first write since it was opened: once per "
        "save), closed (closed after being written) or deleted (unlinked, or renamed away)"
    )
    count: int = Field(1, ge=1, le=MAX_STEPS,
                       description="with `event` or `file`: fire on its k-th occurrence")
    after: Awaited | None = Field(
        None, description="with `step`, `time` or `event`: not before the system has reported "
        "this event too (e.g. {event: hello, role: spare}: a warm spare is up); the fault "
        "fires at the first moment both hold")

    @field_validator("file")
    @classmethod
    def _under_root(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if PurePosixPath(value).parts in ((), (".",)):
            raise ValueError("file must name a file (a glob), not the root itself")
        return relative_glob(value, "file")

    @model_validator(mode="after")
    def _exactly_one(self) -> At:
        given = [x for x in (self.step, self.time, self.event, self.file) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `step: N`, `time: DURATION`, `event: NAME` "
                             "or `file: GLOB`")
        if self.phase is not None and self.step is None:
            raise ValueError("`phase` needs `step`")
        if "when" in self.model_fields_set and self.file is None:
            raise ValueError("`when` needs `file`")
        if self.after is not None and self.file is not None:
            # A file trigger is decided by the watch itself (as root, the job's open waits
            # for it), before the harness could know whether the event came.
            raise ValueError("`after` works with `step`, `time` or `event`, not `file`")
        return self

    def describe(self) -> str:
        after = f" after {self.after.describe()}" if self.after is not None else ""
        if self.step is not None:
            return f"step {self.step}" + (f" {self.phase}" if self.phase else "") + after
        if self.event is not None:
            return (f"event {self.event}" + (f" #{self.count}" if self.count > 1 else "")
                    + after)
        if self.file is not None:
            return f"file {self.file} {self.when}" + (f" #{self.count}" if self.count > 1 else "")
        assert self.time is not None
        return f"t+{self.time.total_seconds():g}s" + after


class Every(_Strict):
    """Repeat a fault: every N committed steps or every DURATION after it first fired."""

    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    time: Duration | None = None
    times: int = Field(2, ge=2, le=1000, description="how many times in all, the first included")

    @model_validator(mode="after")
    def _exactly_one(self) -> Every:
        if (self.steps is None) == (self.time is None):
            raise ValueError("give exactly one of `steps: N` or `time: DURATION`")
        return self


class UntilEvent(_Strict):
    """The timeline event that ends a fault held ``until`` it: its k-th occurrence after the
    fault's moment, optionally one rank's."""

    event: str = Field(pattern=r"^[a-z_]+$", description="a timeline event, e.g. hello")
    rank: int | None = Field(None, ge=0, lt=MAX_WORLD,
                             description="only this rank's event (its `rank` field)")
    count: int = Field(1, ge=1, le=MAX_STEPS,
                       description="heal on its k-th occurrence after the fault's moment")

    def describe(self) -> str:
        return (f"{self.event}" + (f" of rank {self.rank}" if self.rank is not None else "")
                + (f" #{self.count}" if self.count > 1 else ""))


class HealWhen(_Strict):
    """``duration: {until: {event: hello, rank: 1}, max: 60s}``: the fault holds until the
    timeline shows that event after the fault's moment, so what it is meant to provoke happens
    while it holds however slow a loaded machine makes the job; healed after ``max`` at the
    latest, and then the run records the event as not seen (``fault_healed``'s
    ``until_seen: false``)."""

    until: UntilEvent
    max: Duration

    @field_validator("max")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("`max` must be more than 0: the longest the fault may hold")
        return value


def _duration_form(value: Any) -> str:
    return "[until]" if isinstance(value, dict | HealWhen) else "[duration]"


#: A fault's ``duration`` in a scenario: a fixed duration, or held until an event is seen.
#: The tags carry brackets so that error locations skip them (load.py's ``path_is_tag``).
FaultDuration = Annotated[
    Annotated[Duration, Tag("[duration]")] | Annotated[HealWhen, Tag("[until]")],
    Discriminator(_duration_form),
]


class _FaultBase(_Strict):
    """What every fault of a scenario says besides its kind's own parameters: which process
    it hits, when, and how often."""

    kind: str  # each kind's model narrows it to its own name
    target: Target
    at: At
    every: Every | None = Field(None, description="repeat the fault")

    @model_validator(mode="after")
    def _phase_in_process(self) -> _FaultBase:
        phase = self.at.phase
        kind = faults.get(str(getattr(self, "kind", "")))
        if phase is None or registry.acts_inside(kind, self, phase):
            return self
        if registry.hooks(kind).acts == "either":
            when = registry.hooks(kind).inside_when
            raise ValueError(f"`at.phase` needs {kind.info.kind} applied inside the target "
                             f"(an in-process fault: {when})")
        inside = [k for k in faults.kinds() if registry.hooks(k).acts != "outside"]
        listed = ", ".join(k.info.kind + (f" {registry.hooks(k).inside_when}"
                                          if registry.hooks(k).acts == "either" else "")
                           for k in inside)
        raise ValueError(f"`at.phase` is for faults applied inside the target ({listed}), "
                         f"not {kind.info.kind}")

    @model_validator(mode="after")
    def _repeatable(self) -> _FaultBase:
        if self.every is not None and self.every.steps is not None and self.at.step is None \
                and self.at.event is None and self.at.time is None and self.at.file is None:
            raise ValueError("`every` needs `at`")
        return self


def _model_name(kind: str) -> str:
    """``storage.lose_unsynced`` -> ``StorageLoseUnsynced``: a fault's model, by its kind."""
    return "".join(part.capitalize() for part in re.split(r"[._-]", kind) if part)


def _fault_model(kind: faults.FaultKind) -> type[_FaultBase]:
    """A scenario's fault of ``kind``: the kind's own parameters (its ``params`` model) with
    ``kind``, ``target``, ``at`` and ``every``."""
    fields: dict[str, Any] = {"kind": (Literal[kind.info.kind], ...)}
    hooks = registry.hooks(kind)
    if hooks.default_target is not None:
        fields["target"] = (Target, Field(Target(**hooks.default_target),
                                          description=hooks.target_help))
    held = kind.params.model_fields.get("duration")
    if held is not None and held.default is None:
        # The harness heals such a fault (faults/params.py's convention), so it can also hold
        # it until an event rather than for a fixed time.
        fields["duration"] = (FaultDuration | None, Field(
            None, description=f"{held.description}; or {{until: {{event: NAME, rank: N}}, "
            "max: DURATION}: until that event is seen after the fault, at most `max`"))
    model = create_model(
        _model_name(kind.info.kind), __base__=(kind.params, _FaultBase),
        __module__=__name__, __doc__=kind.info.summary, **fields,
    )
    return typing.cast(type[_FaultBase], model)


#: Every fault kind that declares its parameters, built-in or installed (faults/registry.py):
#: the model a scenario's fault of that kind is.
FAULT_MODELS: dict[str, type[_FaultBase]] = {
    kind.info.kind: _fault_model(kind) for kind in faults.kinds() if registry.declared(kind)
}

if typing.TYPE_CHECKING:
    Fault = _FaultBase
else:
    Fault = Annotated[Union[tuple(FAULT_MODELS.values())],  # noqa: UP007 (built at run time)
                      Field(discriminator="kind")]


def __getattr__(name: str) -> type[_FaultBase]:
    # The fault models by name (ProcessFreeze, StorageLoseUnsynced, ...), as they were
    # written here before each kind declared its own parameters.
    for model in FAULT_MODELS.values():
        if model.__name__ == name:
            return model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def in_process(fault: _FaultBase) -> bool:
    """Whether the probe applies ``fault`` inside the target, at an exact step and phase."""
    at = getattr(fault, "at", None)
    return registry.acts_inside(faults.get(str(getattr(fault, "kind", ""))), fault,
                                at.phase if at is not None else None)
