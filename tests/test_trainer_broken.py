"""Deliberately broken reference trainers against the shipped scenarios that exist for them:
each scenario's checks must fail, and fail on the defect, not on a timeout.

The broken variants are in tests/broken/sitecustomize.py (only the faulted run imports them;
the fault-free baseline is the shipped scenario's, cached per session). The passing side of
each pair is the shipped scenario itself, run with its timeline evidence in
tests/test_shipped_scenarios.py. Runs stay on 2-rank worlds where the defect does not depend on
the layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _broken import checks, run_broken
from _helpers import ROOT, read_events

pytest.importorskip("torch")

# Whole shipped scenarios, one per broken trainer (8-22 s each, 80 s in all): with the scenario
# sweep (`make test-scenarios`, its own CI step), like the node scenarios' broken trainers.
pytestmark = [pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(300)]

FAULTS = ROOT / "scenarios" / "faults"
TRAINING = ROOT / "scenarios" / "training"


def test_torn_save_catches_a_save_that_drops_the_previous_checkpoint_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Rank 0 deletes the older checkpoints before the new one commits ("make room first").
    The kill between the shard writes and the commit then leaves nothing committed: the
    restarted world starts from step 0. Training is deterministic, so the parameters still
    match; what the torn save costs is every step, and lost_steps says so. (The scenario's
    old trigger, a kill after checkpoint_started that landed after the commit, passed
    this trainer.)"""
    result = run_broken(FAULTS / "storage_crash_during_save.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="prune_before_commit")
    found = checks(result)
    for name in ("completes", "faults_injected", "params_match", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed
    assert found["lost_steps"].observed == 30, found["lost_steps"].message
    events = tmp_path / "run" / "events.jsonl"
    assert not read_events(events, "checkpoint_loaded"), "something was left to resume from"
    assert not result.passed


def _last_before_the_break(events: Path) -> dict[int, int]:
    """Rank -> the last step it committed before the world broke (the first failure other
    than the NaN itself)."""
    broke = min(e["t"] for e in read_events(events, "failure_detected")
                if e["cause"] != "non_finite")
    last: dict[int, int] = {}
    for e in read_events(events, "step"):
        if e["t"] < broke:
            last[e["rank"]] = max(last.get(e["rank"], 0), e["step"])
    return last


def test_nan_in_one_shard_catches_ranks_that_vote_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Each rank decides alone whether its gradients are finite. The NaN in rank 1's gradient
    spreads to rank 3 (same shard) and nowhere else, so shard 0 applies step 25 and shard 1
    computes it again: the world falls out of step, its collectives stop matching, and a
    restart from the last checkpoint recomputes committed steps. On 2 replicas x 1 shard
    the average spreads the NaN to every rank and this trainer passes; the layout is the
    point, so this runs on 2 x 2."""
    result = run_broken(FAULTS / "memory_nan_gradient.yaml", tmp_path / "run", monkeypatch,
                        shared_cache, bug="vote_alone")
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed, found["lost_steps"].message
    events = tmp_path / "run" / "events.jsonl"
    nan = [e for e in read_events(events, "failure_detected") if e["cause"] == "non_finite"]
    assert {(e["rank"], e["step"]) for e in nan} == {(1, 25), (3, 25)}
    # The defect itself: shard 0 applied step 25 and shard 1 computed it again, so shard 0
    # stayed one step ahead until their collectives stopped matching.
    last = _last_before_the_break(events)
    assert last[0] == last[2] == last[1] + 1 == last[3] + 1, last
    assert not result.passed


def test_corrupt_gradient_all_reduce_catches_ranks_that_vote_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The corruption lands after the average, on rank 1 alone, so the vote matters on any
    layout: on two ranks, rank 0 applies step 25 and rank 1 computes it again."""
    result = run_broken(FAULTS / "collective_corrupt_nan.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="vote_alone", two_ranks=True)
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed, found["lost_steps"].message
    events = tmp_path / "run" / "events.jsonl"
    nan = [e for e in read_events(events, "failure_detected") if e["cause"] == "non_finite"]
    assert {(e["rank"], e["step"]) for e in nan} == {(1, 25)}
    last = _last_before_the_break(events)
    assert last[0] == last[1] + 1, last
    assert not result.passed


def test_lost_shard_catches_snapshots_without_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The controller's snapshots bring back the parameters only; AdamW's moments and step
    count start over. The recovery looks perfect (fast, at most the steps since the snapshot
    recomputed); only the parameters tell. On two ranks the scenario's shard 0 is the whole
    world: every rank restores from the snapshots, the same path. (Before the fix in
    resilient.sync, two fresh spares took their seeded initial state for step 0 there and
    the run silently started over: lost_steps 30, no snapshot loaded.)"""
    result = run_broken(TRAINING / "kill_shard_hot_spare.yaml", tmp_path / "run", monkeypatch,
                        shared_cache, bug="snapshot_without_optimizer", two_ranks=True)
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "time_to_recover",
                 "lost_steps"):
        assert found[name].passed, found[name].message
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    loaded = read_events(tmp_path / "run" / "events.jsonl", "checkpoint_loaded")
    assert {e["path"].split(" of ")[0] for e in loaded} == {"peer-memory snapshot"}
    assert not result.passed


def test_kill_during_elastic_recovery_catches_a_lineage_moved_by_every_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """A completed sync moves a member's lineage even when it changed nothing. The second
    kill interrupts the rejoin after rank 2's sync completed and rank 3's failed; the next
    generation then trusts rank 2 alone, shard 1 counts as lost and, with snapshots off (a
    setting of the trainer), the job ends itself and torchrun starts it over. With the
    snapshots on (the shipped scenario) the same defect hides behind a snapshot restore,
    which that scenario's evidence rejects. Layout matters (a shard's only holder in the
    surviving replica), so this runs on 2 x 2."""
    result = run_broken(TRAINING / "kill_during_recovery_elastic.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="lineage_per_sync",
                        extra_args=("--snapshot-every=0",))
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed
    assert found["lost_steps"].observed >= 25, found["lost_steps"].message
    logs = "".join(p.read_text(errors="replace")
                   for p in (tmp_path / "run" / "logs").rglob("*.log"))
    assert "no live replica and no complete snapshot for some shard" in logs
    assert not result.passed


def test_kill_during_restart_recovery_catches_a_checkpoint_blamed_for_a_dead_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """When the ranks fail to agree on the checkpoint to resume from, rank 0 deletes it so
    that the next restart does not try it again. The second kill lands exactly there, so a
    good checkpoint (step 20) is thrown away for a dead peer and the third world goes back
    to step 10. A single kill never fails the agreement and passes this trainer."""
    result = run_broken(TRAINING / "kill_during_recovery_restart.yaml", tmp_path / "run",
                        monkeypatch, shared_cache, bug="quarantine_on_failed_agreement",
                        two_ranks=True)
    found = checks(result)
    for name in ("completes", "faults_injected", "params_match", "time_to_detect"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed, found["lost_steps"].message
    loaded = read_events(tmp_path / "run" / "events.jsonl", "checkpoint_loaded")
    assert {e["step"] for e in loaded} == {10}
    assert not result.passed
