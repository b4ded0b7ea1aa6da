"""Deliberately broken ``hot_spare`` trainers, each caught by the check that guards against it.

The shipped scenario runs unchanged through the harness (in process, as the pytest plugin runs
it); only the faulted run's trainer gets an extra flag that breaks it. The passing side of
each pair is the shipped scenario itself, with its timeline evidence
(tests/test_shipped_scenarios.py), and both share one cached fault-free run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, on_two_ranks, read_events

from harness import runner
from harness.records import RunResult
from harness.spec import LoadedScenario, load_scenario, parse_scenario

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_broken(
    scenario: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, cache: Path, *flags: str,
    two_ranks: bool = False,
) -> RunResult:
    """Run ``scenario`` with ``flags`` added to the trainer's command line in the faulted run
    (never in the fault-free baseline, which stays the shipped scenario's). ``two_ranks``
    runs it on a 2-rank data-parallel world instead (the bug is the same, the start-up
    half the cost)."""
    execute = runner.execute

    def broken(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("phase", "run") == "run":
            kwargs["extra_args"] = (*kwargs.get("extra_args", ()), *flags)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", broken)
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    loaded = load_scenario(scenario)
    if two_ranks:
        text = on_two_ranks(loaded.text)
        loaded = LoadedScenario(parse_scenario(text, str(scenario)), scenario, text)
    return runner.run_scenario(loaded, run_dir=run_dir)


def test_spare_loading_a_stale_state_fails_params_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The replacement loads its state one step old. Fingerprints are off, so the parameter
    comparison alone must catch it (with them on, the replicas' disagreement is detected
    too, and the run converges on one replica's state)."""
    scenario = ROOT / "scenarios" / "training" / "kill_rank_hot_spare.yaml"
    result = run_broken(scenario, tmp_path / "run", monkeypatch, shared_cache,
                        "--debug-stale-snapshot", "--fingerprint-every=0", two_ranks=True)
    checks = {c.name: c for c in result.checks}
    # The recovery itself looked perfect: fast, complete, nothing recomputed.
    for name in ("completes", "faults_injected", "time_to_detect", "lost_steps"):
        assert checks[name].passed, checks[name].message
    assert not checks["params_match"].passed
    assert "parameters differ" in checks["params_match"].message, checks["params_match"].message
    assert not result.passed


def test_flipped_weight_goes_unnoticed_without_fingerprints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    """The same bit flip as the shipped scenario, against a trainer that never compares
    fingerprints: the flip is real (the parameters end elsewhere) and nothing notices."""
    scenario = ROOT / "scenarios" / "faults" / "memory_bitflip_param_fingerprint.yaml"
    result = run_broken(scenario, tmp_path / "run", monkeypatch, shared_cache,
                        "--fingerprint-every=0")
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed, checks["completes"].message
    assert checks["faults_injected"].passed, checks["faults_injected"].message
    assert not checks["time_to_detect"].passed
    assert not checks["params_match"].passed
    assert "parameters differ" in checks["params_match"].message, checks["params_match"].message
    causes = [e["cause"] for e in read_events(tmp_path / "run" / "events.jsonl",
                                                "failure_detected")]
    assert "fingerprint_mismatch" not in causes, causes
