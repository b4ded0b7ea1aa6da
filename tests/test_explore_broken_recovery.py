"""Explore finds the broken votes and snapshot restores of tests/test_trainer_broken_recovery.py.

Each broken variant (tests/broken/sitecustomize.py, switched on through the scenario's
``system.env`` as ``AFTERSHOCK_INJECT_TEST_BUG``, which the fault-free twin goes without)
shows only under a fault every rank sees, or a shard lost between snapshots or in the middle
of a snapshot round. The spaces below draw those dimensions the way the shipped
scenarios/explore/hot_spare.yaml does (`all` among the targets; snapshots sparser than steps,
the drawn step setting the fault's phase relative to the last one; the `optimizer` fault
point, inside a snapshot step; or the snapshot interval itself drawn per run, `explore.system`,
as the shipped hot_spare and elastic spaces do), and a search of at most 40 runs must find
each variant.

``make test-explore`` runs this file with tests/test_explore_broken.py (minutes: every run
launches the reference trainer under torchrun).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import ROOT, read_events

from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search.explore import Exploration, Finding, explore

pytest.importorskip("torch")

# Each search costs up to 40 trainer runs: the one that finds its bug in a few runs is in
# `make test-explore` (CI); the three that take about ten minutes each are in
# `make test-explore-long`, outside CI's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

BUDGET = 40  # runs, everything included: search, shrinking, minimizing, confirming

HOT_SPARE = """\
name: {name}
system:
  reference: trainer
  world: {{replicas: 2, shards: 2}}
  backend: gloo
  recovery: hot_spare
  spares: 2
  snapshot_every: {snapshot_every}
  steps: 40
  collective_timeout: 3s
  step_sleep: 10ms
  env: {{PYTHONPATH: "{path}", AFTERSHOCK_INJECT_TEST_BUG: {bug}}}
expect:
  completes: true
  params_match: fault_free
  lost_steps: {{max: {lost}}}
explore:
{space}
"""


def scenario(tmp_path: Path, *, name: str, bug: str, snapshot_every: int, lost: int,
             space: str) -> LoadedScenario:
    path = tmp_path / f"{name}.yaml"
    python_path = os.pathsep.join(str(p) for p in (ROOT / "tests" / "broken", ROOT))
    path.write_text(HOT_SPARE.format(name=name, snapshot_every=snapshot_every, lost=lost,
                                     path=python_path, bug=bug, space=space))
    return load_scenario(path)


def search(base: LoadedScenario, tmp_path: Path) -> Exploration:
    found = explore(base, runs=28, shrink_runs=10, confirm=1, seed=0, database=None,
                    out=tmp_path / "out")
    assert found.runs <= BUDGET, found.runs
    assert found.findings, [(a.schedule, a.verdict, a.reason) for a in found.attempts]
    return found


@pytest.fixture(autouse=True)
def _cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(shared_cache))


@pytest.mark.explore_long
def test_explore_finds_a_vote_whose_digits_overflow_when_every_rank_agrees(
    tmp_path: Path
) -> None:
    """Only a NaN that every rank sees fills the "not finite" digit; a NaN on one rank or
    one shard leaves it below the base and the broken vote reads it right."""
    base = scenario(tmp_path, name="vote-digits", bug="vote_digits_base_world",
                    snapshot_every=1, lost=0,
                    space="  faults: {min: 1, max: 2}\n"
                          "  kinds: [{kind: memory.nan, params: {tensor: ['grad:*']}}]\n"
                          "  targets: [rank, replica, shard, all]\n"
                          "  at: {step: {min: 5, max: 35}, phases: [backward]}")
    found = search(base, tmp_path)
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    assert "lost_steps" in finding.failed_checks, finding
    # In one step, a NaN in some replica of every shard: the average spreads each to its
    # shard's other replica, so every rank raises the flag (the search shrinks `all` to one
    # replica, or one rank of each shard).
    spec = load_scenario(finding.file).spec
    by_step: dict[int | None, set[int]] = {}
    for fault in spec.faults:
        assert fault.target.rank is not None, fault.target
        by_step.setdefault(fault.at.step, set()).add(fault.target.rank % 2)
    assert {0, 1} in by_step.values(), by_step


@pytest.mark.explore
def test_explore_finds_restores_that_pick_the_wrong_snapshot(tmp_path: Path) -> None:
    """Snapshots every 4 steps; a shard's every holder killed at a drawn step, from outside
    (between snapshots) or at the optimizer fault point (inside a step, which at a snapshot
    step interrupts that snapshot round). Survivors that keep their own newer state fail
    wherever the kill is not right after a snapshot."""
    base = scenario(tmp_path, name="survivors-keep", bug="survivors_keep_state",
                    snapshot_every=4, lost=5,
                    space="  faults: {min: 1, max: 1}\n"
                          "  kinds: [process.kill]\n"
                          "  targets: [shard]\n"
                          "  at: {step: {min: 5, max: 35}, phases: [optimizer]}")
    found = search(base, tmp_path)
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    assert "params_match" in finding.failed_checks, finding
    confirm = [a for a in found.attempts if a.stage == "confirm"][-1]
    loaded = read_events(Path(confirm.run_dir) / "events.jsonl", "checkpoint_loaded")
    assert loaded
    assert all(str(e["path"]).startswith("peer-memory snapshot") for e in loaded)


@pytest.mark.explore_long
def test_explore_finds_shards_that_restore_their_own_newest_snapshot(tmp_path: Path) -> None:
    """Shards that load their own newest snapshot fail only when those stand at different
    steps: a shard's holders killed inside a snapshot step (at the optimizer fault point,
    after the vote), while the other shard commits it and sends its snapshot."""
    base = scenario(tmp_path, name="own-newest", bug="own_newest_snapshot",
                    snapshot_every=2, lost=3,
                    space="  faults: {min: 1, max: 1}\n"
                          "  kinds: [process.kill]\n"
                          "  targets: [shard]\n"
                          "  at: {step: {min: 5, max: 35}, phases: [optimizer]}")
    found = search(base, tmp_path)
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    assert "params_match" in finding.failed_checks, finding
    (kill, *others) = load_scenario(finding.file).spec.faults
    assert kill.at.phase == "optimizer", kill
    assert kill.at.step is not None
    assert kill.at.step % 2 == 0, kill  # a snapshot step
    assert all(f.at == kill.at for f in others)


ELASTIC = """\
name: {name}
system:
  reference: trainer
  world: {{replicas: 2, shards: 2}}
  backend: gloo
  recovery: elastic
  steps: 40
  collective_timeout: 3s
  step_sleep: 10ms
  env: {{PYTHONPATH: "{path}", AFTERSHOCK_INJECT_TEST_BUG: {bug}}}
