"""Hypothesis strategies for fault schedules: generate them, shrink them, keep them.

The one module of the harness that imports hypothesis; ``import harness`` does not import
it. ``aftershock explore`` searches with these, and so can your own tests::

    from hypothesis import given, settings
    from aftershock.harness.search.explore import run_schedule
    from aftershock.harness.scenario.load import load_scenario
    from aftershock.harness.search.strategies import fault_schedules

    BASE = load_scenario("scenarios/explore/restart.yaml")

    @settings(max_examples=10, deadline=None)
    @given(fault_schedules(BASE.spec.system, kinds=["process.kill"], max_faults=2))
    def test_survives_two_kills(schedule):
        result = run_schedule(BASE, schedule)
        assert result.passed, result.failed_checks()

A schedule is a list of faults of the same types a scenario's ``faults:`` holds
(``aftershock.harness.scenario.spec.Fault``), so a failing one is a scenario to keep
(``aftershock.harness.scenario.load.to_yaml``).
A space may also draw system options per run (``explore.system``: a snapshot interval, say):
:func:`scenarios` puts them into the scenario, :func:`trials_in` pairs them with a schedule.
Shrinking goes toward fewer faults, earlier and simpler triggers (a step before an event
before a file before a time; no fault point before a named one), the first kind and
parameter value declared, and simpler targets (one rank before a random pick, a replica, a
shard, a majority, every rank). Every choice comes from hypothesis, so the same seed gives the
same schedules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from pydantic import ValidationError

from aftershock.harness.scenario._space import (
    AFTER_A_FAILURE,
    END_PHASES,
    FAMILY_ORDER,
    ONCE_PER_SCENARIO,
    ROLES,
    ROUTER_PHASES,
    KindChoice,
    Layout,
    ParamDraw,
    Space,
    System,
    resolve,
    with_options,
)
from aftershock.harness.scenario.spec import (
    FAULT_MODELS,
    CommandSystem,
    EventTrigger,
    Explore,
    KindSpace,
    Scenario,
    ServerSystem,
    Span,
    TrainerSystem,
    TriggerSpace,
    _FaultBase,
)

__all__ = ["fault_schedules", "faults", "scenarios", "space_of", "system_options"]

SystemLike = TrainerSystem | ServerSystem | CommandSystem | Scenario


def space_of(
    system: SystemLike,
    *,
    kinds: Sequence[str | KindSpace | dict[str, Any]] | None = None,
    targets: Sequence[str] | None = None,
    at: TriggerSpace | dict[str, Any] | None = None,
    spacing: tuple[int, int] | None = None,
    min_faults: int | None = None,
    max_faults: int | None = None,
    explore: Explore | None = None,
) -> Space:
    """The resolved search space: ``explore`` (a scenario's block; default: the scenario's
    own, else every default) with the keyword arguments put over it."""
    if isinstance(system, Scenario):
        explore = explore if explore is not None else system.explore
    target: System = system.system if isinstance(system, Scenario) else system
    base = (explore or Explore()).model_dump(exclude_unset=True)
    if kinds is not None:
        base["kinds"] = [KindSpace.model_validate(k) for k in kinds]
    if targets is not None:
        base["targets"] = list(targets)
    if at is not None:
        base["at"] = TriggerSpace.model_validate(at)
    if spacing is not None:
        base["spacing"] = Span(min=spacing[0], max=spacing[1])
    faults = base.get("faults") or {"min": 1, "max": 2}
    low = min_faults if min_faults is not None else faults["min"]
    high = max_faults if max_faults is not None else max(faults["max"], low)
    base["faults"] = Span(min=low, max=max(low, high))
    return resolve(target, Explore.model_validate(base))


def fault_schedules(
    system: SystemLike,
    *,
    kinds: Sequence[str | KindSpace | dict[str, Any]] | None = None,
    targets: Sequence[str] | None = None,
    at: TriggerSpace | dict[str, Any] | None = None,
    spacing: tuple[int, int] | None = None,
    min_faults: int | None = None,
    max_faults: int | None = None,
    explore: Explore | None = None,
) -> st.SearchStrategy[list[_FaultBase]]:
    """Fault schedules for ``system`` (or a scenario: then its ``explore:`` block is the
    space): lists of faults, each a valid ``aftershock.harness.scenario.spec.Fault``.

    ``kinds``: fault kinds, bare (``"process.kill"``) or with parameter choices
    (``{"kind": "process.freeze", "params": {"duration": {"min": "200ms", "max": "3s"}}}``);
    ``targets``: target families (rank, worker, replica, shard, majority, all, random,
    spare, launcher); ``at``: the trigger space (``{"step": {"min": 1, "max": 60},
    "events": ["failure_detected"]}``); ``spacing``: steps between step triggers;
    ``min_faults``/``max_faults``: faults drawn per schedule (a group target such as a
    majority counts once). Anything left out comes from the system (docs/explore.md).
    """
    space = space_of(system, kinds=kinds, targets=targets, at=at, spacing=spacing,
                     min_faults=min_faults, max_faults=max_faults, explore=explore)
    return schedules_in(space)


def faults(system: SystemLike, **options: Any) -> st.SearchStrategy[list[_FaultBase]]:
    """One drawn fault (as a list: a group target expands to several), from the same space
    as :func:`fault_schedules`."""
    options.update(min_faults=1, max_faults=1)
    return fault_schedules(system, **options)


def scenarios(base: Scenario, **options: Any) -> st.SearchStrategy[Scenario]:
    """``base`` with its faults replaced by a drawn schedule, its system options (the space's
    ``system``) by drawn values, and no ``explore`` block: a scenario that runs as is and
    dumps to YAML (aftershock.harness.scenario.load.to_yaml). Options as for
    :func:`fault_schedules`; the
    space
    defaults to ``base.explore``."""
    space = space_of(base, **options)
    return trials_in(space).map(lambda trial: with_schedule(base, trial[1], system=trial[0]))


def with_schedule(base: Scenario, schedule: Sequence[_FaultBase], *,
                  system: dict[str, Any] | None = None) -> Scenario:
    """``base`` running ``schedule`` instead of its own faults, with the system options in
    ``system`` (option → value) put over its system, without the search space."""
    update: dict[str, Any] = {"faults": list(schedule), "explore": None}
    if system:
        update["system"] = with_options(base.system, system)
    return base.model_copy(update=update)


# ----------------------------------------------------------------------------- drawing


@dataclass(frozen=True, slots=True)
class _Draft:
    """One drawn fault before its step is placed (spacing depends on the ones before); a
    group target makes it several faults with one trigger."""

    kind: KindChoice
    params: dict[str, Any]
    targets: tuple[dict[str, Any], ...]  # one target, or one per rank of a group
    trigger: str  # step | event | file | time
    step: int = 0
    gap: int = 0
    phase: str | None = None
    event: str = ""
    file: str = ""
    when: str = "created"
    count: int = 1
    time_ms: int = 0


def schedules_in(space: Space) -> st.SearchStrategy[list[_FaultBase]]:
    """Schedules from a resolved space (aftershock.harness.scenario._space.resolve)."""
    drafts = st.lists(_drafts(space), min_size=space.faults[0], max_size=space.faults[1])
    return drafts.map(lambda found: _assemble(space, found))


def system_options(space: Space) -> st.SearchStrategy[dict[str, Any]]:
    """The system options of one run (``explore.system``: option → value), each shrinking
    toward its first value or the low end of its range."""

    @st.composite
    def options(draw: st.DrawFn) -> dict[str, Any]:
        return {p.name: _draw_param(draw, p) for p in space.options}

    return options()


def trials_in(space: Space) -> st.SearchStrategy[tuple[dict[str, Any], list[_FaultBase]]]:
    """What one run of a search is: the system options drawn (none when the space draws
    none), then the schedule. Options first: a schedule's steps are read against the
    snapshot interval, say, that the run has."""
    return st.tuples(system_options(space), schedules_in(space))


def _draw_param(draw: st.DrawFn, param: ParamDraw) -> Any:
    if param.choices:
        return draw(st.sampled_from(param.choices))
    if param.unit == "ms":
        return timedelta(milliseconds=draw(st.integers(int(param.low), int(param.high))))
    if param.unit == "int":
        return draw(st.integers(int(param.low), int(param.high)))
    # Three decimals: a value a person would write, and one YAML gives back exactly.
    value = draw(st.floats(param.low, param.high, allow_nan=False, allow_infinity=False))
    return min(max(round(value, 3), param.low), param.high)


def _targets(
    draw: st.DrawFn, space: Space, kind: KindChoice, family: str, index: int, *, inside: bool
) -> tuple[dict[str, Any], ...]:
    """The target of one drawn fault, or one per rank of a group when the probe applies the
    fault inside the target (its rank filter names one rank or every rank, not a set)."""
    if not kind.targeted:
        return ({},)
    layout = space.layout
    ranks = layout.ranks or 1
    if family in ("rank", "worker"):
        return ({family: index % ranks},)
    if family == "random":
        return ({"pick": "random"},)
    if family == "all":
        if not inside:
            return ({"pick": "all"},)
        # One per rank, like a group: `pick: all` is armed on the ranks the harness has seen
        # when it arms, which at the start may be fewer than all of them.
        return tuple({"rank": r} for r in range(ranks))
    if family in ("spare", "launcher", "router"):
        return ({"role": family},)
    if family == "majority":
        order = draw(st.permutations(range(ranks)))
        return tuple({"rank": r} for r in sorted(order[: ranks // 2 + 1]))
    return _group_targets(layout, family, index, inside=inside)


def _group_targets(layout: Layout, family: str, index: int, *, inside: bool
                   ) -> tuple[dict[str, Any], ...]:
    """A replica's or a shard's target; inside the target, one per rank of it."""
    if family == "replica":
        replica = index % layout.replicas
        if not inside:
            return ({"replica": replica},)
        return tuple({"rank": layout.rank_of(replica, s)} for s in range(layout.shards))
    shard = index % layout.shards
    if not inside:
        return ({"shard": shard},)
    return tuple({"rank": layout.rank_of(r, shard)} for r in range(layout.replicas))


def _drafts(space: Space) -> st.SearchStrategy[_Draft]:
    """One fault. Every draft draws the same choices, whichever kind, target and trigger
    family it picks (a choice a family does not use is drawn and ignored), and the kind's
    parameters last: hypothesis shrinks toward shorter choice sequences, so a family that drew
    fewer choices would pass for simpler than the first one and the shrinker could not move
    from it to a rank, or from an event to a step."""
    triggers = [t for t, there in (("step", space.steps is not None),
                                   ("event", bool(space.events)),
                                   ("file", bool(space.files)),
                                   ("time", space.time_ms is not None)) if there]
    layout = space.layout
    widest = max(layout.ranks or 1, layout.replicas, layout.shards)
    families = sorted({f for k in space.kinds for f in k.families}, key=FAMILY_ORDER.index)

    @st.composite
    def draft(draw: st.DrawFn) -> _Draft:
        kind = draw(st.sampled_from(space.kinds))
        family = draw(st.sampled_from(families)) if families else ""
        index = draw(st.integers(0, widest - 1))
        trigger = draw(st.sampled_from(triggers))
        step = draw(st.integers(*space.steps)) if space.steps else 0
        gap = draw(st.integers(*space.spacing)) if space.spacing else 0
        phase = draw(st.sampled_from((None, *space.phases))) if space.phases else None
        event = draw(st.sampled_from(space.events)) if space.events else None
        count = draw(st.integers(*event.count)) if event else 1
        watched = draw(st.sampled_from(space.files)) if space.files else None
        file_count = draw(st.integers(*watched.count)) if watched else 1
        time_ms = draw(st.integers(*space.time_ms)) if space.time_ms else 0
        family, phase, trigger = _fit(space, kind, family, phase, trigger, triggers)
        # A fault point makes a process.kill one the probe applies inside the target.
        inside = kind.in_process or phase is not None
        targets = _targets(draw, space, kind, family, index, inside=inside)
        params = {p.name: _draw_param(draw, p) for p in kind.params}
        if trigger == "file" and watched is not None:
            return _Draft(kind, params, targets, trigger, file=watched.file,
                          when=watched.when, count=file_count)
        return _Draft(kind, params, targets, trigger, step=step, gap=gap, phase=phase,
                      event=event.event if event else "", count=count, time_ms=time_ms)

    return draft()


def _fit(space: Space, kind: KindChoice, family: str, phase: str | None, trigger: str,
         triggers: Sequence[str]) -> tuple[str, str | None, str]:
    """The drawn family, fault point and trigger family, made ones the kind can take."""
    if kind.targeted and family not in kind.families:
        # A family this kind cannot use (a role, for a fault applied inside the target):
        # its simplest one instead.
        family = kind.families[0]
    if not kind.phased or trigger != "step" or (family in ROLES and not kind.in_process):
        phase = None  # (a role is not a rank the probe could filter on)
    return _router_points(space, kind, family, phase, trigger, triggers)


def _router_phase(kind: KindChoice, family: str, phase: str | None
                  ) -> tuple[str, str | None]:
    """A router's fault point takes the fault at the router, or is dropped for a kind the
    router cannot take (and a router target keeps no other fault point)."""
    if phase in ROUTER_PHASES and "router" in kind.families:
        return "router", phase
    if phase in ROUTER_PHASES or (family == "router" and phase is not None):
        return family, None
    return family, phase


def _router_points(space: Space, kind: KindChoice, family: str, phase: str | None,
                   trigger: str, triggers: Sequence[str]) -> tuple[str, str | None, str]:
    """Only the server's router reaches its fault points: a drawn one takes the fault there,
    or is dropped for a kind the router cannot take. A server counts steps only at those
    points, so a step trigger left without one takes the first point declared, or else
    the space's next trigger family (its events)."""
    family, phase = _router_phase(kind, family, phase)
    if space.steps_at_points and trigger == "step" and phase is None:
        points = [p for p in space.phases if p in ROUTER_PHASES]
        if family == "router" and kind.phased and points:
            phase = points[0]
        else:
            trigger = next((t for t in triggers if t != "step"), trigger)
    return family, phase, trigger


