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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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