expect:
  completes: true
  params_match: replay
  lost_steps: {{max: 1, snapshot_interval: true}}
explore:
  faults: {{min: 1, max: 1}}
  kinds: [process.kill]
  targets: [shard]
  at: {{step: {{min: 5, max: 35}}}}
  system:
    snapshot_every: [1, 2, 3]
"""


def find_in_elastic(tmp_path: Path, template: str, name: str, bug: str) -> Finding:
    """The one confirmed finding of a short search (5 shrinking runs: the faults shrink in a
    few) of an elastic space written from ``template`` with ``bug`` switched on."""
    path = tmp_path / f"{name}.yaml"
    python_path = os.pathsep.join(str(p) for p in (ROOT / "tests" / "broken", ROOT))
    path.write_text(template.format(name=name, path=python_path, bug=bug))
    found = explore(load_scenario(path), runs=28, shrink_runs=5, confirm=1, seed=0,
                    database=None, out=tmp_path / "out")
    assert found.runs <= BUDGET, found.runs
    assert found.findings, [(a.schedule, a.verdict, a.reason) for a in found.attempts]
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    return finding


@pytest.mark.explore_long
def test_explore_finds_survivors_that_keep_their_state_by_drawing_the_snapshot_interval(
    tmp_path: Path
) -> None:
    """The scenario itself takes a snapshot every step, where survivors that keep their own
    state instead of loading the snapshot hold the snapshot's state anyway when the shard is
    lost between steps (train-kill-shard-hot-spare): only a drawn interval of 2 or 3 shows
    them (a shard lost between two snapshots), and shrinking keeps it. The elastic
    oracle's `lost_steps` follows the interval each run recorded, so the correct restores
    of the same runs pass (tests/test_explore_strategies.py draws the interval alone)."""
    # An interval of 1, the one simpler value, passes at once. Still 6 to 10 minutes on a
    # 2-core machine under load 11 to 20: with the long ones.
    finding = find_in_elastic(tmp_path, ELASTIC, "survivors-keep-elastic",
                              "survivors_keep_state")
    assert "params_match" in finding.failed_checks, finding
    spec = load_scenario(finding.file).spec
    assert spec.system.snapshot_every in (2, 3), spec.system  # type: ignore[union-attr]
    assert finding.schedule.startswith(f"[snapshot_every={spec.system.snapshot_every}]"), \
        finding.schedule  # type: ignore[union-attr]


@pytest.mark.explore_long
def test_explore_finds_a_restore_further_back_than_the_interval_leaves_unsaved(
    tmp_path: Path
) -> None:
    """Every holder of a shard lost: the variant goes back to the oldest snapshot every shard
    still has, not the newest. Its state is consistent (the replay agrees), so only the
    lost-step bound that follows the drawn interval shows it."""
    finding = find_in_elastic(tmp_path, ELASTIC, "older-common-elastic",
                              "older_common_snapshot")
    assert "lost_steps" in finding.failed_checks, finding


ELASTIC_REJOIN = """\
name: {name}
system:
  reference: trainer
  world: {{replicas: 2, shards: 2}}
  backend: gloo
  recovery: elastic
  steps: 24
  collective_timeout: 3s
  step_sleep: 300ms
  env: {{PYTHONPATH: "{path}", AFTERSHOCK_INJECT_TEST_BUG: {bug}}}
faults:
  - {{kind: process.kill, target: {{rank: 1}}, at: {{step: 8}}}}
expect:
  completes: true
  params_match: replay
  time_to_recover: {{max: 4s}}
  lost_steps: {{max: 1}}
explore:
  faults: {{min: 1, max: 1}}
  kinds: [process.kill]
  targets: [rank, replica, random]
  at: {{step: {{min: 3, max: 16}}}}
"""


@pytest.mark.explore_long
def test_explore_finds_a_vote_that_needs_a_dissenter_to_switch(tmp_path: Path) -> None:
    """Every member raises "a newer plan is waiting" in the same vote when the rejoin plan
    comes out between steps (300 ms each, as in
    scenarios/training/rejoin_every_rank_votes_to_switch_elastic.yaml): the variant that reads
    the flag as `0 < count < world` never switches, and the rejoin never comes."""
    find_in_elastic(tmp_path, ELASTIC_REJOIN, "switch-unanimous-elastic",
                    "switch_unless_unanimous")
