"""`expect.slurm_witness` against real Slurm runs: a small job preempted and requeued by the
test cluster passes when it resumes from its checkpoint, and fails when it ignores the
checkpoint after the requeue, or when it claims a resume on a run Slurm never requeued;
Slurm's own record (`Restarts`) says what happened in each."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness import api

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
JOB = Path(__file__).with_name("witness_job.py")
SCENARIO = """\
name: witness-{mode}
system:
  slurm:
    nodes: 1
    command: [{python}, {job}, {mode}]
    requeue: true
    probes:
      - {{pattern: '^step (?P<step>\\d+)$', event: step}}
      - {{pattern: '^saved step (?P<step>\\d+)$', event: checkpoint_saved}}
      - {{pattern: '^resumed from step (?P<step>\\d+)$', event: checkpoint_loaded}}
  timeout: 2m
faults:{faults}
expect:
  completes: true
  slurm_witness: true
"""
PREEMPT = "\n  - {kind: slurm.preempt, target: {node: 0}, at: {step: 8}}"


def _run(tmp_path: Path, mode: str, faults: str) -> tuple[dict[str, Any], dict[str, Any]]:
    scenario = tmp_path / f"{mode}.yaml"
    scenario.write_text(SCENARIO.format(mode=mode, python=sys.executable, job=JOB,
                                        faults=faults or " []"))
    result = api.run(scenario, run_dir=tmp_path / "r", use_cache=False)
    events = [json.loads(line) for line in
              (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    checks = {c.name: c for c in result.checks}
    return final, {"passed": checks["slurm_witness"].passed,
                   "message": checks["slurm_witness"].message,
                   "completes": checks["completes"].passed}


def test_a_job_that_resumes_after_its_requeue_passes(test_cluster: None,
                                                     tmp_path: Path) -> None:
    final, witness = _run(tmp_path, "correct", PREEMPT)
    assert final["Restarts"] == "1"
    assert witness["completes"]
    assert witness["passed"], witness["message"]
    assert "run 1: resumed from step" in witness["message"]


def test_a_job_that_ignores_its_checkpoint_after_the_requeue_fails(
        test_cluster: None, tmp_path: Path) -> None:
    final, witness = _run(tmp_path, "ignores_checkpoint", PREEMPT)
    assert final["Restarts"] == "1"
    assert witness["completes"]
    assert not witness["passed"]
    assert "after Slurm's requeue 1 the job started from scratch" in witness["message"]


def test_a_job_that_claims_a_resume_slurm_never_made_fails(
        test_cluster: None, tmp_path: Path) -> None:
    final, witness = _run(tmp_path, "claims_resume", "")
    assert final["Restarts"] == "0"
    assert witness["completes"]
    assert not witness["passed"]
    assert "first run claims to continue" in witness["message"]
