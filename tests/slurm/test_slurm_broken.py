"""The Slurm scenarios fail on a broken variant of the recovery they exist for: a trainer that
starts over after Slurm requeues its job (tests/broken/sitecustomize.py,
``fresh_after_requeue``) passes the same scenario without the bug and fails
`checkpoint_durable` with it, and Slurm's own view says the job was requeued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness import api
from aftershock.harness.run.records import RunResult
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.systems.slurm import SlurmSystem

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(500)]
ROOT = Path(__file__).resolve().parents[2]


def test_preemption_catches_a_trainer_that_starts_over_after_the_requeue(
        test_cluster: None, tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / "scenarios" / "slurm" / "preempt_requeue.yaml")
    system = loaded.spec.system
    assert isinstance(system, SlurmSystem)
    env = {**system.env, "PYTHONPATH": f"{ROOT / 'tests' / 'broken'}:{ROOT}",
           "AFTERSHOCK_TEST_BUG": "fresh_after_requeue"}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    result = api.run(LoadedScenario(spec, loaded.path, loaded.text), run_dir=tmp_path / "r",
                     use_cache=False)
    events = [json.loads(line) for line in
              (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("event") == "test_bug"], "the broken code never ran"
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    assert final["Restarts"] == "1"
    failed = {c.name for c in result.failed_checks()}
    assert "checkpoint_durable" in failed, result.checks


def test_a_partition_fails_a_job_whose_torchrun_does_not_restart(
        test_cluster: None, tmp_path: Path) -> None:
    """node_partition.yaml without the recovery it exists for: with no torchrun restarts
    left (`max_restarts: 0`), the ranks' failed collectives end the job; Slurm says so."""
    loaded = load_scenario(ROOT / "scenarios" / "slurm" / "node_partition.yaml")
    system = loaded.spec.system
    assert isinstance(system, SlurmSystem)
    job = system.slurm.model_copy(update={"max_restarts": 0})
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"slurm": job})})
    result = api.run(LoadedScenario(spec, loaded.path, loaded.text), run_dir=tmp_path / "r",
                     use_cache=False)
    events = [json.loads(line) for line in
              (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("event") == "fault_injected"]
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    assert final["JobState"] != "COMPLETED"
    assert final["Restarts"] == "0"
    failed = {c.name for c in result.failed_checks()}
    assert {"completes", "checkpoint_durable"} <= failed, result.checks


def _run_broken(name: str, bug: str, tmp_path: Path) -> tuple[RunResult, list[dict[str, Any]]]:
    """Run scenarios/slurm/<name> with tests/broken/sitecustomize.py's ``bug`` in the job."""
    loaded = load_scenario(ROOT / "scenarios" / "slurm" / name)
    system = loaded.spec.system
    assert isinstance(system, SlurmSystem)
    env = {**system.env, "PYTHONPATH": f"{ROOT / 'tests' / 'broken'}:{ROOT}",
           "AFTERSHOCK_TEST_BUG": bug}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    result = api.run(LoadedScenario(spec, loaded.path, loaded.text), run_dir=tmp_path / "r",
                     use_cache=False)
    events = [json.loads(line) for line in
              (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    return result, events


def test_kill_rank_catches_ranks_that_start_over_after_torchrun_restarts_them(
        test_cluster: None, tmp_path: Path) -> None:
    """kill_rank_restart.yaml exists for torchrun's restart from the shared checkpoint: ranks
    that start from scratch after it lose every step before the kill."""
    result, events = _run_broken("kill_rank_restart.yaml", "fresh_after_restart", tmp_path)
    assert [e for e in events if e.get("bug") == "fresh_after_restart"], "never restarted"
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    assert final["Restarts"] == "0"
    failed = {c.name for c in result.failed_checks()}
    assert {"lost_steps", "checkpoint_durable"} & failed, result.checks


def test_node_down_catches_a_trainer_that_starts_over_after_the_requeue(
        test_cluster: None, tmp_path: Path) -> None:
    """node_down_requeue.yaml exists for the resume after Slurm requeues the job that lost its
    node: a trainer that starts over fails, and Slurm's witness says the resume never was."""
    result, events = _run_broken("node_down_requeue.yaml", "fresh_after_requeue", tmp_path)
    assert [e for e in events if e.get("bug") == "fresh_after_requeue"], "never requeued"
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    assert final["Restarts"] == "1"
    failed = {c.name for c in result.failed_checks()}
    assert {"checkpoint_durable", "slurm_witness"} <= failed, result.checks


def test_kill_slurmd_catches_a_job_that_dies_with_its_nodes_slurmd(
        test_cluster: None, tmp_path: Path) -> None:
    """kill_slurmd.yaml exists for a job whose processes outlive their node's slurmd: ranks
    that exit with it end the job (no torchrun restarts left), and Slurm says so."""
    result, events = _run_broken("kill_slurmd.yaml", "dies_with_slurmd", tmp_path)
    assert [e for e in events if str(e.get("bug", "")).startswith("dies_with_slurmd:")]
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    assert final["JobState"] != "COMPLETED"
    assert final["Restarts"] == "0"
    failed = {c.name for c in result.failed_checks()}
    assert "completes" in failed, result.checks
