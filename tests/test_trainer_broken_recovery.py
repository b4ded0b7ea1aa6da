"""Broken votes and snapshot restores that only the all-ranks and sparse-snapshot scenarios see.

Each broken variant (tests/broken/sitecustomize.py) passes every shipped scenario that existed
before these (the vote's flags were only ever raised by some ranks; the snapshots were taken
every step, and every fault landed on a step boundary) and fails the new scenario written for
it, on the defect; the exceptions are said where they are. The passing side of each pair is
the scenario itself, run by the sweep (tests/test_shipped_scenarios.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _broken import checks, run_broken
from _helpers import ROOT, read_events

pytest.importorskip("torch")

# Whole shipped scenarios against broken trainers: with the scenario sweep
# (`make test-scenarios`), like tests/test_trainer_broken.py.
pytestmark = [pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(300)]

TRAINING = ROOT / "scenarios" / "training"


def test_nan_on_every_rank_catches_vote_digits_that_overflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The vote's flags are digits of one sum in base ``world`` instead of ``world + 1``.
    A NaN that every rank sees makes the "not finite" digit ``world``: it carries into
    "fingerprints differed", so the world rolls back to its last agreed fingerprints
    instead of skipping the step, recomputing committed steps, and nobody reports the
    NaN. Where only some ranks raise it (train-nan-gradient-rollback), the digit fits."""
    result = run_broken(TRAINING / "nan_every_rank_hot_spare.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="vote_digits_base_world")
    found = checks(result)
    for name in ("completes", "faults_injected", "params_match"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed, found["lost_steps"].message
    assert not found["time_to_detect"].passed, found["time_to_detect"].message
    events = tmp_path / "run" / "events.jsonl"
    assert not [e for e in read_events(events, "failure_detected")
                if e["cause"] == "non_finite"], "the NaN was read as a NaN"
    rolled = [e for e in read_events(events, "recovery_done")
              if "fingerprints" in str(e.get("why", ""))]
    assert rolled, "the vote was not read as a fingerprint mismatch"
    assert not result.passed



def test_mismatch_on_every_rank_catches_vote_digits_that_overflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The same vote, with "fingerprints differed" raised by every rank (every shard's
    replicas disagree, and a NaN on one shard makes the world retry the step first): its
    digit carries into "a new plan is waiting". Every rank applies the step on the state
    whose fingerprints differed, without the rollback, and switches to a plan that never
    comes: the run stalls until its timeout and reports no final parameters."""
    result = run_broken(TRAINING / "fingerprint_mismatch_every_rank_hot_spare.yaml",
                        tmp_path / "run", monkeypatch, shared_cache,
                        bug="vote_digits_base_world")
    found = checks(result)
    for name in ("faults_injected", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["completes"].passed
    assert not found["params_match"].passed
    events = tmp_path / "run" / "events.jsonl"
    (judged,) = {e["step"] for e in read_events(events, "failure_detected")
                 if e["cause"] == "fingerprint_mismatch"}
    # The defect itself: the step after the judged one was committed by every rank on the
    # disagreeing state, and nobody rolled back.
    committed = {e["rank"] for e in read_events(events, "step") if e["step"] == judged + 1}
    assert committed == {0, 1, 2, 3}, committed
    assert not read_events(events, "recovery_done")
    assert not result.passed

def _loaded(run: Path) -> dict[int, int]:
    """Rank -> the step of the peer-memory snapshot it loaded (the last one, per rank)."""
    return {e["rank"]: e["step"] for e in read_events(run / "events.jsonl", "checkpoint_loaded")
            if str(e["path"]).startswith("peer-memory snapshot")}


def test_shard_lost_between_sparse_snapshots_catches_survivors_that_keep_their_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """When every holder of shard 0 is gone, the survivors of shard 1 keep their own state
    instead of loading the snapshot, while the world resumes at the snapshot's step. With a
    snapshot every step (train-kill-shard-hot-spare) their state is the snapshot's; with a
    snapshot every 10 steps and the kill at step 25, they apply steps 21 to 25 twice."""
    result = run_broken(TRAINING / "kill_shard_between_snapshots_hot_spare.yaml",
                        tmp_path / "run", monkeypatch, shared_cache, bug="survivors_keep_state")
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "lost_steps"):
        assert found[name].passed, found[name].message
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    # Every member resumed at the snapshot of step 20, the only one between the kill and
    # the start; the survivors' state was of step 25.
    assert set(_loaded(tmp_path / "run").values()) == {20}, _loaded(tmp_path / "run")
    assert not result.passed


def test_shard_lost_mid_snapshot_round_catches_shards_that_load_their_own_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Every member resumes at the newest step that every shard has a snapshot of (24), but
    loads its own shard's newest snapshot. Shard 0's holders died inside step 28, before
    its snapshot; shard 1's survivors committed step 28 and sent theirs: shard 1 loads a
    state of step 28 for step 24. With a snapshot every step and the kill between steps
    (train-kill-shard-hot-spare), every shard's newest is the same step."""
    result = run_broken(TRAINING / "kill_shard_mid_snapshot_hot_spare.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="own_newest_snapshot")
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "lost_steps"):
        assert found[name].passed, found[name].message
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    assert set(_loaded(tmp_path / "run").values()) == {24}, _loaded(tmp_path / "run")
    assert not result.passed


ELASTIC_SHARD = TRAINING / "kill_shard_between_snapshots_elastic.yaml"


def test_shard_lost_between_sparse_snapshots_elastic_catches_a_restore_further_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Elastic, a snapshot every 3 steps, every holder of shard 0 killed after step 25: the
    newest complete snapshot is of step 24. A restore that goes back to the older one the
    controller keeps (21) is consistent, and the replay of the membership log agrees with
    it, but it does steps 22 to 25 again: 4, over the 1 + (3 - 1) that the interval the run
    recorded allows. The correct restore does 1 again (the scenario, in the sweep); a fixed
    budget loose enough for every interval would let this one through."""
    result = run_broken(ELASTIC_SHARD, tmp_path / "run", monkeypatch, shared_cache,
                        bug="older_common_snapshot")
    found = checks(result)
    for name in ("completes", "faults_injected", "params_match", "time_to_detect"):
        assert found[name].passed, found[name].message
    check = found["lost_steps"]
    assert not check.passed, check.message
    assert check.expected.startswith("<= 3 (1 restore(s) from snapshots x (1 + interval 3"), \
        check.expected
    assert set(_loaded(tmp_path / "run").values()) == {21}, _loaded(tmp_path / "run")
    assert not result.passed


def test_shard_lost_between_sparse_snapshots_elastic_catches_survivors_that_keep_their_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The same loss against survivors of shard 1 that keep their own state of step 25
    while the world resumes at the snapshot of step 24: they apply step 25 twice."""
    result = run_broken(ELASTIC_SHARD, tmp_path / "run", monkeypatch, shared_cache,
                        bug="survivors_keep_state")
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "lost_steps"):
        assert found[name].passed, found[name].message
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    assert set(_loaded(tmp_path / "run").values()) == {24}, _loaded(tmp_path / "run")
    assert not result.passed


def test_rejoin_where_every_rank_votes_to_switch_catches_a_vote_that_needs_a_dissenter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The vote's "a newer plan is waiting" read as ``0 < count < world``: when every member
    raises it in the same vote (the rejoin's plan came out while they slept after a step),
    nobody switches, then or later. Replica 1 trains to the end in the generation that
    dropped replica 0, the rejoin never happens, and no world of every rank commits a
    step after the fault.

    Unlike the variants above, this one does not pass every scenario shipped before: a
    rejoin's plan usually comes out between two votes, so every member raises the flag in
    train-kill-rank-elastic too, which fails it in most runs (`time_to_recover`) and
    passes it only when the plan lands inside a vote. The scenario here makes the all-ranks
    vote all but certain (a step sleeps 300 ms; the members reach a vote within a few ms of
    each other, tens on a starved machine): a run where the plan still landed while some
    members were on their way to the vote is run once more."""
    scenario = TRAINING / "rejoin_every_rank_votes_to_switch_elastic.yaml"
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        result = run_broken(scenario, run, monkeypatch, shared_cache,
                            bug="switch_unless_unanimous")
        if not result.passed:
            break
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "params_match"):
        assert found[name].passed, found[name].message
    assert not found["time_to_recover"].passed, found["time_to_recover"].message
    events = run / "events.jsonl"
    plans = read_events(events, "membership")
    plan = next(e for e in plans if "rejoin" in str(e["why"]))
    # The defect itself: the rejoin was planned, and every step from a second after it (a
    # correct switch comes at the end of the step under way, 300 ms at most) up to the next
    # plan, if any (the controller giving up on the switch), was committed in the generation
    # before it, by replica 1 alone.
    until = min((e["t"] for e in plans if e["t"] > plan["t"]), default=float("inf"))
    after = [e for e in read_events(events, "step") if plan["t"] + 1 < e["t"] < until]
    assert after
    assert {e["generation"] for e in after} == {plan["generation"] - 1}, after[:4]
    assert {e["rank"] for e in after} == {2, 3}
    assert not result.passed