def _starts(draft: _Draft) -> bool:
    """Whether the fault can land in a run that nothing else has failed yet."""
    if draft.trigger == "event":
        return draft.event not in AFTER_A_FAILURE
    return draft.trigger != "step" or draft.phase not in AFTER_A_FAILURE


def _assemble(space: Space, drafts: list[_Draft]) -> list[_FaultBase]:
    # A schedule whose every fault waits for a failure never starts: no run is spent on it.
    assume(any(_starts(d) for d in drafts))
    # One lazy filesystem per scenario: at most one power loss in a schedule.
    assume(all(sum(d.kind.kind == k for d in drafts) <= 1 for k in ONCE_PER_SCENARIO))
    schedule: list[_FaultBase] = []
    previous: int | None = None
    for d in drafts:
        at: dict[str, Any]
        if d.trigger == "step":
            at, previous = _step_at(space, d, previous)
        elif d.trigger == "event":
            at = {"event": d.event} if d.count == 1 else {"event": d.event, "count": d.count}
        elif d.trigger == "file":
            at = {"file": d.file}
            if d.when != "created":
                at["when"] = d.when
            if d.count != 1:
                at["count"] = d.count
        else:
            at = {"time": timedelta(milliseconds=d.time_ms)}
        for target in d.targets:
            data: dict[str, Any] = {"kind": d.kind.kind, "at": at, **d.params}
            if target:
                data["target"] = target
            try:
                schedule.append(FAULT_MODELS[d.kind.kind].model_validate(data))
            except ValidationError:
                # Parameter values valid one by one can clash (the kind's own checks say
                # so): such a schedule is not drawn.
                assume(False)
    return schedule


def _step_at(space: Space, d: _Draft, previous: int | None
             ) -> tuple[dict[str, Any], int | None]:
    """A step trigger's ``at``, spaced from the previous step fault's; the step the next
    one is spaced from."""
    assert space.steps is not None
    step = d.step
    if d.phase in END_PHASES and space.last_step is not None:
        step = space.last_step  # (the only step these fault points fire at)
    else:
        if space.spacing is not None and previous is not None:
            step = min(previous + d.gap, space.steps[1])
        previous = step
    return ({"step": step} if d.phase is None else {"step": step, "phase": d.phase}), previous


def event_trigger(name: str, low: int = 1, high: int = 1) -> EventTrigger:
    """An event trigger for ``at.events``: the ``low``-th to ``high``-th ``name`` event."""
    return EventTrigger(event=name, count=Span(min=low, max=high))
