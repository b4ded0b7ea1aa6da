"""The server's explore space draws the router's durability path (issue 47, class 1): no
processes.

scenarios/explore/server.yaml draws crashes of the router at each point of its durability
path (`at: {step: N, phase: P}`, aimed at `{role: router}`), a power loss under its journal
(`storage.lose_unsynced` on output/journal, the router dying with it) and clients that
resubmit or only resume (`load.resubmit`, a field of the system's `load` block). Every drawn
schedule is one that can land: a router point only on the router, a server's step trigger
only at a point, one power loss at most. A space that asks for what the system does not have
is refused at its place.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _helpers import ROOT
from hypothesis import HealthCheck, find, given, settings

from aftershock.harness.errors import SpecError
from aftershock.harness.scenario._space import ROUTER_PHASES, option_value, with_options
from aftershock.harness.scenario.load import load_scenario, parse_scenario, to_yaml
from aftershock.harness.scenario.spec import Scenario, ServerSystem, in_process
from aftershock.harness.search.explore import describe
from aftershock.harness.search.strategies import scenarios, space_of

pytestmark = pytest.mark.timeout(120)

SPACE = ROOT / "scenarios" / "explore" / "server.yaml"
MANY = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SERVER = """\
name: s
system:
  reference: server
  workers: 3
  load: {requests: 20, retries: 50}
expect:
  no_lost_requests: true
"""

TRAINER = """\
name: t
system:
  reference: trainer
  world: {replicas: 2, shards: 1}
  recovery: restart
  steps: 20
expect:
  completes: true
"""


def test_the_server_space_draws_router_crashes_power_losses_and_resubmitting_clients() -> None:
    base = load_scenario(SPACE).spec
    space = space_of(base)
    assert space.steps is not None
    points: set[str] = set()
    resubmit: set[bool] = set()
    power_losses = 0

    @MANY
    @given(scenarios(base))
    def check(spec: Scenario) -> None:
        nonlocal power_losses
        assert isinstance(spec.system, ServerSystem)
        resubmit.add(spec.system.load.resubmit)
        # The rest of the load stays the base's: only `resubmit` is drawn.
        assert spec.system.load.model_copy(update={"resubmit": True}) == \
            base.system.load.model_copy(update={"resubmit": True})  # type: ignore[union-attr]
        losses = [f for f in spec.faults if str(f.kind) == "storage.lose_unsynced"]
        assert len(losses) <= 1  # one lazy filesystem per scenario
        for fault in losses:
            power_losses += 1
            # The router writes the journal and dies with the power.
            assert fault.target.role == "router"
            assert fault.dir == "output/journal"  # type: ignore[attr-defined]
        for fault in spec.faults:
            at = fault.at
            if at.phase in ROUTER_PHASES:
                points.add(at.phase)
                assert fault.target.role == "router", fault
                assert in_process(fault)  # the router's own probe kills it at the point
                assert space.steps[0] <= (at.step or 0) <= space.steps[1]
            else:
                # A server commits no steps: a step trigger is a router point, or none.
                assert (at.step, at.phase) == (None, None), fault
        assert parse_scenario(to_yaml(spec)) == spec

    check()
    assert points == set(ROUTER_PHASES)
    assert resubmit == {True, False}
    assert power_losses > 0


def test_a_block_field_is_an_option_and_written_into_the_scenario() -> None:
    base = load_scenario(SPACE).spec
    system = with_options(base.system, {"load.resubmit": False})
    assert option_value(system, "load.resubmit") is False
    assert isinstance(system, ServerSystem)
    assert (system.load.requests, system.load.retries) == (40, 200)  # kept
    assert "resubmit: false" in to_yaml(base.model_copy(update={"system": system}))
    assert describe([], {"load.resubmit": False}) == "[load.resubmit=False] no faults"


@pytest.mark.parametrize(("predicate", "expected"), [
    (lambda s: any(f.at.phase == "journal_synced" for f in s.faults),
     ("[load.resubmit=True] ", "process.kill role router @ step 5 journal_synced")),
    (lambda s: any(str(f.kind) == "storage.lose_unsynced" for f in s.faults)
     and not s.system.load.resubmit,
     ("[load.resubmit=False] ", "storage.lose_unsynced(dir=output/journal) @ event first_token")),
])
def test_a_router_failure_shrinks_to_its_simplest_point(predicate: object,
                                                       expected: tuple[str, str]) -> None:
    """The fault that matters shrinks to its simplest form: the first point, the first step,
    the first occurrence, and the first value of each option that keeps it. (Hypothesis may
    leave a second, simplest fault beside it; explore's minimizing tries each fault away.)"""
    base = load_scenario(SPACE).spec
    found = find(scenarios(base), predicate,  # type: ignore[arg-type]
                 settings=settings(database=None, max_examples=2000), random=random.Random(0))
    line = describe(found.faults,
                    {"load.resubmit": found.system.load.resubmit})  # type: ignore[union-attr]
    options, fault = expected
    assert line.startswith(options), line
    assert fault in line.removeprefix(options).split("; "), line


def problems(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_scenario(path)
    return [p.removeprefix(f"{path}:") for p in caught.value.problems]


@pytest.mark.parametrize(("base", "block", "expected"), [
    (TRAINER, "explore:\n  targets: [rank, router]\n",
     "explore.targets.1: 'router': only the reference server has a router"),
    (TRAINER, "explore:\n  at: {step: {min: 1, max: 9}, phases: [journal_synced]}\n",
     "explore.at.phases: journal_synced: only the reference server's router has these"),
    (SERVER, "explore:\n  kinds: [process.kill]\n  targets: [worker, router]\n"
     "  at: {step: {min: 1, max: 9}}\n",
     "explore.at.step: a server counts steps only at its router's fault points"),
    (SERVER, "explore:\n  kinds: [process.kill]\n  targets: [worker]\n"
     "  at: {step: {min: 1, max: 9}, phases: [token_sent]}\n",
     "explore.at.step: a server counts steps only at its router's fault points"),
    (SERVER, "explore:\n  kinds:\n    - {kind: storage.lose_unsynced, params: {dir: [output/"
     "journal]}}\n  targets: [worker]\n",
     "explore.kinds.0: storage.lose_unsynced on a server takes its router down"),
    (SERVER, "explore:\n  system: {load.resubmit: [true, maybe]}\n",
     "explore.system.load.resubmit.1: 'maybe': "),
    (SERVER, "explore:\n  system: {load.resubmt: [true]}\n",
     "explore.system.load.resubmt: 'load.resubmt': not an option of this system"),
])
def test_a_durability_space_that_does_not_fit_is_refused_at_its_place(
        base: str, block: str, expected: str, tmp_path: Path) -> None:
    found = problems(base + block, tmp_path)
    assert len(found) == 1, found  # one mistake, one problem
    assert expected in found[0], found
    line, col = found[0].split(":")[:2]
    assert (int(line) > 8, int(col) > 0) == (True, True)  # under `explore:`
