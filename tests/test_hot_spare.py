"""Deliberately broken ``hot_spare`` trainers, each caught by the check that guards against it.

The shipped scenario runs unchanged through the harness (in process, as the pytest plugin runs
it); only the faulted run's trainer is broken (tests/broken/sitecustomize.py, through
tests/_broken.py) or configured without a defence. The passing side of each pair is the
shipped scenario itself, with its timeline evidence (tests/test_shipped_scenarios.py), and
both share one cached fault-free run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _broken import checks, run_broken
from _helpers import ROOT, read_events

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_spare_loading_a_stale_state_fails_params_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The replacement loads its state one step old. Fingerprints are off, so the parameter
    comparison alone must catch it (with them on, the replicas' disagreement is detected
    too, and the run converges on one replica's state)."""
    scenario = ROOT / "scenarios" / "training" / "kill_rank_hot_spare.yaml"
    result = run_broken(scenario, tmp_path / "run", monkeypatch, shared_cache,
                        bug="stale_snapshot", extra_args=("--fingerprint-every=0",),
                        two_ranks=True)
    found = checks(result)
    # The recovery itself looked perfect: fast, complete, nothing recomputed.
    for name in ("completes", "faults_injected", "time_to_detect", "lost_steps"):
        assert found[name].passed, found[name].message
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    assert not result.passed


def test_vote_sent_before_the_average_recomputes_a_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The loop sends its vote before the gradient all_reduce, as the ``restart`` loop does
    (it hides the vote's wait). Rank 1's all_reduce raises after its flag went out: shard 0
    commits step 25, shard 1 never averaged it, and the regrouped world has no member of
    shard 1 holding it, so every member falls back to the snapshots and computes step 25
    again. Parameters still end right (the step is deterministic); only `lost_steps` sees
    that a committed step was done twice."""
    scenario = ROOT / "scenarios" / "training" / "collective_error_one_shard_hot_spare.yaml"
    result = run_broken(scenario, tmp_path / "run", monkeypatch, shared_cache,
                        bug="vote_before_average")
    found = checks(result)
    for name in ("completes", "faults_injected", "time_to_detect", "params_match"):
        assert found[name].passed, found[name].message
    assert not found["lost_steps"].passed
    # Every member loaded the same snapshot, from before step 25 (24 unless the lazy sender
    # skipped it), and every step after it up to 25 was committed twice.
    resumed = read_events(tmp_path / "run" / "events.jsonl", "checkpoint_loaded")
    (snapshot,) = {e["step"] for e in resumed}
    assert snapshot < 25, resumed
    assert found["lost_steps"].observed == 25 - snapshot, found["lost_steps"]
    assert not result.passed


def test_flipped_weight_goes_unnoticed_without_fingerprints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The same bit flip as the shipped scenario, against a trainer that never compares
    fingerprints: the flip is real (the parameters end elsewhere) and nothing notices."""
    scenario = ROOT / "scenarios" / "faults" / "memory_bitflip_param_fingerprint.yaml"
    result = run_broken(scenario, tmp_path / "run", monkeypatch, shared_cache,
                        extra_args=("--fingerprint-every=0",))
    found = checks(result)
    assert found["completes"].passed, found["completes"].message
    assert found["faults_injected"].passed, found["faults_injected"].message
    assert not found["time_to_detect"].passed
    assert not found["params_match"].passed
    assert "parameters differ" in found["params_match"].message, found["params_match"].message
    causes = [e["cause"] for e in read_events(tmp_path / "run" / "events.jsonl",
                                                "failure_detected")]
    assert "fingerprint_mismatch" not in causes, causes
