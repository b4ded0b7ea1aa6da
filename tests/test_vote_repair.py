"""The `restart` loop's vote, sent before the gradient all_reduce (reference_impl/trainer.py:
`vote`, `repair`), where it cannot repair a rank from a peer: before a checkpoint it votes
late, as the vote always did, and a shard that lost every replica's average restarts from
the newest checkpoint. The common case, one rank's average corrupted, is the shipped
`scenarios/faults/collective_corrupt_nan.yaml` (tests/test_shipped_scenarios.py checks its
repair)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _broken import checks, run_broken
from _helpers import ROOT, read_events

pytest.importorskip("torch")

# Whole scenarios on 2 x 2 worlds (15-30 s each): with the scenario sweep.
pytestmark = [pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(300)]

SCENARIO = ROOT / "scenarios" / "faults" / "collective_corrupt_nan.yaml"


def _variant(old: str, new: str) -> str:
    text = SCENARIO.read_text()
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _commits(events: Path) -> dict[tuple[int, int], list[float]]:
    found: dict[tuple[int, int], list[float]] = {}
    for e in read_events(events, "step"):
        found.setdefault((e["rank"], e["step"]), []).append(e["t"])
    return found


def test_before_a_checkpoint_the_vote_is_late_and_every_rank_skips_the_corrupted_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Step 20 is a checkpoint step (every 10): every rank saves its own state there, so no
    rank may fall behind at it. The vote is sent after the average, rank 1's corrupted
    average reaches every rank, and every rank computes step 20 again: nobody is repaired."""
    text = _variant("at: {step: 25, phase: backward}", "at: {step: 20, phase: backward}")
    result = run_broken(SCENARIO, tmp_path / "run", monkeypatch, shared_cache, text=text)
    assert result.passed, [(c.name, c.message) for c in result.checks if not c.passed]
    events = tmp_path / "run" / "events.jsonl"
    detected = [(e["rank"], e["cause"], e["step"]) for e in read_events(events, "failure_detected")]
    assert detected == [(1, "non_finite", 20)]
    assert read_events(events, "state_repaired") == []
    commits = _commits(events)
    assert all(len(times) == 1 for times in commits.values()), commits
    assert max(commits[(r, 20)][0] for r in range(4)) < min(commits[(r, 21)][0] for r in range(4))


def test_a_shard_whose_every_average_is_corrupted_restarts_from_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """Ranks 1 and 3, both replicas of shard 1, lose their average of step 25; shard 0
    applies it. No rank holds shard 1 after step 25, so at the next step every rank raises
    NonFiniteFailure and torchrun restarts the world from step 20's checkpoint: the run ends
    with the fault-free parameters, having computed steps 21-25 twice (what this design
    costs for two corruptions of one shard in one step; a vote after the average skipped
    the step instead, bench/results/trainer-internals-2026-12.md)."""
    text = _variant("expect:\n", "  - kind: collective.corrupt\n    target: {rank: 3}\n"
                    "    at: {step: 25, phase: backward}\n    op: all_reduce\n    mode: nan\n"
                    "    index: 0\nexpect:\n")
    result = run_broken(SCENARIO, tmp_path / "run", monkeypatch, shared_cache, text=text)
    found = checks(result)
    for name in ("completes", "params_match", "single_history"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed, found["lost_steps"].message
    events = tmp_path / "run" / "events.jsonl"
    detected = read_events(events, "failure_detected")
    assert sorted((e["rank"], e["step"]) for e in detected if "step" in e) == [(1, 25), (3, 25)]
    gave_up = [e for e in detected if "no peer holds the step" in e.get("error", "")]
    assert gave_up, detected  # the first rank to raise reports it (it ends the others)
    assert {e["cause"] for e in gave_up} == {"non_finite"}
    assert read_events(events, "state_repaired") == []
    assert [e["step"] for e in read_events(events, "checkpoint_loaded")][:1] == [20]
