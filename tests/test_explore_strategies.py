"""The search space and the hypothesis strategies of `aftershock explore`: no processes.

Every generated schedule is a valid scenario that round-trips through YAML and stays inside
the declared space; the same seed gives the same schedules; shrinking goes toward fewer,
earlier, simpler faults; an `explore:` block that does not fit its system is refused at
file:line:col.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from random import Random
from typing import Any

import pytest
from _helpers import ROOT
from hypothesis import HealthCheck, find, given, seed, settings
from hypothesis import strategies as st

from aftershock.harness.errors import SpecError
from aftershock.harness.scenario._space import END_PHASES, Space, option_value, resolve
from aftershock.harness.scenario.load import json_schema, load_scenario, parse_scenario, to_yaml
from aftershock.harness.scenario.spec import Scenario, ServerSystem, TrainerSystem, in_process
from aftershock.harness.search.explore import describe
from aftershock.harness.search.strategies import fault_schedules, scenarios, schedules_in, space_of

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

SHIPPED = sorted((ROOT / "scenarios").rglob("*.yaml"))
EXPLORE = [p for p in SHIPPED if load_scenario(p).spec.explore is not None]

TRAINER = """\
name: t
system:
  reference: trainer
  world: {replicas: 2, shards: 2}
  recovery: RECOVERY
  spares: 1
  steps: 60
expect:
  completes: true
"""

SERVER = """\
name: s
system:
  reference: server
  workers: 3
expect:
  no_lost_requests: true
"""

COMMAND = """\
name: c
system:
  command: [python, job.py]
  world: 2
expect:
  completes: true
