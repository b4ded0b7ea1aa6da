"""The search space of ``aftershock explore``: a scenario's ``explore:`` block with the
system's defaults filled in and every choice checked against the fault kinds' own models.

No hypothesis here: validating a scenario must not import it. ``aftershock.strategies``
draws
schedules from a resolved :class:`Space`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from pydantic import ValidationError

from aftershock.harness.scenario.faults_spec import FAULT_MODELS, Phase, _FaultBase, in_process
from aftershock.harness.scenario.space_spec import (
    EventTrigger,
    Explore,
    FileTrigger,
    KindSpace,
    ParamSpan,
    Span,
    TimeSpan,
    TriggerSpace,
)
from aftershock.harness.systems.command import CommandSystem
from aftershock.harness.systems.server import ServerSystem
from aftershock.harness.systems.trainer import TrainerSystem

#: Where a problem is in the scenario (keys and list indexes under ``explore``), and what.
Problem = tuple[tuple[Any, ...], str]

#: Target families from the simplest to the widest: hypothesis shrinks a choice toward the
#: first, so a shrunk schedule hits one named process where one is enough.
FAMILY_ORDER = ("rank", "worker", "router", "random", "replica", "shard", "majority",
                "spare", "launcher", "all")
#: Families that expand to one fault per rank for a fault applied inside the target (the
#: probe's rank filter names one rank or every rank, not a set).
GROUPS = ("replica", "shard", "majority")
#: Families a fault applied inside the target cannot use: a role is not a rank.
ROLES = ("spare", "launcher")
#: Events and fault points that only come after a failure (docs/events.md): a fault waiting
#: for one can land only once an earlier fault caused a failure, so a schedule needs at least
#: one fault triggered by something else, or it never starts.
AFTER_A_FAILURE = ("failure_detected", "recovery_done", "checkpoint_loaded",
                   "checkpoint_skipped", "request_migrated", "restore")
#: The reference server's router's fault points, on the durability path of tokens (docs/
#: serving.md): only the router reaches them, and its step is its count of token records.
#: A server reports no committed steps, so there a step trigger is one of these points.
ROUTER_PHASES = ("token_produced", "journal_appended", "journal_synced", "token_sent")
#: Kinds a scenario holds at most one of (one lazy filesystem): a schedule draws one at most.
ONCE_PER_SCENARIO = ("storage.lose_unsynced",)
#: Fields of a fault that are not parameters.
_NOT_PARAMS = ("kind", "target", "at", "every")
#: The reference trainer's fault points in a training step, and around a checkpoint when the
#: trainer has them (harness.scenario.faults_spec.Phase lists what the probe knows).
_TRAIN_PHASES = ("forward", "backward", "optimizer", "save", "restore", "finish", "exit")
#: Fault points after the last step (the final parameters, the exit): they fire at the run's
#: last step only, so a fault drawn at one of them is put there whatever step was drawn.
END_PHASES = ("finish", "exit")


class SpaceError(ValueError):
    """The ``explore`` block does not fit the system: each problem with its place."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{'.'.join(map(str, p))}: {m}" for p, m in problems))


@dataclass(frozen=True, slots=True)
class ParamDraw:
    """How one parameter is drawn: from ``choices``, or between ``low`` and ``high`` as an
    ``int``, a ``float`` or whole milliseconds (``ms``, a duration)."""

    name: str
    choices: tuple[Any, ...] = ()
    low: float = 0
    high: float = 0
    unit: str = ""

    def first(self) -> Any:
        """The simplest value: the first choice, or the low end."""
        if self.choices:
            return self.choices[0]
        if self.unit == "ms":
            return timedelta(milliseconds=self.low)
        return int(self.low) if self.unit == "int" else self.low


@dataclass(frozen=True, slots=True)
class KindChoice:
    kind: str
    params: tuple[ParamDraw, ...]
    targeted: bool  # storage faults act on files: no target is drawn
    in_process: bool  # applied by the probe inside the target
    phased: bool  # `at.phase` means something for it
    families: tuple[str, ...]  # the declared target families it can use


@dataclass(frozen=True, slots=True)
class EventChoice:
    event: str
    count: tuple[int, int]


