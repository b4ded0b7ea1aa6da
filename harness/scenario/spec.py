"""Scenario files: the typed, strict, frozen schema and the YAML loader.

The pydantic models below are the truth about what a scenario may say
(``aftershock schema`` publishes them as JSON Schema). The loader keeps every
key's line and column, so each problem is reported as
``path:line:column: where: what is wrong (what is allowed)``.
"""

from __future__ import annotations

import codecs
import difflib
import os
import re
import stat
import types
import typing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from aftershock import faults
from aftershock.faults import contract, registry
from aftershock.faults.params import relative_glob
from aftershock.faults.plugins import Broken
from aftershock.harness import systems
from aftershock.harness.errors import PluginError, SpecError

# The system kinds' models and the log probe live with their kinds (harness/systems/,
# harness/run/logprobe.py, harness/run/loadgen.py); they are named here too, where the scenario
# format is.
from aftershock.harness.run.loadgen import Load as Load
from aftershock.harness.run.loadgen import PromptMix as PromptMix
from aftershock.harness.run.loadgen import Ready as Ready
from aftershock.harness.run.loadgen import ScenarioLoad as ScenarioLoad
from aftershock.harness.run.logprobe import LogEventKind as LogEventKind
from aftershock.harness.run.logprobe import LogProbe as LogProbe
from aftershock.harness.scenario import _own_records as own_records
from aftershock.harness.scenario.schema import MAX_SEED as MAX_SEED
from aftershock.harness.scenario.schema import MAX_STEPS as MAX_STEPS
from aftershock.harness.scenario.schema import MAX_WORLD as MAX_WORLD
from aftershock.harness.scenario.schema import Duration
from aftershock.harness.scenario.schema import Strict as _Strict
from aftershock.harness.systems.command import CommandSystem as CommandSystem
from aftershock.harness.systems.command import uses as uses_variable
from aftershock.harness.systems.server import ServerSystem as ServerSystem
from aftershock.harness.systems.trainer import TrainerSystem as TrainerSystem
from aftershock.harness.systems.trainer import World as World
from aftershock.harness.verdict import check_registry

SCENARIO_SUFFIXES = (".yaml", ".yml")


def _system_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = systems.claimed(value)
    else:
        try:
            kind = systems.of(value)
        except TypeError:
            return None
    return None if kind is None else kind.name


def _system_union() -> Any:
    """The ``system:`` block: one of the system kinds (harness/systems/), told apart by the
    key and value each one claims."""
    kinds = systems.kinds()
    members = tuple(Annotated[k.model, Tag(k.name)] for k in kinds)
    shapes = [k.shape for k in kinds]
    named = shapes[0] if len(shapes) == 1 else f"{', '.join(shapes[:-1])} or {shapes[-1]}"
    return Annotated[
        Union[members],  # noqa: UP007 (a union of a runtime tuple)
        Discriminator(_system_tag, custom_error_type="system_kind",
                      custom_error_message=f"system needs {named}"),
    ]


if typing.TYPE_CHECKING:
    System = Any  # the union of the system kinds' models, built when this module loads
else:
    System = _system_union()


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
#: forward, backward and optimizer; ``save``: every rank's checkpoint shard is durable and the
#: step is not committed yet; ``restore``: a rank rejoining after a failure, before it trains
#: again (the step it restores); ``finish``: the last step is committed and the rank has not
#: reported its final parameters yet; ``exit``: the rank has reported them and left the job,
#: on its way out; ``decode``: a serving engine step. The serving router's durability path,
#: in order, its step being the count of token records: ``token_produced`` (a worker's tokens
#: accepted, not yet journaled), ``journal_appended`` (written, not fsynced),
#: ``journal_synced`` (durable, not yet sent), ``token_sent`` (sent to clients).
Phase = Literal["forward", "backward", "optimizer", "save", "restore", "finish", "exit", "decode",
                "token_produced", "journal_appended", "journal_synced", "token_sent"]


FileWhen = Literal["created", "opened", "modified", "closed", "deleted"]
#: File triggers whose moment lies inside the file's write (`expect: {faults_landed}`).
WINDOWED: tuple[str, ...] = ("created", "opened", "modified")