"""


def bases() -> list[Scenario]:
    """Every kind of system, with the default space (an empty `explore:` block), and every
    shipped explore scenario."""
    found = [parse_scenario(TRAINER.replace("RECOVERY", r) + "explore: {}\n")
             for r in ("restart", "hot_spare", "elastic")]
    found += [parse_scenario(SERVER + "explore: {}\n"), parse_scenario(COMMAND + "explore: {}\n")]
    return found + [load_scenario(p).spec for p in EXPLORE]


def inside(space: Space, spec: Scenario) -> None:
    """Every fault of ``spec`` is one the space allows, and so is every system option drawn."""
    for option in space.options:
        value = option_value(spec.system, option.name)
        if option.choices:
            assert value in option.choices, (option, value)
        else:
            number = value.total_seconds() * 1000 if option.unit == "ms" else value
            assert option.low <= number <= option.high, (option, value)
    kinds = {k.kind: k for k in space.kinds}
    ranks = space.layout.ranks
    for fault in spec.faults:
        kind = kinds[str(fault.kind)]  # a declared kind
        for param in kind.params:
            value = getattr(fault, param.name)
            if param.choices:
                assert value in param.choices
            else:
                number = value.total_seconds() * 1000 if param.unit == "ms" else value
                assert param.low <= number <= param.high
        target = fault.target
        if in_process(fault):
            # The probe's rank filter names one rank or every rank: never a set or a role
            # (but the server's router, whose durability path has fault points).
            assert (target.replica, target.shard) == (None, None)
            assert target.role in (None, "router"), target
        if target.rank is not None or target.worker is not None:
            assert ranks is not None
            assert 0 <= (target.index or 0) < ranks
        at = fault.at
        if at.step is not None:
            assert space.steps is not None
            if at.phase in END_PHASES:  # after the last step: only there
                assert at.step == space.last_step
            else:
                assert space.steps[0] <= at.step <= space.steps[1]
            assert at.phase is None or (at.phase in space.phases and kind.phased)
        elif at.event is not None:
            (choice,) = [e for e in space.events if e.event == at.event]
            assert choice.count[0] <= at.count <= choice.count[1]
        elif at.file is not None:
            (choice,) = [f for f in space.files if f.file == at.file]
            assert at.when == choice.when
            assert choice.count[0] <= at.count <= choice.count[1]
        elif at.time is not None:
            assert space.time_ms is not None
            assert space.time_ms[0] <= at.time.total_seconds() * 1000 <= space.time_ms[1]


@pytest.mark.parametrize("base", bases(), ids=lambda s: f"{s.name}-{type(s.system).__name__}")
def test_every_generated_schedule_is_a_valid_scenario_inside_its_space(base: Scenario) -> None:
    space = space_of(base)

    @FAST
    @given(scenarios(base))
    def check(spec: Scenario) -> None:
        assert spec.explore is None
        assert spec.faults
        text = to_yaml(spec)
        # What a found failure is written as: it loads, and it is the same scenario.
        assert parse_scenario(text) == spec
        inside(space, spec)
        assert space.faults[0] <= len(spec.faults)

    check()


def test_shipped_scenarios_round_trip_through_yaml() -> None:
    for path in SHIPPED:
        spec = load_scenario(path).spec
        assert parse_scenario(to_yaml(spec), str(path)) == spec, path


def draws(strategy: st.SearchStrategy[Any], at: int, n: int = 25) -> list[str]:
    found: list[str] = []

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @seed(at)
    @given(strategy)
    def collect(schedule: Any) -> None:
        found.append(describe(schedule))

    collect()
    return found


def test_generation_is_deterministic_by_seed() -> None:
    system = parse_scenario(TRAINER.replace("RECOVERY", "restart")).system
    strategy = fault_schedules(system, max_faults=3)
    first = draws(strategy, 7)
    assert draws(fault_schedules(system, max_faults=3), 7) == first
    assert draws(strategy, 8) != first
    assert len(set(first)) > 10  # and they are not all alike


def test_shrinking_goes_to_fewer_earlier_simpler_faults() -> None:
    """hypothesis.find is the shrinker explore uses: asked for two faults of which one is a
    freeze, it ends, whatever the seed, at two faults on rank 0 at the first step allowed,
    the freeze as short as allowed and the other fault the first kind declared."""
    system = parse_scenario(TRAINER.replace("RECOVERY", "restart")).system
    kinds = ["process.kill",
             {"kind": "process.freeze", "params": {"duration": {"min": "200ms", "max": "5s"}}}]
    strategy = fault_schedules(system, kinds=kinds, targets=["rank", "random", "replica"],
                               at={"step": {"min": 5, "max": 60}, "events": ["hello"]},
                               max_faults=4)
    for attempt in range(4):
        found = find(strategy,
                     lambda s: len(s) >= 2 and any(f.kind == "process.freeze" for f in s),
                     settings=settings(database=None, max_examples=500), random=Random(attempt))
        assert describe(found) == ("process.kill rank 0 @ step 5; process.freeze(duration=0.2s) "
                                   "rank 0 @ step 5")


def test_group_targets_expand_for_faults_inside_the_target() -> None:
    """The probe's rank filter names one rank or all: a shard or a majority hit by an
    in-process fault (or a kill at a fault point) becomes one fault per rank; from outside,
    a shard stays one target."""
    system = parse_scenario(TRAINER.replace("RECOVERY", "restart")).system
    steps = {"step": {"min": 1, "max": 60}}

    def one(kind: str, family: str, at: dict[str, Any]) -> st.SearchStrategy[list[Any]]:
        return fault_schedules(system, kinds=[kind], targets=[family], at=at, max_faults=1)

    @FAST
    @given(one("collective.error", "shard", steps), one("process.kill", "shard", steps),
           one("process.kill", "majority", steps),
           one("process.kill", "shard", {**steps, "phases": ["save"]}))
    def check(a: list[Any], b: list[Any], c: list[Any], d: list[Any]) -> None:
        assert len(a) == 2
        assert {f.target.rank % 2 for f in a} == {a[0].target.rank % 2}
        assert len(b) == 1
        assert b[0].target.shard in (0, 1)
        assert len(c) == 3
        assert len({f.target.rank for f in c}) == 3  # 3 of 4 ranks
        assert len({f.at for f in c}) == 1  # at the same moment
        if d[0].at.phase is not None:  # a kill inside the target: one per rank
            assert len(d) == 2
            assert all(f.target.rank is not None for f in d)
        else:
            assert len(d) == 1

    check()


def test_spacing_puts_step_triggers_apart() -> None:
    system = parse_scenario(TRAINER.replace("RECOVERY", "restart")).system
    strategy = fault_schedules(system, kinds=["process.kill"], targets=["rank"],
                               at={"step": {"min": 1, "max": 60}}, spacing=(5, 9),
                               min_faults=3, max_faults=3)

    @FAST
    @given(strategy)
    def check(schedule: list[Any]) -> None:
        steps = [f.at.step for f in schedule]
        for before, after in itertools.pairwise(steps):
            assert after == 60 or 5 <= after - before <= 9

    check()


def test_defaults_come_from_the_system() -> None:
    restart = space_of(parse_scenario(TRAINER.replace("RECOVERY", "restart")).system)
    spare = space_of(parse_scenario(TRAINER.replace("RECOVERY", "hot_spare")).system)
    server = space_of(parse_scenario(SERVER).system)
    command = space_of(parse_scenario(COMMAND).system)
    kinds = {k.kind for k in restart.kinds}
    assert {"process.kill", "collective.error", "storage.corrupt"} <= kinds
    assert not any(k.kind.startswith("storage.") for k in spare.kinds)  # no durable state
    assert "spare" in spare.kinds[0].families
    assert "spare" not in restart.kinds[0].families
    assert restart.steps == (1, 60)
    # The shutdown path too (a rank killed after its last step, on its way out).
    assert {"finish", "exit"} <= set(restart.phases)
    assert restart.last_step == 60
    assert {e.event for e in restart.events} >= {"checkpoint_loaded", "failure_detected"}
    assert {f.file for f in restart.files} == {"step_*", "step_*/rank_*.json"}
    assert spare.files == ()  # no checkpoint files to watch
    assert server.kinds[0].families == ("worker", "random", "majority")
    assert server.steps is None
    assert "first_token" in {e.event for e in server.events}
    assert all(not k.in_process for k in command.kinds)  # nothing is known inside a command
    assert command.time_ms is not None


def test_faults_after_the_last_step_are_drawn_at_the_last_step() -> None:
    base = parse_scenario(TRAINER.replace("RECOVERY", "hot_spare"))
    space = space_of(base.system)
    seen: set[tuple[str, int]] = set()

    @settings(max_examples=300, database=None, derandomize=True)
    @given(schedules_in(space))
    def draw(schedule: list[Any]) -> None:
        for fault in schedule:
            if fault.at.phase in END_PHASES:
                seen.add((fault.at.phase, fault.at.step))

    draw()
    assert {phase for phase, _ in seen} == set(END_PHASES)
    assert {step for _, step in seen} == {space.last_step}


def problems(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_scenario(path)
    return [p.removeprefix(f"{path}:") for p in caught.value.problems]


BASE = TRAINER.replace("RECOVERY", "restart")


@pytest.mark.parametrize(("block", "expected"), [
    ("explore:\n  kinds: [process.nap]\n", "11:11: explore.kinds.0: unknown fault kind "
     "'process.nap'"),
    ("explore:\n  kinds:\n    - {kind: process.freeze, params: {lenght: [1s]}}\n",
     "12:47: explore.kinds.0.params.lenght: process.freeze has no parameter 'lenght' "
     "(allowed: duration)"),
    ("explore:\n  kinds:\n    - {kind: process.freeze, params: {duration: [1s, -2s]}}\n",
     "12:54: explore.kinds.0.params.duration.1: '-2s': duration: expected a duration"),
    ("explore:\n  kinds:\n    - {kind: process.kill, params: {signal: {min: 1, max: 2}}}\n",
     "12:45: explore.kinds.0.params.signal: a range needs a number or a duration parameter"),
    ("explore:\n  kinds: [gpu.xid]\n", "11:11: explore.kinds.0.params: gpu.xid needs `code`"),
    ("explore:\n  targets: [rank, worker]\n", "11:19: explore.targets.1: 'worker': only the "
     "reference server has workers"),
    ("explore:\n  targets: [spare]\n", "11:13: explore.targets.0: 'spare': only the reference "
     "trainer with `recovery: hot_spare`"),
    ("explore:\n  at: {step: {min: 1, max: 99}}\n", "11:28: explore.at.step.max: 99 is past "
     "the run's last step (60)"),
    ("explore:\n  at: {events: [hello], phases: [backward]}\n",
     "11:7: explore.at: `phases` needs `step`"),
    ("explore:\n  at: {count: {min: 1, max: 3}}\n",
     "11:7: explore.at: give at least one of `step`, `events`, `files` or `time`"),
    ("explore:\n  spacing: {min: 1, max: 3}\n  at: {events: [hello]}\n",
     "11:12: explore.spacing: spaces step triggers: needs `at.step`"),
    ("explore:\n  at: {files: [../x]}\n", "11:16: explore.at.files.0: "),
    ("explore:\n  at: {events: [failure_detected]}\n", "11:7: explore.at: every trigger "
     "waits for a failure"),
    ("explore:\n  faults: {min: 3, max: 2}\n", "11:11: explore.faults: max (2) is below min (3)"),
    ("explore:\n  system: {snapshot_every: [2, 0]}\n", "11:32: explore.system.snapshot_every.1: "
     "0: Input should be greater than or equal to 1"),
    ("explore:\n  system: {snapshot_evry: [2]}\n", "11:27: explore.system.snapshot_evry: "
     "'snapshot_evry': not an option of this system (drawable: backend, "),
    ("explore:\n  system: {world: [1]}\n", "11:19: explore.system.world: 'world': not a "
     "single value"),
    ("explore:\n  system: {reference: [trainer]}\n", "11:23: explore.system.reference: "
     "'reference': what the system is"),
    ("explore:\n  system: {backend: {min: 1, max: 2}}\n", "11:21: explore.system.backend: a "
     "range needs a number or a duration option"),
    ("explore:\n  system: {snapshot_every: {min: 3, max: 2}}\n", "11:28: "
     "explore.system.snapshot_every: max is below min"),
    ("explore:\n  system: {snapshot_every: []}\n", "11:28: explore.system.snapshot_every: give "
     "at least one value"),
    ("explore:\n  system: {steps: [30]}\n  at: {step: {min: 1, max: 50}}\n", "11:19: "
     "explore.system.steps: 30: fewer steps than the last step a fault may be drawn at (50"),
])
def test_a_space_that_does_not_fit_is_refused_at_its_place(
    block: str, expected: str, tmp_path: Path
) -> None:
    found = problems(BASE + block, tmp_path)
    assert len(found) == 1, found  # one mistake, one problem
    assert found[0].startswith(expected), found


def test_schema_includes_the_explore_block() -> None:
    schema = json_schema()
    assert "explore" in schema["properties"]
    assert "Explore" in schema["$defs"]
    assert "targets" in schema["$defs"]["Explore"]["properties"]


def test_importing_the_harness_does_not_import_hypothesis() -> None:
    code = (
        "import sys, aftershock, aftershock.harness.scenario.spec, "
        "aftershock.harness.search.explore, "
        "aftershock.harness.cli, aftershock.harness.run.runner, "
        "aftershock.harness.scenario._space; "
        "print('hypothesis' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


def test_resolve_names_an_unreachable_kind() -> None:
    system = parse_scenario(SERVER).system
    assert isinstance(system, ServerSystem)
    with pytest.raises(ValueError, match="cannot hit any of the targets"):
        space_of(system, kinds=["collective.error"], targets=["launcher"])


def test_strategy_objects_are_plain_hypothesis_strategies() -> None:
    system = parse_scenario(BASE).system
    assert isinstance(system, TrainerSystem)
    assert isinstance(schedules_in(resolve(system, None)), st.SearchStrategy)


def test_all_ranks_expand_for_faults_inside_the_target() -> None:
    """`all` with an in-process fault is one fault per rank, at one moment (a NaN every rank
    sees, every rank's fingerprint off): certain to reach every rank, which `pick: all`
    armed before every rank said hello is not; from outside it stays `pick: all`."""
    system = parse_scenario(TRAINER.replace("RECOVERY", "hot_spare")).system
    steps = {"step": {"min": 1, "max": 60}, "phases": ["backward"]}
    nan = {"kind": "memory.nan", "params": {"tensor": ["grad:*"]}}

    @FAST
    @given(
        fault_schedules(system, kinds=[nan], targets=["all"], at=steps, max_faults=1),
        fault_schedules(
            system,
            kinds=["process.kill"],
            targets=["all"],
            at={"step": {"min": 1, "max": 60}},
            max_faults=1,
        ),
    )
    def check(inside: list[Any], outside: list[Any]) -> None:
        assert sorted(f.target.rank for f in inside) == [0, 1, 2, 3]
        assert len({f.at for f in inside}) == 1
        if outside[0].at.phase is None:
            assert [f.target.pick for f in outside] == ["all"]

    check()


def test_system_options_are_drawn_per_run_and_written_into_the_scenario() -> None:
    """`explore.system` draws system options with each schedule: every value declared comes
    up, ranges stay inside, the scenario written for a run carries the values it ran with
    (and loads back as the same scenario), and its one-line schedule names them."""
    base = parse_scenario(
        TRAINER.replace("RECOVERY", "elastic")
        + (
            "explore:\n  kinds: [process.kill]\n  at: {step: {min: 5, max: 30}}\n"
            "  system:\n    snapshot_every: [1, 2, 3]\n"
            "    collective_timeout: {min: 1s, max: 3s}\n"
        )
    )
    space = space_of(base)
    seen: set[int] = set()

    @FAST
    @given(scenarios(base))
    def check(spec: Scenario) -> None:
        assert isinstance(spec.system, TrainerSystem)
        inside(space, spec)
        seen.add(spec.system.snapshot_every)
        # What is not drawn stays the base's.
        assert spec.system.model_copy(
            update={
                "snapshot_every": 1,
                "collective_timeout": base.system.collective_timeout,  # type: ignore[union-attr]
            }
        ) == base.system.model_copy(update={"snapshot_every": 1})
        text = to_yaml(spec)
        assert f"snapshot_every: {spec.system.snapshot_every}" in text
        assert parse_scenario(text) == spec

    check()
    assert seen == {1, 2, 3}
    line = describe([], {"snapshot_every": 2, "collective_timeout": timedelta(seconds=1.5)})
    assert line == "[snapshot_every=2, collective_timeout=1.5s] no faults"


def test_system_options_shrink_to_the_first_value_that_still_fails() -> None:
    """A failure that needs snapshots sparser than every step shrinks to the first declared
    interval that has it, and its faults as simple as ever."""
    base = parse_scenario(
        TRAINER.replace("RECOVERY", "hot_spare")
        + (
            "explore:\n  kinds: [process.kill]\n  targets: [rank, shard]\n"
            "  at: {step: {min: 5, max: 30}}\n  system:\n    snapshot_every: [1, 2, 3, 4]\n"
        )
    )
    found = find(
        scenarios(base),
        lambda spec: spec.system.snapshot_every >= 2,  # type: ignore[union-attr]
        settings=settings(database=None, max_examples=500),
    )
    assert found.system.snapshot_every == 2  # type: ignore[union-attr]
    assert describe(found.faults) == "process.kill rank 0 @ step 5"


def test_a_space_without_system_options_draws_the_base_system() -> None:
    base = parse_scenario(TRAINER.replace("RECOVERY", "hot_spare") + "explore: {}\n")

    @FAST
    @given(scenarios(base))
    def check(spec: Scenario) -> None:
        assert spec.system == base.system

    check()
