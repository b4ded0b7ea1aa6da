"""Each step's exit code reaches the timeline from Slurm's accounting (``sacct``) where the
cluster keeps one, else from the job's own record of its steps (the batch script the harness
writes, or the `srun` it puts before a user's own script): a verdict need not rest on the
job's own logs (harness/nodes/slurm_target.py)."""

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


#: A user's own batch script: two steps, the second on one node and exiting 3, each exit
#: code as the script sees it on its output; the first fails (9) if its tasks' PATH still
#: holds the harness's `srun`.
USER_SCRIPT = """\
#!/bin/bash
#SBATCH --ntasks-per-node=1
srun sh -c 'case ":$PATH:" in *"/slurm/bin:"*) exit 9 ;; esac'
echo "first step: $?"
srun --nodes=1 --ntasks=1 sh -c 'exit 3'
echo "second step: $?"
"""
USER_JOB = """\
name: slurm-user-steps
system:
  slurm: {nodes: 2, script: job.sh}
  timeout: 2m
expect:
  completes: true
  slurm_witness: true
"""


def test_each_step_of_a_users_own_script_has_its_exit_code_without_accounting(
        test_cluster: None, tmp_path: Path) -> None:
    (tmp_path / "job.sh").write_text(USER_SCRIPT)
    scenario = tmp_path / "user.yaml"
    scenario.write_text(USER_JOB)
    result = api.run(scenario, run_dir=tmp_path / "r", use_cache=False)
    run_dir = Path(result.run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (final,) = [e for e in events if e.get("event") == "slurm_job"]
    job_id = final["JobId"]
    output = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    # The script ran as it is: it saw each step's exit code, and ended as it does.
    said = [line for line in output.splitlines() if " step: " in line]
    assert said == ["first step: 0", "second step: 3"], output
    assert final["ExitCode"] == "0:0", final
    if _slurm.job_steps(job_id) is not None:
        pytest.skip("this cluster keeps accounting: the steps come from sacct")
    steps = [(e["step"], e["exit_code"], e["source"]) for e in events
             if e.get("event") == "slurm_step"]
    assert steps == [(f"{job_id}.0", 0, "srun"), (f"{job_id}.1", 3, "srun")], events
    witness = next(c for c in result.checks if c.name == "slurm_witness")
    assert f"steps {job_id}.0 exit 0, {job_id}.1 exit 3 (srun)" in witness.observed, witness