@dataclass(frozen=True, slots=True)
class FileChoice:
    file: str
    when: str
    count: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Layout:
    """Who there is to hit."""

    ranks: int | None  # ranks (workers for a server) at full strength; None: not known
    replicas: int = 1
    shards: int = 1

    def rank_of(self, replica: int, shard: int) -> int:
        # The reference trainer's layout: rank = replica * shards + shard.
        return replica * self.shards + shard


@dataclass(frozen=True, slots=True)
class Space:
    faults: tuple[int, int]
    kinds: tuple[KindChoice, ...]
    layout: Layout
    steps: tuple[int, int] | None
    phases: tuple[str, ...]
    events: tuple[EventChoice, ...]
    files: tuple[FileChoice, ...]
    time_ms: tuple[int, int] | None
    spacing: tuple[int, int] | None
    last_step: int | None = None  # where END_PHASES fire; None: not known (no trainer)
    options: tuple[ParamDraw, ...] = ()  # system options drawn per run (`explore.system`)
    # Steps seen only at fault points (the server's router): a step trigger needs one.
    steps_at_points: bool = False


System = TrainerSystem | ServerSystem | CommandSystem


# ------------------------------------------------------------------------------- defaults


def default_kinds(system: System) -> list[KindSpace]:
    """Every fault kind that applies to ``system``, with parameter ranges that make sense
    for it. Kinds a machine cannot apply (no nftables, no ss -K) show up as runs whose fault
    could not be applied: discarded, never reported as failures."""
    kinds: list[dict[str, Any]] = [
        {"kind": "process.kill"},
        {"kind": "process.term", "params": {"grace": {"min": "100ms", "max": "3s"}}},
        {"kind": "process.freeze", "params": {"duration": {"min": "200ms", "max": "6s"}}},
    ]
    if isinstance(system, CommandSystem):
        # Nothing is known inside a command: faults from outside only.
        return [KindSpace.model_validate(k) for k in [*kinds, {"kind": "net.reset"}]]
    kinds += [
        {"kind": "process.hang", "params": {"duration": {"min": "200ms", "max": "6s"}}},
        {"kind": "net.reset"},
        {"kind": "net.partition", "params": {"duration": {"min": "200ms", "max": "6s"}}},
        {"kind": "gpu.xid", "params": {"code": [79, 13, 63]}},
    ]
    if isinstance(system, TrainerSystem):
        kinds += [
            {"kind": "collective.error"},
            {"kind": "collective.hang", "params": {"duration": {"min": "200ms", "max": "6s"}}},
            {"kind": "collective.delay", "params": {"delay": {"min": "100ms", "max": "3s"}}},
            {"kind": "collective.corrupt", "params": {"mode": ["nan", "inf"]}},
            {"kind": "memory.nan", "params": {"tensor": ["grad:*"]}},
        ]
        if system.recovery == "restart":
            # Only `restart` keeps durable checkpoints.
            kinds += [
                {"kind": "storage.corrupt", "params": {"path": ["step_*/rank_*.pt"]}},
                {"kind": "storage.truncate", "params": {"path": ["step_*/rank_*.pt"]}},
                {"kind": "storage.delete", "params": {"path": ["step_*/rank_*.pt"]}},
            ]
    return [KindSpace.model_validate(k) for k in kinds]


def default_targets(system: System) -> list[str]:
    if isinstance(system, ServerSystem):
        return ["worker", "random", "majority"]
    if isinstance(system, CommandSystem):
        return ["rank", "random", "majority"] if system.world else ["random"]
    families = ["rank", "random", "replica", "shard", "majority"]
    if system.recovery == "hot_spare" and system.spares:
        families.append("spare")
    return families


def _known_phases() -> tuple[str, ...]:
    return typing.get_args(Phase)