class At(_Strict):
    """When a fault fires: once step N is committed (optionally at a phase of that step,
    for in-process faults), at a time after launch, on the k-th timeline event of a kind, or
    on the k-th time a file matching a glob is created, opened for writing, modified, closed or
    deleted."""

    step: int | None = Field(None, ge=0, le=MAX_STEPS)
    phase: Phase | None = Field(
        None, description="with `step`: the fault point (forward, backward, optimizer, save, "
        "restore, finish, exit, decode; the serving router's token_produced, "
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
        return self

    def describe(self) -> str:
        if self.step is not None:
            return f"step {self.step}" + (f" {self.phase}" if self.phase else "")
        if self.event is not None:
            return f"event {self.event}" + (f" #{self.count}" if self.count > 1 else "")
        if self.file is not None:
            return f"file {self.file} {self.when}" + (f" #{self.count}" if self.count > 1 else "")
        assert self.time is not None
        return f"t+{self.time.total_seconds():g}s"


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
#: The tags carry brackets so that error locations skip them (``path_is_tag``).
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


class Budget(_Strict):
    max: Duration


class DetectBudget(Budget):
    """A detection budget, and optionally the causes that must detect the fault."""

    cause: list[str] | None = Field(
        None, min_length=1,
        description="the `cause` of the first failure_detected event after the fault must be "
        "one of these: exactly, or with a detail after a colon (`collective_error` matches "
        "`collective_error: Connection reset`), or by prefix with a trailing `*` (`xid_*`)",
    )

    @field_validator("cause", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("cause")
    @classmethod
    def _named(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(c.strip() for c in value):
            raise ValueError("a cause must not be empty")
        return value

    def admits(self, cause: str) -> bool:
        """Whether a failure_detected event's ``cause`` is one of ours (no cause: any)."""
        if self.cause is None:
            return True
        return any(cause == want or cause.startswith(want + ":") or
                   (want.endswith("*") and cause.startswith(want[:-1])) for want in self.cause)


class CountBudget(_Strict):
    max: int = Field(ge=0, le=MAX_STEPS)
    # lost_steps only (Expect refuses it elsewhere)
    snapshot_interval: bool = Field(
        False, description="`max` for each restore from snapshots, plus what the snapshot "
        "interval leaves unsaved (interval - 1) at each: restores x (max + interval - 1), at "
        "least `max`; the interval and the restores read from the run's timeline (the "
        "reference trainer's `membership` events, its `checkpoint_loaded`); a run that "
        "recorded no interval fails, not observed")


class RateFloor(_Strict):
    min: float = Field(gt=0, le=1_000_000, description="steps per second, over any 2 s window")


class Latency(_Strict):
    """Latency budgets over every request of the run, the fault included (client-side)."""

    ttft_p50: Budget | None = Field(None, description="time to first token, median")
    ttft_p99: Budget | None = Field(None, description="time to first token, 99th percentile")
    tpot_p50: Budget | None = Field(None, description="time between tokens, median")
    tpot_p99: Budget | None = Field(None, description="time between tokens, 99th percentile")


class Expect(_Strict):
    """What must hold after the run. Each field is one named check in the report."""

    completes: bool = Field(True, description="the system exits 0 within its timeout")
    params_match: Literal["fault_free", "replay"] | None = Field(
        None, description="fault_free: final parameters bitwise equal to a fault-free run "
        "(same seed); replay: equal to what the membership the run recorded implies, "
        "recomputed by an independent oracle from the model's math (elastic recovery changes "
        "the math while a replica is missing)"
    )
    time_to_detect: DetectBudget | None = None
    time_to_recover: Budget | None = None
    lost_steps: CountBudget | None = None
    skipped_steps: CountBudget | None = Field(
        None, description="steps the history jumped over (a world going from step a to b > "
        "a+1, or resuming past where it loaded); needs every step reported"
    )
    single_history: bool = Field(
        False, description="no step is committed after the fault by two worlds that both "
        "go on (a split brain); needs steps that name their world (generation)"
    )
    step_rate: RateFloor | None = Field(
        None, description="the slowest 2 s of the run commits at least this many steps/s"
    )
    xid_action: bool = Field(
        False, description="for every gpu.xid fault, the process hit reports an xid_action "
        "event with the action NVIDIA recommends for that Xid (aftershock faults xid) and takes "
        "it: for none it goes on working, for any other action it stops and exits"
    )
    straggler_named: bool = Field(
        False, description="the system reports a straggler_detected event naming the rank "
        "the process.straggle fault slowed"
    )
    no_lost_requests: bool = Field(
        False, description="load: every request the load generator sent completed with all "
        "its tokens"
    )
    no_duplicated_tokens: bool = Field(
        False, description="load: no client received a token index twice"
    )
    outputs_match: Literal["fault_free"] | None = Field(
        None, description="load: every request's tokens equal those of a fault-free run "
        "of the same load"
    )
    latency: Latency | None = None
    acknowledged_durable: bool = Field(
        False, description="load: every token a client received is in the server's journal "
        "where the server said (`journal_offset`), every acknowledged request is in it, and a "
        "request in flight at a crash was resumed from it, not started again (the reference "
        "server's journal)"
    )
    checkpoint_durable: bool = Field(
        False, description="after the first fault, the system resumes (checkpoint_loaded) from "
        "a checkpoint at least as new as the last one it reported saved (checkpoint_saved) "
        "before the fault, and rejects none on the way (checkpoint_skipped): what it called "
        "committed survived, whole"
    )
    faults_landed: Literal["in_window"] | None = Field(
        None, description="in_window: every fault triggered by a file being created, opened "
        "or modified landed while a process of the run still had that file open for writing "
        "(inside the save, not after it)"
    )
    slurm_witness: bool = Field(
        False, description="a `slurm:` job: Slurm's own record (`scontrol show job`: its "
        "requeues, each run's start, state, exit code) agrees with the job's reports: its "
        "first run starts fresh, and a run after a requeue resumes from the checkpoint it "
        "had saved (docs/scale-out.md)"
    )
    checks: dict[str, Any] = Field(
        default_factory=dict, description="checks other packages add "
        "(the aftershock.checks entry points, docs/extending.md): NAME: its arguments, or true"
    )

    @field_validator("checks")
    @classmethod
    def _plugin_checks(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Each by its own model, so a typo in a plug-in check's arguments is a scenario error.
        parsed: dict[str, Any] = {}
        for name, args in value.items():
            if name in cls.model_fields:
                raise ValueError(f"{name} is a built-in check: write it as `expect: {{{name}: "
                                 "...}`, not under `checks`")
            try:
                parsed[name] = check_registry.parse_args(name, args)
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
            except ValidationError as exc:
                raise ValueError(f"checks.{name}: " + "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                    for e in exc.errors())) from None
        return parsed

    @field_validator("time_to_detect", mode="before")
    @classmethod
    def _detect_budget(cls, value: Any) -> Any:
        # A plain Budget (programmatic use) is a detection budget without a cause.
        if isinstance(value, Budget) and not isinstance(value, DetectBudget):
            return DetectBudget(max=value.max)
        return value

    @field_validator("skipped_steps")
    @classmethod
    def _no_interval(cls, value: CountBudget | None) -> CountBudget | None:
        if value is not None and value.snapshot_interval:
            raise ValueError("`snapshot_interval` applies to `lost_steps` only")
        return value

    #: Checks that read what the load's clients received (a load: `load:` or the
    #: reference server's `system.load`).
    SERVING: typing.ClassVar[tuple[str, ...]] = (
        "no_lost_requests", "no_duplicated_tokens", "outputs_match", "latency",
        "acknowledged_durable")
    #: Checks that read training steps or parameters.
    TRAINING: typing.ClassVar[tuple[str, ...]] = (
        "params_match", "lost_steps", "skipped_steps", "single_history", "step_rate",
        "straggler_named", "checkpoint_durable")


# --------------------------------------------------------------------- explore (search space)


class Span(_Strict):
    """Whole numbers from ``min`` to ``max``, both included."""

    min: int = Field(ge=0, le=MAX_STEPS)
    max: int = Field(ge=0, le=MAX_STEPS)

    @model_validator(mode="after")
    def _ordered(self) -> Span:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class TimeSpan(_Strict):
    """Durations from ``min`` to ``max``, both included (drawn in whole milliseconds)."""

    min: Duration
    max: Duration

    @model_validator(mode="after")
    def _ordered(self) -> TimeSpan:
        if self.max < self.min:
            raise ValueError("max is below min")
        return self


class ParamSpan(_Strict):
    """A number or duration parameter drawn between ``min`` and ``max`` (each a valid value
    of the parameter: `{min: 200ms, max: 5s}`, `{min: 2, max: 8}`)."""

    min: float | str
    max: float | str


#: One value a fault parameter may take in a search (checked against the kind's own model).
ParamValue = bool | int | float | str


class KindSpace(_Strict):
    """A fault kind a search may use, with the values or ranges of its parameters (a
    parameter not named keeps the kind's default)."""

    kind: str
    params: dict[str, list[ParamValue] | ParamSpan] = Field(
        default_factory=dict,
        description="parameter → a list of values to choose from, or {min, max} for a number "
        "or a duration",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_kind(cls, value: Any) -> Any:
        # `- process.kill` is short for `- {kind: process.kill}`.
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        if value not in FAULT_MODELS:
            raise ValueError(f"unknown fault kind {value!r} (allowed: "
                             f"{', '.join(sorted(FAULT_MODELS))})")
        return value

    @field_validator("params")
    @classmethod
    def _some_choice(
        cls, value: dict[str, list[ParamValue] | ParamSpan]
    ) -> dict[str, list[ParamValue] | ParamSpan]:
        for name, choices in value.items():
            if isinstance(choices, list) and not choices:
                raise ValueError(f"params.{name}: give at least one value")
        return value


#: Who a searched fault may hit. rank, worker: one process; replica, shard: every rank of one
#: replica or one shard (a correlated failure: a host, a rack, a shard's every copy);
#: majority: more than half the ranks at once (Jepsen's majority partition); all: every rank;
#: random: `pick: random`; spare: a warm standby; launcher: the launched command itself;
#: router: the reference server's router (its durability path has fault points).
TargetFamily = Literal["rank", "worker", "replica", "shard", "majority", "all", "random",
                       "spare", "launcher", "router"]


class EventTrigger(_Strict):
    """A timeline event a searched fault may wait for, and on which occurrence."""

    event: str = Field(pattern=r"^[a-z_]+$")
    count: Span | None = Field(None, description="occurrences to wait for; default: `at.count`")

    @model_validator(mode="before")
    @classmethod
    def _bare_event(cls, value: Any) -> Any:
        return {"event": value} if isinstance(value, str) else value


class FileTrigger(_Strict):
    """A file a searched fault may wait for (`at: {file, when, count}`), e.g. a checkpoint
    shard appearing: a moment inside a save that needs no cooperation from the job."""

    file: str = Field(description="a glob relative to the fault's root, as for `at.file`")
    when: FileWhen = "created"
    count: Span | None = Field(None, description="occurrences to wait for; default: `at.count`")

    @model_validator(mode="before")
    @classmethod
    def _bare_file(cls, value: Any) -> Any:
        return {"file": value} if isinstance(value, str) else value

    @field_validator("file")
    @classmethod
    def _a_glob(cls, value: str) -> str:
        At(file=value)  # the same rules as a fault's own `at.file`
        return value


class TriggerSpace(_Strict):
    """When searched faults may fire. Only the families named here are used; leave the whole
    block out for the system's defaults (docs/explore.md)."""

    step: Span | None = Field(None, description="at: {step: N}, N in this range")
    phases: list[Phase] = Field(
        default_factory=list, description="with `step`, for faults applied inside the "
        "target: these fault points (and none, the step's first opportunity)")
    events: list[EventTrigger] = Field(
        default_factory=list, description="at: {event: NAME, count: K}")
    files: list[FileTrigger] = Field(
        default_factory=list, description="at: {file: GLOB, when: W, count: K}")
    count: Span = Field(Span(min=1, max=2),
                        description="default occurrences of an event or a file")
    time: TimeSpan | None = Field(None, description="at: {time: T} after launch")

    @model_validator(mode="after")
    def _some_trigger(self) -> TriggerSpace:
        if self.step is None and not self.events and not self.files and self.time is None:
            raise ValueError("give at least one of `step`, `events`, `files` or `time`")
        if self.phases and self.step is None:
            raise ValueError("`phases` needs `step`")
        return self


class Explore(_Strict):
    """The space `aftershock explore` searches: fault schedules made of these kinds, targets
    and triggers. The scenario's `expect` is the oracle; its `faults` are what `aftershock
    run` injects and are not part of the search. Every key is optional: the defaults come
    from the system (docs/explore.md)."""

    faults: Span = Field(Span(min=1, max=2), description="faults per run")
    kinds: list[KindSpace] | None = Field(
        None, min_length=1, description="fault kinds and their parameter ranges; default: "
        "every kind that applies to the system")
    targets: list[TargetFamily] | None = Field(
        None, min_length=1, description="who faults hit; default: the system's ranks, "
        "replicas, shards, majorities and random picks (workers for a server)")
    at: TriggerSpace | None = Field(None, description="when faults fire; default: from the "
                                    "system (its steps, fault points and events)")
    spacing: Span | None = Field(
        None, description="steps between consecutive step-triggered faults (the next fault's "
        "step is the previous one's plus a gap in this range, at most the last step)")
    system: dict[str, list[ParamValue] | ParamSpan] = Field(
        default_factory=dict, description="system options drawn per run: option → a list of "
        "values, or {min, max} for a number or a duration; each value is checked by the "
        "system's own model, and a schedule found is written with the values it ran with")


class Scenario(_Strict):
    """One scenario: what to launch, which faults to inject when, what must hold."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=100)
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    system: System
    load: ScenarioLoad | None = Field(
        None, description="the built-in load generator driving the OpenAI-compatible "
        "completions endpoint a `command:` starts (docs/own-job.md, \"Your own server\"); "
        "the reference server takes its load as `system.load`")
    faults: list[Fault] = Field(default_factory=list)
    expect: Expect = Expect()
    explore: Explore | None = Field(
        None, description="the space of fault schedules `aftershock explore` searches, with "
        "`expect` as its oracle")

    @model_validator(mode="after")
    def _checks_are_possible(self) -> Scenario:
        self._fault_checks_are_possible()
        kind = systems.of(self.system)
        self._load_is_possible(kind)
        self._family_checks_are_possible(kind)
        if self.expect.params_match == "replay" and not kind.replays(self.system):
            raise ValueError("expect.params_match: replay needs the reference trainer with "
                             "`recovery: elastic` (the only system that records membership)")
        for problem in kind.problems(self):
            raise ValueError(problem)
        setting = faults.Setting(kind.name, kind.root_is_run_folder(self.system))
        for name in sorted({str(f.kind) for f in self.faults}):
            check = registry.hooks(faults.get(name)).check
            if check is not None:
                for problem in check([f for f in self.faults if f.kind == name], setting):
                    raise ValueError(problem)
        return self

    def _fault_checks_are_possible(self) -> None:
        """Checks about a fault need one, and ``faults_landed`` one that can land."""
        if not self.faults:
            for name in ("time_to_detect", "time_to_recover", "single_history",
                         "checkpoint_durable"):
                if getattr(self.expect, name) not in (None, False):
                    raise ValueError(f"expect.{name} needs at least one fault")
        if self.expect.faults_landed and not any(
                f.at.file is not None and f.at.when in WINDOWED for f in self.faults):
            raise ValueError(
                "expect.faults_landed needs a fault triggered inside a write: `at: {file: "
                "GLOB, when: opened}` (or `modified`, `created`); `closed` and `deleted` come "
                "after the write, so they have no window to land in")

    def _family_checks_are_possible(self, kind: systems.SystemKind) -> None:
        """A serving check needs a server and a load, a training check a trainer."""
        for name in Expect.TRAINING if kind.family == "serving" else Expect.SERVING:
            if getattr(self.expect, name) in (None, False):
                continue
            if name in Expect.SERVING:
                if self.load is not None:
                    continue  # they read what the load's clients received
                raise ValueError(
                    f"expect.{name} needs a load: add a `load:` block (scenario-level) with the "
                    "server's url (`load: {url: 'http://127.0.0.1:${port}'}`, the command "
                    "listening on `--port=${port}`; docs/own-job.md, \"Your own server\"), or "
                    "run `reference: server`")
            shapes = [k.shape.strip("`") for k in systems.kinds() if k.family == "training"]
            raise ValueError(f"expect.{name} needs a training system (`{'` or `'.join(shapes)}`)")

    def _load_is_possible(self, kind: systems.SystemKind) -> None:
        if self.load is None:
            return
        if kind.family == "serving":
            raise ValueError(f"{kind.shape} takes its load as `system.load` (it says itself "
                             "where it listens); a scenario-level `load:` is for a server a "
                             "`command:` starts")
        if "${port}" in self.load.url and not (
                isinstance(self.system, CommandSystem) and uses_variable(self.system, "port")):
            raise ValueError("load.url uses ${port}, the free port the harness picks for the "
                             "run; the command must listen on it: pass it in `command` or "
                             "`env` (e.g. `--port=${port}`)")

    def without_faults(self) -> Scenario:
        """The fault-free twin of this scenario, used as the golden reference.

        Test hooks that inject faults through the environment (``AFTERSHOCK_INJECT_*``)
        are faults too, so the twin goes without them.
        """
        system = self.system
        env: dict[str, str] = getattr(system, "env", {})
        clean = {k: v for k, v in env.items() if not k.startswith(contract.INJECT_PREFIX)}
        if clean != env:
            system = system.model_copy(update={"env": clean})
        return self.model_copy(update={"faults": [], "expect": Expect(), "system": system})


@dataclass(frozen=True, slots=True)
class LoadedScenario:
    spec: Scenario
    path: Path
    text: str


# --------------------------------------------------------------------------- loading

#: Bounds on a scenario file, so that validating a hostile or broken file costs a fraction of
#: a second and a few MB instead of the machine: far above any real scenario (the shipped ones
#: are at most 1.2 KB, 70 values and 5 levels deep), far below what would hurt.
MAX_FILE_BYTES = 256 * 1024
#: Values (scalars, lists, mappings) once every alias is expanded: a billion-laughs file of a
#: few hundred bytes expands to 10**9 of them.
MAX_VALUES = 10_000
#: Nesting levels, the top-level mapping being level 1.
MAX_DEPTH = 32
#: Integers in a scenario fit in 64 bits; longer digit strings are refused before Python
#: converts them (which costs time quadratic in the digits, and fails past 4,300).
_MAX_INT = 2**64 - 1
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
#: Characters YAML forbids (C0/C1 controls but tab, LF, CR and NEL; surrogates; U+FFFE/F).
_NON_PRINTABLE = yaml.reader.Reader.NON_PRINTABLE


class _LoadError(yaml.MarkedYAMLError):
    """A problem the bounded loader found, at a position in the file."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: nesting, values and integers, and no recursive aliases.

    Composition counts values and depth as the events arrive, so a deep or huge file stops at
    the limit, before PyYAML's recursive composer runs out of stack. Aliases are not copied
    at composition (one node, many parents), so what they expand to is measured afterwards
    on the node graph (``_expanded``) before anything walks the expanded tree.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0
        self.values = 0
        self.finished: set[int] = set()
        #: Each alias: where it is, how deep it sits, and the node it names.
        self.aliases: list[tuple[Any, int, yaml.Node]] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: Any = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            # An anchor is registered when its node starts: naming it before the node is
            # finished makes a cycle, which every later walk would follow forever.
            if target is not None and id(target) not in self.finished:
                raise _LoadError(f"alias *{event.anchor} refers to a value that contains it "
                                 "(a recursive alias)", event.start_mark)
            node = super().compose_node(parent, index)
            if node is not None:
                self.aliases.append((event.start_mark, self.depth, node))
            return node
        self.depth += 1
        self.values += 1
        if self.depth > MAX_DEPTH:
            raise _LoadError(f"nested more than {MAX_DEPTH} levels deep (the limit)",
                             event.start_mark)
        if self.values > MAX_VALUES:
            raise _LoadError(f"more than {MAX_VALUES:,} values (the limit for a scenario)",
                             event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        self.finished.add(id(node))
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML lets a scalar's own conversion errors escape (int('12x') for `!!int 12x`,
        # a bad `!!timestamp`): make them errors at the scalar's position.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            value = _quote(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise _LoadError(f"{value} is not a valid {tag} ({_quote(str(exc), 100)[1:-1]})",
                             node.start_mark) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = re.sub(r"[^0-9a-fA-F]", "", str(node.value))
        if len(digits) > 40:
            raise _LoadError(f"an integer of {len(digits)} digits is out of range (integers "
                             f"in a scenario fit in 64 bits)", node.start_mark)
        value = super().construct_yaml_int(node)
        if abs(value) > _MAX_INT:
            raise _LoadError(f"{_quote(node.value)} is out of range (integers in a scenario "
                             "fit in 64 bits)", node.start_mark)
        return value


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
# Dates stay text: no scenario key is a date, and a bad one (2024-13-45) raised ValueError out
# of PyYAML instead of a type error at its position.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _quote(value: Any, limit: int = 60) -> str:
    """A bad value for a message: quoted, and shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-4:]}"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _expanded(root: yaml.Node) -> dict[int, tuple[int, int]]:
    """For every node: (values, depth) once aliases are expanded, without expanding them.

    The node graph is acyclic (the loader refuses recursive aliases), so each node is
    measured once from its children's measures; iterative, since expanded depth is not
    bounded by the composer's limit.
    """
    measured: dict[int, tuple[int, int]] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in measured:
            continue
        children = _children(node)
        if not ready:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in measured)
            continue
        values = 1 + sum(measured[id(child)][0] for child in children)
        depth = 1 + max((measured[id(child)][1] for child in children), default=0)
        measured[id(node)] = (values, depth)
    return measured


def _check_aliases(loader: _Loader, root: yaml.Node) -> None:
    """Refuse a file whose aliases expand it past the value or depth limit."""
    if not loader.aliases:
        return  # the composer's own counts are the expanded ones
    measured = _expanded(root)
    values, depth = measured[id(root)]
    if values > MAX_VALUES:
        mark, _, node = max(loader.aliases, key=lambda alias: measured[id(alias[2])][0])
        raise _LoadError(
            f"aliases expand the scenario to {values:,} values, more than the limit of "
            f"{MAX_VALUES:,} (this alias alone is {measured[id(node)][0]:,})", mark)
    if depth > MAX_DEPTH:
        mark, _, node = max(loader.aliases,
                            key=lambda alias: alias[1] + measured[id(alias[2])][1])
        raise _LoadError(f"aliases nest the scenario {depth} levels deep, more than the "
                         f"limit of {MAX_DEPTH}", mark)


@dataclass(slots=True)
class _Marks:
    keys: dict[tuple[Any, ...], tuple[int, int]]
    values: dict[tuple[Any, ...], tuple[int, int]]


def _collect_marks(
    node: yaml.Node, path: tuple[Any, ...], marks: _Marks, problems: list[str], file: str
) -> None:
    # Walks the expanded tree: bounded by MAX_VALUES and MAX_DEPTH (checked before).
    marks.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            where = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if not isinstance(key_node, yaml.ScalarNode):
                shape = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                problems.append(f"{file}:{where[0]}:{where[1]}: a key must be a plain name, "
                                f"not a {shape}")
                continue
            key = key_node.value
            if key in seen:
                problems.append(f"{file}:{where[0]}:{where[1]}: duplicate key {key!r}")
            seen.add(key)
            marks.keys[(*path, key)] = where
            _collect_marks(value_node, (*path, key), marks, problems, file)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_marks(item, (*path, index), marks, problems, file)


def _data_path(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Pydantic's error location without union tags: the path into the YAML data.

    A tag such as ``reference`` can also be a key, so both readings are tried
    and the one that follows the data furthest wins.
    """

    def walk(index: int, current: Any, path: tuple[Any, ...]) -> tuple[int, tuple[Any, ...]]:
        """(how many parts of ``loc`` this reading explains, the data path)."""
        if index == len(loc):
            return index, path
        part = loc[index]
        options: list[tuple[int, tuple[Any, ...]]] = []
        in_dict = isinstance(current, dict) and part in current
        in_list = isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        if in_dict or in_list:
            options.append(walk(index + 1, current[part], (*path, part)))
        if isinstance(part, str) and path_is_tag(part):
            options.append(walk(index + 1, current, path))
        if not options:
            # A missing or unknown key is the subject of the error: keep it.
            if isinstance(current, dict) and isinstance(part, str):
                return index + 1, (*path, part)
            return index, path
        return max(options, key=lambda option: option[0])

    return walk(0, data, ())[1]


def path_is_tag(part: str) -> bool:
    return (part in FAULT_MODELS or any(part in (k.name, k.tag[0]) for k in systems.kinds())
            or "[" in part)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, dict):
        found: list[type[BaseModel]] = []
        for arg in typing.get_args(annotation):
            found.extend(_models_in(arg))
        return found
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _model_at(path: tuple[Any, ...], data: Any) -> type[BaseModel] | None:
    """The model that owns the mapping at ``path`` (to list its allowed keys)."""
    model: type[BaseModel] | None = Scenario
    current = data
    for part in path:
        if isinstance(part, int):
            current = current[part] if isinstance(current, list) else None
            continue
        if model is None or part not in model.model_fields:
            return None
        candidates = _models_in(model.model_fields[part].annotation)
        current = current.get(part) if isinstance(current, dict) else None
        if isinstance(current, list):
            pass
        model = _pick(candidates, current)
    if isinstance(current, list):
        return None
    return model


def _pick(candidates: list[type[BaseModel]], value: Any) -> type[BaseModel] | None:
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    sample = value[0] if isinstance(value, list) and value else value
    if isinstance(sample, dict):
        if "kind" in sample and sample["kind"] in FAULT_MODELS:
            return FAULT_MODELS[sample["kind"]]
        kind = systems.claimed(sample)
        if kind is not None:
            return kind.model
    return None


def _describe(error: Any, path: tuple[Any, ...], data: Any) -> str:
    # A key is data: quoted unless a plain name, so a newline or an escape sequence in it
    # can neither split the one-line problem nor reach the terminal raw.
    where = ".".join(
        str(p) if re.fullmatch(r"[\w-]+", str(p)) else repr(str(p)) for p in path
    ) or "scenario"
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else "?"
        owner = _model_at(path[:-1], data)
        allowed = sorted(owner.model_fields) if owner else []
        hint = ""
        close = difflib.get_close_matches(str(key), allowed, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        listing = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{where}: unknown key {key!r}{listing}{hint}"
    if kind == "missing":
        return f"{where}: required key is missing"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        message = (
            f"unknown kind {ctx.get('tag')!r} (allowed: {ctx.get('expected_tags')})"
        )
    return f"{where}: {message}"


def _position(text: str, index: int) -> tuple[int, int]:
    """Line and column of ``text[index]``, counted as PyYAML counts them (1-based)."""
    before = text[:index]
    breaks = list(re.finditer(r"\r\n|[\r\n\x85\u2028\u2029]", before))
    line_start = breaks[-1].end() if breaks else 0
    return len(breaks) + 1, len(before[line_start:].replace("\ufeff", "")) + 1


def unreachable(spec: Scenario, scenario_dir: Path | None) -> list[tuple[int, str]]:
    """Faults that cannot reach this system, by index, each with why: what the fault needs
    (aftershock.faults.registry.CAPABILITIES) that the system's target does not offer, or the
    in-process probe that its job does not call, or a ``target`` coordinate it can never
    resolve (``replica`` on a job that reports none: ``SystemKind.unresolved``)
    (``scenario_dir``: where the scenario file is, to read the files its command names;
    None: only what needs no file is known)."""
    kind = systems.of(spec.system)
    offered = set(kind.capabilities(spec.system))
    no_probe = kind.probe(spec.system, scenario_dir)
    if no_probe is None:
        offered.add("probe")
    # Optional: why a kind's target can never find the processes a fault's `target` names.
    unresolved = systems.unresolved(kind)
    found: list[tuple[int, str]] = []
    for index, fault in enumerate(spec.faults):
        fault_kind = faults.get(fault.kind)
        missing = registry.needs(fault_kind, fault, fault.at.phase) - offered
        if fault.target.node is not None and not offered & {"containers", "slurm"}:
            found.append((index, f"target {{node: {fault.target.node}}} names a node of a "
                          f"multi-node system (`nodes: N`, docs/nodes.md), which a "
                          f"{kind.shape} system is not"))
            continue
        if "probe" in missing:
            how = ""
            if registry.hooks(fault_kind).acts == "either":
                how = f" {registry.hooks(fault_kind).inside_when}".rstrip()
            found.append((index, f"{fault.kind}{how} is applied inside the target by the "
                          "in-process probe, which the job must start by calling "
                          f"aftershock.probe.install() (docs/faults.md); but {no_probe}"))
        elif missing:
            what = "; ".join(faults.CAPABILITIES.get(c, c) for c in sorted(missing))
            found.append((index, f"{fault.kind} needs {what}, which a {kind.shape} system's "
                          "target does not offer"))
        elif unresolved is not None:
            why = unresolved(spec.system, fault.target, no_probe is None)
            if why is not None:
                found.append((index, f"target {fault.target.describe()} can never be found: "
                              f"{why}"))
    return found


_Where = tuple[str | int, ...]


def _broken_plugins(data: dict[str, Any]) -> list[tuple[_Where, Broken]]:
    """The plug-ins skipped as broken (faults/plugins.py) that a scenario which failed to
    validate names, each with where it names it: such a scenario is not what is wrong."""
    return [*_broken_in_system(data.get("system")), *_broken_kinds(data),
            *_broken_checks(data.get("expect"))]


def _broken_in_system(system: Any) -> list[tuple[_Where, Broken]]:
    """A broken system kind or preset the ``system:`` block names."""
    from aftershock.harness.scenario import presets

    if not isinstance(system, dict):
        return []
    found: list[tuple[_Where, Broken]] = []
    skipped = systems.broken_for(system)
    if skipped is not None:
        found.append((("system",), skipped))
    chosen = system.get("preset")
    names = [chosen] if isinstance(chosen, str) else chosen if isinstance(chosen, list) else []
    for name in names:
        if isinstance(name, str) and (skipped := presets.broken_for(name)) is not None:
            found.append((("system", "preset"), skipped))
    return found


def _broken_kinds(data: dict[str, Any]) -> list[tuple[_Where, Broken]]:
    """Broken fault kinds the ``faults:`` list or an ``explore:`` block's kinds name (as
    ``- kind`` or ``- {kind: kind, params: ...}``)."""
    found: list[tuple[_Where, Broken]] = []
    listed = data.get("faults")
    for index, fault in enumerate(listed if isinstance(listed, list) else []):
        kind = fault.get("kind") if isinstance(fault, dict) else None
        if isinstance(kind, str) and (skipped := registry.broken_kind(kind)) is not None:
            found.append((("faults", index, "kind"), skipped))
    space = data.get("explore")
    kinds = space.get("kinds") if isinstance(space, dict) else None
    for index, entry in enumerate(kinds if isinstance(kinds, list) else []):
        where: _Where = ("explore", "kinds", index)
        kind = entry.get("kind") if isinstance(entry, dict) else entry
        if isinstance(kind, str) and (skipped := registry.broken_kind(kind)) is not None:
            found.append(((*where, "kind") if isinstance(entry, dict) else where, skipped))
    return found


def _broken_checks(expect: Any) -> list[tuple[_Where, Broken]]:
    """Broken plug-in checks ``expect: checks:`` asks for."""
    asked = expect.get("checks") if isinstance(expect, dict) else None
    return [(("expect", "checks", name), skipped)
            for name in (asked if isinstance(asked, dict) else {})
            if isinstance(name, str) and (skipped := check_registry.broken_for(name)) is not None]


def parse_scenario(text: str, file: str = "<string>", *, folder: Path | None = None) -> Scenario:
    """Parse and validate scenario YAML; raise SpecError with every problem found.
    ``folder``: where its relative file names point (default: the folder of ``file``, if it
    is a file)."""
    _check_text(text, file)
    data, marks = _load_yaml(text, file)
    spec = _validated(data, marks, file)
    if spec.explore is not None:
        problems = _explore_problems(spec, marks, file)
        if problems:
            raise SpecError(problems)
    base = folder if folder is not None else Path(file).parent if Path(file).is_file() else None
    problems = _file_problems(spec, base, marks, file)
    if problems:
        raise SpecError(problems)
    return spec


def _check_text(text: str, file: str) -> None:
    """Refuse a scenario too long to be one, or with a control character YAML refuses."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError([f"{file}:1:1: the scenario is longer than {MAX_FILE_BYTES // 1024} "
                         "KiB, the limit for a scenario file"])
    bad = _NON_PRINTABLE.search(text)
    if bad is not None:
        line, col = _position(text, bad.start())
        hint = " (is the file UTF-16? scenarios are UTF-8)" if bad.group() == "\0" else ""
        raise SpecError([f"{file}:{line}:{col}: control character U+{ord(bad.group()):04X} "
                         f"is not allowed in YAML{hint}"])


def _load_yaml(text: str, file: str) -> tuple[dict[Any, Any], _Marks]:
    """The scenario's YAML as data, with where each key and value is in the file."""
    problems: list[str] = []
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_aliases(loader, node)
            marks = _Marks(keys={}, values={})
            # Before construction: merge keys (`<<`) rewrite the nodes they are in.
            _collect_marks(node, (), marks, problems, file)
            if problems:
                raise SpecError(problems)
            data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        # PyYAML's context says what it was reading ("expected a single document in the
        # stream"); its problem alone ("but found another document") reads as a fragment.
        detail = f"{exc.context}: {exc.problem}" if exc.context else exc.problem
        raise SpecError([f"{file}:{line}:{col}: invalid YAML: {detail}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{file}:1:1: invalid YAML: {exc}"]) from None
    finally:
        loader.dispose()
    if node is None or not isinstance(data, dict):
        raise SpecError(
            [f"{file}:1:1: a scenario must be a mapping with `name`, `system`, `faults`, `expect`"]
        )
    return data, marks


def _validated(data: dict[Any, Any], marks: _Marks, file: str) -> Scenario:
    """The scenario model of ``data``; SpecError names each problem where it is in the file
    (PluginError where it uses a plug-in that was skipped)."""
    # Check plug-ins load here, not when first asked for: a broken one is reported by every
    # command that reads a scenario, as a broken fault kind is.
    check_registry.from_plugins()
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        used = _broken_plugins(data)
        if used:
            raise PluginError([
                "{}:{}:{}: {}: {}".format(
                    file, *(marks.values.get(where) or marks.keys.get(where) or (1, 1)),
                    ".".join(map(str, where)), skipped.line())
                for where, skipped in used]) from None
        problems: list[str] = []
        for error in exc.errors():
            path = _data_path(tuple(error["loc"]), data)
            lookup = marks.keys if error["type"] == "extra_forbidden" else marks.values
            position = None
            probe = path
            while position is None:
                position = lookup.get(probe) or marks.keys.get(probe)
                if position is None:
                    if not probe:
                        position = (1, 1)
                    probe = probe[:-1]
            problems.append(f"{file}:{position[0]}:{position[1]}: {_describe(error, path, data)}")
        raise SpecError(problems) from None


def _explore_problems(spec: Scenario, marks: _Marks, file: str) -> list[str]:
    """What is wrong with the scenario's search space, each where it is in the file."""
    # The space is built on the models of this module: resolving it is the one step of a
    # parse that needs it, so it is imported here (aftershock.harness.scenario._space imports spec).
    from aftershock.harness.scenario._space import SpaceError, resolve

    try:
        resolve(spec.system, spec.explore)
    except SpaceError as exc:
        problems: list[str] = []
        for where, message in exc.problems:
            path = ("explore", *where)
            probe = path
            position = None
            while position is None and probe:
                position = marks.values.get(probe) or marks.keys.get(probe)
                probe = probe[:-1]
            line, col = position or (1, 1)
            name = ".".join(str(p) for p in path)
            problems.append(f"{file}:{line}:{col}: {name}: {message}")
        return problems
    return []


def _file_problems(spec: Scenario, base: Path | None, marks: _Marks, file: str) -> list[str]:
    """What the scenario names that is missing, unreachable or the run's own records."""
    problems: list[str] = []
    if base is not None:
        for where, problem in systems.of(spec.system).file_problems(spec.system, base):
            line, col = marks.values.get(("system", *where), (1, 1))
            problems.append(f"{file}:{line}:{col}: system.{'.'.join(map(str, where))}: "
                            f"{problem}")
    for index, problem in unreachable(spec, base):
        line, col = marks.values.get(("faults", index), (1, 1))
        problems.append(f"{file}:{line}:{col}: faults.{index}: {problem}")
    for index, field, problem in own_records.refused(spec, base):
        line, col = (marks.values.get(("faults", index, field))
                     or marks.values.get(("faults", index, "root"))
                     or marks.values.get(("faults", index), (1, 1)))
        problems.append(f"{file}:{line}:{col}: faults.{index}.{field}: {problem}")
    return problems


_FILE_KINDS = {
    stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket",
}


def _read_bounded(file: Path) -> bytes:
    """The file's bytes, if it is a regular file of at most MAX_FILE_BYTES."""

    def refuse(what: str) -> SpecError:
        return SpecError([f"{file}:1:1: {what}"])

    try:
        # Look before opening: opening a named pipe waits for a writer, and opening a
        # device can have effects of its own.
        kind = stat.S_IFMT(os.stat(file).st_mode)
        if kind != stat.S_IFREG:
            raise refuse(f"not a regular file ({_FILE_KINDS.get(kind, 'not a file')}); a "
                         "scenario is a YAML file")
        # O_NONBLOCK: should the path be swapped for a pipe meanwhile, open does not wait.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise refuse("not a regular file; a scenario is a YAML file")
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot read scenario: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise refuse(f"the file is larger than {MAX_FILE_BYTES // 1024} KiB, the limit for a "
                     "scenario file")
    return data


_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
)


def _decode(data: bytes, file: str) -> str:
    """UTF-8 text (YAML also allows UTF-16 and 32; we keep scenario files to one encoding)."""
    for bom, name in _WIDE_BOMS:  # UTF-32's little-endian BOM starts with UTF-16's
        if data.startswith(bom):
            raise SpecError([f"{file}:1:1: the file is {name} text; scenarios are UTF-8 "
                             f"(convert it: iconv -f {name} -t UTF-8)"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = data[: exc.start].decode("utf-8")
        line, col = _position(good, len(good))
        raise SpecError([f"{file}:{line}:{col}: not UTF-8 text: byte 0x{data[exc.start]:02x} "
                         f"({exc.reason}); scenarios are UTF-8"]) from None


def to_yaml(spec: Scenario) -> str:
    """``spec`` as scenario YAML that parses back to an equal Scenario: the keys its author
    (or the code that built it) gave, defaults left implicit as they were; durations
    exactly, in ms or s."""
    data = _plain(spec.model_dump(mode="python", exclude_unset=True))
    if data.get("explore", "") is None:
        del data["explore"]
    # A fault reads kind first, as people write it (the model lists its own fields last).
    data["faults"] = [{"kind": f.pop("kind"), **f} for f in data.get("faults", [])]
    if not data["faults"]:
        del data["faults"]
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, timedelta):
        micro = round(value.total_seconds() * 1_000_000)
        if micro % 1_000_000 == 0:
            return f"{micro // 1_000_000}s"
        return f"{micro // 1000}ms" if micro % 1000 == 0 else f"{micro}us"
    return value


class _Dumper(yaml.SafeDumper):
    """Block style, except small mappings of plain values (`target: {rank: 1}`), as
    scenarios are written by hand."""

    def represent_dict(self, data: Any) -> yaml.MappingNode:
        node = super().represent_dict(data)
        small = len(data) <= 4 and all(
            isinstance(v, str | int | float | bool) and len(str(v)) < 40 for v in data.values())
        node.flow_style = small and bool(data)
        return node


_Dumper.add_representer(dict, _Dumper.represent_dict)


def load_scenario(path: str | Path) -> LoadedScenario:
    file = Path(path)
    text = _decode(_read_bounded(file), str(file))
    return LoadedScenario(spec=parse_scenario(text, str(file)), path=file, text=text)


def find_scenarios(paths: list[str | Path]) -> tuple[list[Path], list[str]]:
    """Scenario files under the given files and folders, sorted, each once; and a problem
    for each path that does not exist or cannot be read (a folder's unreadable subfolders
    included: skipping them would pass a suite that never ran)."""
    found: list[Path] = []
    problems: list[str] = []
    unreadable: list[OSError] = []
    for raw in paths:
        path = Path(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            problems.append(f"{path}:1:1: no such file or folder")
            continue
        except OSError as exc:
            problems.append(f"{path}:1:1: cannot read: {exc.strerror or exc}")
            continue
        if not is_dir:
            found.append(path)
            continue
        here: list[Path] = []
        for folder, _, names in os.walk(path, onerror=unreadable.append):
            here.extend(Path(folder, n) for n in names if Path(n).suffix in SCENARIO_SUFFIXES)
        found.extend(sorted(p for p in here if p.is_file()))
    problems.extend(f"{exc.filename}:1:1: cannot read folder: {exc.strerror or exc}"
                    for exc in unreadable)
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique, problems


def discover(paths: list[str | Path]) -> list[Path]:
    """Scenario files under the given files and folders; SpecError lists every bad path."""
    found, problems = find_scenarios(paths)
    if problems:
        raise SpecError(problems)
    return found


def json_schema() -> dict[str, Any]:
    schema = Scenario.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Aftershock scenario"
    return schema
