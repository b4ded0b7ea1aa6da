"""The Slurm scenarios fail on a broken variant of the recovery they exist for: a trainer that
starts over after Slurm requeues its job (tests/broken/sitecustomize.py,
``fresh_after_requeue``) passes the same scenario without the bug and fails
`checkpoint_durable` with it, and Slurm's own view says the job was requeued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aftershock.harness import api
from aftershock.harness.spec import LoadedScenario, load_scenario
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