def default_triggers(system: System) -> TriggerSpace:
    if isinstance(system, TrainerSystem):
        events: list[Any] = ["failure_detected"]
        events += (["checkpoint_saved", "checkpoint_loaded"] if system.recovery == "restart"
                   else ["recovery_done"])
        phases = [p for p in _TRAIN_PHASES if p in _known_phases()]
        # Inside a save, seen from outside: a step's folder appears, a shard is published.
        files = [FileTrigger(file="step_*"), FileTrigger(file="step_*/rank_*.json")] \
            if system.recovery == "restart" else []
        return TriggerSpace(step=Span(min=1, max=system.steps), phases=phases,
                            events=[EventTrigger.model_validate(e) for e in events],
                            files=files)
    if isinstance(system, ServerSystem):
        half = max(1, system.load.requests // 2)
        return TriggerSpace(events=[
            EventTrigger(event="first_token", count=Span(min=1, max=half)),
            EventTrigger(event="request_migrated", count=Span(min=1, max=2)),
            EventTrigger(event="failure_detected", count=Span(min=1, max=2)),
        ])
    return TriggerSpace(time=TimeSpan.model_validate({"min": "100ms", "max": "3s"}))


# ------------------------------------------------------------------------------ resolving


def layout_of(system: System) -> Layout:
    if isinstance(system, TrainerSystem):
        return Layout(system.world.size, system.world.replicas, system.world.shards)
    if isinstance(system, ServerSystem):
        return Layout(system.workers)
    return Layout(system.world)


def families_for(system: System) -> dict[str, str]:
    """Target families this system has, and for the others why not."""
    layout = layout_of(system)
    trainer = isinstance(system, TrainerSystem)
    server = isinstance(system, ServerSystem)
    why: dict[str, str] = {}
    if server:
        why["rank"] = "a server's processes are workers: use `worker`"
    elif layout.ranks is None:
        why["rank"] = "the command's `world` is not given, so its ranks are not known"
    if not server:
        why["worker"] = "only the reference server has workers"
        why["router"] = "only the reference server has a router"
    for family in ("replica", "shard"):
        if not trainer:
            why[family] = "only the reference trainer reports replicas and shards"
    if layout.ranks is None:
        why["majority"] = "the command's `world` is not given, so a majority is not known"
    if not (isinstance(system, TrainerSystem) and system.recovery == "hot_spare"
            and system.spares):
        why["spare"] = "only the reference trainer with `recovery: hot_spare` and spares has " \
                       "warm spares"
    return {f: why[f] for f in FAMILY_ORDER if f in why}


def resolve(system: System, explore: Explore | None) -> Space:
    """The space ``explore`` declares for ``system`` (None: every default); SpaceError lists
    every problem, each with its place under ``explore``."""
    explore = explore or Explore()
    problems: list[Problem] = []
    families = _families(system, explore, problems)
    at = _triggers(system, explore, problems)
    kinds = _kinds(system, explore, families, at.space.phases, problems)
    _phase_problems(system, at, families, problems)
    options = _option_draws(system, explore.system, problems)
    _steps_problems(options, at.steps, problems)
    if problems:
        raise SpaceError(problems)
    return Space(
        faults=(explore.faults.min, explore.faults.max),
        kinds=tuple(kinds),
        layout=layout_of(system),
        steps=at.steps,
        phases=tuple(at.space.phases),
        events=tuple(at.events),
        files=tuple(at.files),
        time_ms=at.time_ms,
        spacing=at.spacing,
        last_step=system.steps if isinstance(system, TrainerSystem) else None,
        options=options,
        steps_at_points=isinstance(system, ServerSystem),
    )


def _families(system: System, explore: Explore, problems: list[Problem]) -> list[str]:
    """The target families of the search that this system has."""
    unavailable = families_for(system)
    families = list(explore.targets) if explore.targets is not None else default_targets(system)
    for index, family in enumerate(families):
        if explore.targets is not None and family in unavailable:
            problems.append((("targets", index), f"{family!r}: {unavailable[family]}"))
    return sorted({f for f in families if f not in unavailable}, key=FAMILY_ORDER.index)


@dataclass(frozen=True, slots=True)
class _At:
    """The triggers of a search: as declared (or the defaults), and as drawn from."""

    space: TriggerSpace
    where: tuple[str, ...]  # where they are under `explore` (nothing for the defaults)
    steps: tuple[int, int] | None
    events: list[EventChoice]
    files: list[FileChoice]
    time_ms: tuple[int, int] | None
    spacing: tuple[int, int] | None


def _triggers(system: System, explore: Explore, problems: list[Problem]) -> _At:
    """The search's triggers, with the problems of each."""
    at = explore.at if explore.at is not None else default_triggers(system)
    where_at: tuple[str, ...] = ("at",) if explore.at is not None else ()
    steps = (at.step.min, at.step.max) if at.step is not None else None
    if steps is not None:
        _step_span_problems(system, steps, where_at, problems)
    if at.count.min < 1:
        problems.append(((*where_at, "count", "min"), "an event's first occurrence is 1"))
    events, files = _counted_triggers(at, where_at, problems)
    time_ms = _time_span(system, at, where_at, problems)
    if steps is None and time_ms is None and not files and all(
            e.event in AFTER_A_FAILURE for e in events):
        problems.append((where_at or ("at",), "every trigger waits for a failure, so no "
                         "schedule can start: add `step`, `time`, `files` or an event that "
                         "happens without one"))
    spacing = (explore.spacing.min, explore.spacing.max) if explore.spacing else None
    if spacing is not None and steps is None:
        problems.append((("spacing",), "spaces step triggers: needs `at.step`"))
    return _At(at, where_at, steps, events, files, time_ms, spacing)


def _time_span(system: System, at: TriggerSpace, where_at: tuple[str, ...],
               problems: list[Problem]) -> tuple[int, int] | None:
    """The time trigger's span in milliseconds, if there is one."""
    if at.time is None:
        return None
    if at.time.max > system.timeout:
        problems.append(((*where_at, "time", "max"), "is past the run's timeout "
                         f"({system.timeout.total_seconds():g}s)"))
    return _ms(at.time.min), _ms(at.time.max)


def _step_span_problems(system: System, steps: tuple[int, int], where_at: tuple[str, ...],
                        problems: list[Problem]) -> None:
    if isinstance(system, TrainerSystem) and steps[1] > system.steps:
        problems.append(((*where_at, "step", "max"),
                         f"{steps[1]} is past the run's last step ({system.steps})"))
    if steps[0] < 1:
        problems.append(((*where_at, "step", "min"), "steps start at 1 (the first committed "
                         "step)"))


def _counted_triggers(at: TriggerSpace, where_at: tuple[str, ...], problems: list[Problem]
                      ) -> tuple[list[EventChoice], list[FileChoice]]:
    """The event and file triggers, each with its occurrences to draw from."""
    events = []
    for index, trigger in enumerate(at.events):
        count = trigger.count or at.count
        if count.min < 1:
            problems.append(((*where_at, "events", index, "count", "min"),
                             "an event's first occurrence is 1"))
        events.append(EventChoice(trigger.event, (count.min, count.max)))
    files = []
    for index, watched in enumerate(at.files):
        count = watched.count or at.count
        if count.min < 1:
            problems.append(((*where_at, "files", index, "count", "min"),
                             "a file's first occurrence is 1"))
        files.append(FileChoice(watched.file, watched.when, (count.min, count.max)))
    return events, files


def _kinds(system: System, explore: Explore, families: list[str], phases: Sequence[str],
           problems: list[Problem]) -> list[KindChoice]:
    """The fault kinds of the search, each with the targets it can hit."""
    declared = explore.kinds if explore.kinds is not None else default_kinds(system)
    kinds: list[KindChoice] = []
    for index, space in enumerate(declared):
        where = ("kinds", index) if explore.kinds is not None else ("kinds",)
        choice = _kind_choice(space, where, families, phases, problems)
        if choice is not None:
            choice = _aimed(system, choice, where, families, problems)
        if choice is not None:
            kinds.append(choice)
    if phases and not any(k.phased for k in kinds) and explore.at is not None:
        problems.append((("at", "phases"), "no fault kind of this search is applied at a fault "
                         "point (collective.*, process.hang, memory.* with `tensor`)"))
    return kinds


def _aimed(system: System, choice: KindChoice, where: tuple[Any, ...], families: list[str],
           problems: list[Problem]) -> KindChoice | None:
    """A kind with the targets it can hit on this system; None (a problem said) if none."""
    if choice.kind == "storage.lose_unsynced" and isinstance(system, ServerSystem):
        # The power goes under the router's journal and the router, which writes it, dies
        # with it: a worker alone would leave the router writing past the lost tail.
        router = ("router",) if "router" in families else ()
        choice = replace(choice, targeted=True, families=router)
        if not choice.families:
            problems.append((where, "storage.lose_unsynced on a server takes its router down "
                             "with the power: add `router` to the targets"))
            return None
    if choice.targeted and not choice.families:
        if families:  # (no family at all is the targets' problem, said above)
            why = ": a fault applied inside the target needs ranks, not roles" \
                if choice.in_process else ""
            problems.append((where, f"{choice.kind} cannot hit any of the targets "
                             f"({', '.join(families)}){why}"))
        return None
    return choice


def _phase_problems(system: System, at: _At, families: list[str],
                    problems: list[Problem]) -> None:
    """Fault points only the reference server's router has, and a server's steps."""
    router_phases = [p for p in at.space.phases if p in ROUTER_PHASES]
    if router_phases and not isinstance(system, ServerSystem):
        problems.append(((*at.where, "phases"), f"{', '.join(router_phases)}: only the "
                         "reference server's router has these fault points"))
    elif at.steps is not None and isinstance(system, ServerSystem) and not (
            router_phases and "router" in families):
        # A server commits no steps: its step is the router's count of token records, seen
        # only at the router's fault points.
        problems.append(((*at.where, "step"), "a server counts steps only at its router's "
                         f"fault points: give `phases` among {', '.join(ROUTER_PHASES)} and "
                         "`router` among the targets"))


def _steps_problems(options: Sequence[ParamDraw], steps: tuple[int, int] | None,
                    problems: list[Problem]) -> None:
    """A drawn number of steps below the last step a fault may be drawn at."""
    for draw in (d for d in options if d.name == "steps" and steps is not None):
        lowest = min(draw.choices) if draw.choices else draw.low
        if steps is not None and steps[1] > lowest:
            problems.append((("system", "steps"), f"{lowest:g}: fewer steps than the last step "
                             f"a fault may be drawn at ({steps[1]}, `at.step.max`)"))


#: System fields a search cannot draw: what the system is, and what is not one value.
_FIXED_OPTIONS = ("reference", "command", "program")


def with_options(system: System, options: dict[str, Any]) -> System:
    """``system`` with ``options`` (option → value) put over it, checked by its own model
    (raises ValidationError)."""
    data = system.model_dump(exclude_unset=True)
    for name, value in options.items():
        # `load.resubmit`: a field of a block, put over the block's own settings.
        *blocks, last = name.split(".")
        inner = data
        for block in blocks:
            nested = dict(inner.get(block) or {})
            inner[block] = nested
            inner = nested
        inner[last] = value
    return type(system).model_validate(data)


def option_value(system: System, name: str) -> Any:
    """The value of the option ``name`` (``steps``, or ``load.resubmit`` in a block)."""
    value: Any = system
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _option_field(system: System, name: str) -> Any:
    """The model field the option ``name`` is (a block's own with a dot: ``load.resubmit``),
    or None."""
    model: Any = type(system)
    field = None
    for part in name.split("."):
        fields = getattr(model, "model_fields", None)
        field = fields.get(part) if isinstance(fields, dict) else None
        if field is None:
            return None
        model = field.annotation
    return field


def _option_draws(system: System, declared: dict[str, list[Any] | ParamSpan],
                  problems: list[Problem]) -> tuple[ParamDraw, ...]:
    """``explore.system``: each option a scalar field of the system's model, each value (or
    each end of a range) one that model takes with the system's other settings."""
    draws = (_option_draw(system, name, choices, problems) for name, choices in declared.items())
    return tuple(draw for draw in draws if draw is not None)


def _option_draw(system: System, name: str, choices: list[Any] | ParamSpan,
                 problems: list[Problem]) -> ParamDraw | None:
    """One option of ``explore.system`` as drawn from; None (a problem said) if it is not
    one, or a value is not one the system takes."""
    where: tuple[Any, ...] = ("system", name)
    field = _option_field(system, name)
    if field is None or name in _FIXED_OPTIONS or not _scalar(field.annotation):
        problems.append((where, _not_an_option(system, name, field)))
        return None
    if isinstance(choices, list):
        values = [_option_valid(system, name, v, (*where, i), problems)
                  for i, v in enumerate(choices)]
        if not values:
            problems.append((where, "give at least one value"))
        if not values or any(v is None for v in values):
            return None
        return ParamDraw(name, choices=tuple(dict.fromkeys(values)))
    if not _scalar(field.annotation, numeric=True):
        problems.append((where, "a range needs a number or a duration option; give a list "
                         "of values"))
        return None
    return _option_range(system, name, choices, where, problems)


def _not_an_option(system: System, name: str, field: Any) -> str:
    """Why ``name`` cannot be drawn, with the options that can."""
    drawable = sorted(n for n, f in type(system).model_fields.items()
                      if n not in _FIXED_OPTIONS and _scalar(f.annotation))
    why = "not an option of this system" if field is None else \
        "what the system is" if name in _FIXED_OPTIONS else "not a single value"
    return f"{name!r}: {why} (drawable: {', '.join(drawable)})"


def _option_valid(system: System, name: str, value: Any, at: tuple[Any, ...],
                  problems: list[Problem]) -> Any:
    """``value`` as the system's model takes it for option ``name``; None (a problem said)
    if it does not."""
    try:
        return option_value(with_options(system, {name: value}), name)
    except ValidationError as exc:
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        problems.append((at, f"{value!r}: {message}"))
        return None


def _option_range(system: System, name: str, choices: ParamSpan, where: tuple[Any, ...],
                  problems: list[Problem]) -> ParamDraw | None:
    low = _option_valid(system, name, choices.min, (*where, "min"), problems)
    high = _option_valid(system, name, choices.max, (*where, "max"), problems)
    if low is None or high is None:
        return None
    span = _option_span(low, high)
    if span is None:
        problems.append((where, "a range needs a number or a duration option; give a list "
                         "of values"))
        return None
    unit, lo, hi = span
    if hi < lo:
        problems.append((where, "max is below min"))
        return None
    return ParamDraw(name, low=lo, high=hi, unit=unit)


def _option_span(low: Any, high: Any) -> tuple[str, float, float] | None:
    """An option's range as drawn from (its unit, its ends), or None if it is not one of
    numbers or durations."""
    if isinstance(low, timedelta) and isinstance(high, timedelta):
        return "ms", float(_ms(low)), float(_ms(high))
    if isinstance(low, bool) or not isinstance(low, int | float) \
            or not isinstance(high, int | float):
        return None
    unit = "int" if isinstance(low, int) and isinstance(high, int) else "float"
    return unit, float(low), float(high)


def _scalar(annotation: Any, *, numeric: bool = False) -> bool:
    """Whether a field holds one value (a number, a duration, a string, a choice), not a
    model, a list or a mapping; ``numeric``: and that value is a number or a duration."""
    stack, found = [annotation], []
    while stack:
        item = stack.pop()
        origin = typing.get_origin(item)
        if origin is typing.Literal:
            found.append(str)
        elif origin is typing.Annotated:
            stack.append(typing.get_args(item)[0])
        elif origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(item))
        elif origin is not None:
            return False  # list[...], dict[...]
        else:
            found.append(item)
    kinds = (int, float, timedelta, type(None)) if numeric else \
        (int, float, str, bool, timedelta, type(None))
    return bool(found) and all(t in kinds for t in found)


