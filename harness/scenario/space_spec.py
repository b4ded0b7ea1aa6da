"""The scenario's ``explore:`` block: the space of fault schedules ``aftershock explore``
searches, as written (harness/scenario/_space.py resolves it against the system)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from aftershock.harness.scenario.faults_spec import FAULT_MODELS, At, FileWhen, Phase
from aftershock.harness.scenario.schema import MAX_STEPS, Duration
from aftershock.harness.scenario.schema import Strict as _Strict


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
