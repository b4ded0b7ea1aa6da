"""Each step's exit code reaches the timeline from Slurm's accounting (``sacct``) where the
cluster keeps one, else from the batch script's own record of its step: a verdict need not
rest on the job's own logs (harness/nodes/slurm_target.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aftershock.faults import slurm_cli as _slurm
from aftershock.harness import api

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(200)]
FAILING = """\
name: slurm-step-exit
system:
  slurm: {nodes: 2, ntasks_per_node: 1, command: [sh, -c, "exit 3"]}
  timeout: 2m
expect:
  completes: true
"""


def test_a_steps_exit_code_is_on_the_timeline(test_cluster: None, tmp_path: Path) -> None:
    scenario = tmp_path / "failing.yaml"
    scenario.write_text(FAILING)
    result = api.run(scenario, run_dir=tmp_path / "r", use_cache=False)
    events = [json.loads(line) for line in
              (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    steps = [e for e in events if e.get("event") == "slurm_step"]
    assert final["ExitCode"] == "3:0", final
    job_id = final["JobId"]
    accounted = _slurm.job_steps(job_id) is not None
    assert {e["source"] for e in steps} == {"sacct" if accounted else "batch script"}
    (step,) = [e for e in steps if e["step"] == f"{job_id}.0"]
    assert step["exit_code"] == 3
    assert "completes" in {c.name for c in result.failed_checks()}