def _ms(value: timedelta) -> int:
    return round(value.total_seconds() * 1000)


def sample_fault(kind: str, params: dict[str, Any], *, phase: str | None = None) -> _FaultBase:
    """A fault of ``kind`` with ``params`` at some step, to ask the kind's own model whether
    the values are valid (raises ValidationError)."""
    at: dict[str, Any] = {"step": 1} if phase is None else {"step": 1, "phase": phase}
    data: dict[str, Any] = {"kind": kind, "at": at, **params}
    if not kind.startswith("storage."):
        data["target"] = {"rank": 0}
    return FAULT_MODELS[kind].model_validate(data)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    # Without union tags (a kind's model, `[duration]` of a duration or `{until}` form).
    loc = ".".join(str(p) for p in error["loc"]
                   if p not in FAULT_MODELS and not (isinstance(p, str) and "[" in p))
    return f"{loc}: {message}" if loc else message


def _kind_choice(
    space: KindSpace, where: tuple[Any, ...], families: list[str], phases: Sequence[str],
    problems: list[Problem],
) -> KindChoice | None:
    found = len(problems)
    base = _base_params(space, where, problems)
    if len(problems) > found:
        return None
    try:
        sample = sample_fault(space.kind, base)
    except ValidationError as exc:
        problems.append(((*where, "params"), f"{space.kind}: {_first_error(exc)}"))
        return None
    draws: list[ParamDraw] = []
    for name, choices in space.params.items():
        draw = _param_draw(space.kind, name, choices, base, (*where, "params", name), problems)
        if draw is not None:
            draws.append(draw)
    if len(problems) > found:
        return None
    process_side = in_process(sample)
    phased = _phased(space.kind, base, phases)
    targeted = not space.kind.startswith("storage.")
    usable = tuple(f for f in families if not (process_side and f in ROLES)) if targeted else ()
    return KindChoice(space.kind, tuple(draws), targeted, process_side, phased, usable)


def _base_params(space: KindSpace, where: tuple[Any, ...], problems: list[Problem]
                 ) -> dict[str, Any]:
    """The first value of every parameter: the values of one are checked with the others'."""
    model = FAULT_MODELS[space.kind]
    fields = {n: f for n, f in model.model_fields.items() if n not in _NOT_PARAMS}
    base: dict[str, Any] = {}
    for name, choices in space.params.items():
        if name not in fields:
            problems.append(((*where, "params", name), f"{space.kind} has no parameter "
                             f"{name!r} (allowed: {', '.join(sorted(fields))})"))
            continue
        if isinstance(choices, ParamSpan) and not _numeric(space.kind, name):
            problems.append(((*where, "params", name), "a range needs a number or a duration "
                             "parameter; give a list of values"))
            continue
        base[name] = choices[0] if isinstance(choices, list) else choices.min
    for name, field in fields.items():
        if field.is_required() and name not in base:
            problems.append(((*where, "params"), f"{space.kind} needs `{name}`: give its "
                             f"values, e.g. `params: {{{name}: [...]}}`"))
    return base


def _phased(kind: str, base: dict[str, Any], phases: Sequence[str]) -> bool:
    """Whether the kind is applied inside the target at one of the fault points."""
    for phase in phases:
        try:
            if in_process(sample_fault(kind, base, phase=phase)):
                return True
        except ValidationError:
            continue
    return False


def _param_draw(
    kind: str, name: str, choices: list[Any] | ParamSpan, base: dict[str, Any],
    where: tuple[Any, ...], problems: list[Problem],
) -> ParamDraw | None:
    def valid(value: Any, at: tuple[Any, ...]) -> Any:
        try:
            return getattr(sample_fault(kind, {**base, name: value}), name)
        except ValidationError as exc:
            problems.append((at, f"{value!r}: {_first_error(exc)}"))
            return None

    if isinstance(choices, list):
        values = [valid(v, (*where, i)) for i, v in enumerate(choices)]
        if any(v is None for v in values):
            return None
        unique: list[Any] = []
        for value in values:
            if value not in unique:
                unique.append(value)
        return ParamDraw(name, choices=tuple(unique))
    low, high = valid(choices.min, (*where, "min")), valid(choices.max, (*where, "max"))
    if low is None or high is None:
        return None
    span = _param_span(kind, name, low, high)
    if span is None:
        problems.append((where, "a range needs numbers or durations; give a list of values"))
        return None
    unit, lo, hi = span
    if hi < lo:
        problems.append((where, "max is below min"))
        return None
    return ParamDraw(name, low=lo, high=hi, unit=unit)


def _param_span(kind: str, name: str, low: Any, high: Any) -> tuple[str, float, float] | None:
    """A parameter's range as drawn from (its unit, its ends), or None if it is not one of
    numbers or durations."""
    if isinstance(low, timedelta) and isinstance(high, timedelta):
        return "ms", float(_ms(low)), float(_ms(high))
    if isinstance(low, bool) or isinstance(high, bool) or not (
            isinstance(low, int | float) and isinstance(high, int | float)):
        return None
    return ("int" if model_is_int(kind, name) else "float"), float(low), float(high)


def _numeric(kind: str, name: str) -> bool:
    """Whether the kind's parameter ``name`` holds numbers or durations."""
    annotation = FAULT_MODELS[kind].model_fields[name].annotation
    found: list[Any] = []
    stack = [annotation]
    while stack:  # through Optional, unions and Annotated (a Duration is one)
        item = stack.pop()
        args = typing.get_args(item)
        if typing.get_origin(item) is typing.Literal:
            found.append(str)
        elif args:
            stack.extend(args)
        else:
            found.append(item)
    return any(t in (int, float, timedelta) for t in found)


def model_is_int(kind: str, name: str) -> bool:
    """Whether the kind's parameter ``name`` holds whole numbers."""
    annotation = FAULT_MODELS[kind].model_fields[name].annotation
    args = typing.get_args(annotation) or (annotation,)
    return int in args and float not in args
