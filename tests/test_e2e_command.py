"""End to end: a plain torchrun job that knows nothing about Aftershock, attacked
through a command-kind scenario and measured from its log lines alone; and a job that
splits into two worlds, which the recovery checks must not mistake for recovery."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli

JOB = ROOT / "tests" / "fixtures" / "plain_ddp_job.py"
SPLIT_JOB = ROOT / "tests" / "fixtures" / "split_brain_job.py"

# The job's step lines carry the world that committed them (torchrun's restart count) and
# the moment of the commit (CLOCK_MONOTONIC): what a log probe needs to prove recovery.
STEP_PROBE = ("{pattern: '\\[rank (?P<rank>\\d+)\\] step (?P<step>\\d+) .* "
              "gen (?P<generation>\\d+) t=(?P<time>[\\d.]+)', event: step}")
PARAMS_PROBE = ("{pattern: '\\[rank (?P<rank>\\d+)\\] params sha256=(?P<digest>[0-9a-f]+) "
                "gen (?P<generation>\\d+)', event: params}")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The good and the broken job share this text, so they share one cached fault-free run:
# the resume bug is switched on by a file next to the scenario (it cannot change a run that
# never resumes, and the fault-free run never does).
KILL = f"""\
system:
  command: [{sys.executable}, -m, torch.distributed.run, --nproc-per-node=2,
            --max-restarts=2, --monitor-interval=0.1, {JOB}]
  world: 2
  env:
    JOB_CKPT: ${{run_dir}}/ckpt
    JOB_STEPS: "40"
    JOB_BROKEN_RESUME_IF: ${{scenario_dir}}/BROKEN_RESUME
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1"
  probes:
    - {STEP_PROBE}
    - {{pattern: 'failed \\(exitcode: (?P<cause>-?\\d+)\\)', event: failure_detected}}
    - {PARAMS_PROBE}
  timeout: 4m
faults:
  - kind: process.kill
    target: {{rank: 1}}
    at: {{step: 25}}
expect:
  completes: true
  params_match: fault_free
  time_to_detect: {{max: 5s}}
  time_to_recover: {{max: 60s}}
  lost_steps: {{max: 10}}
"""


def run_kill(tmp_path: Path, cache: Path, *, broken: bool) -> tuple[int, dict[str, Any], str]:
    folder = tmp_path / ("broken" if broken else "good")
    folder.mkdir()
    if broken:
        (folder / "BROKEN_RESUME").touch()
    path = folder / "kill.yaml"
    path.write_text(f"name: plain-torchrun-kill{'-broken' if broken else ''}\n{KILL}")
    out = tmp_path / "out.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "runs"),
               cache=cache, timeout=280)
    (record,) = json.loads(out.read_text())
    return proc.returncode, record, proc.stdout + proc.stderr


def test_plain_torchrun_job_is_measured_from_its_logs(tmp_path: Path, shared_cache: Path) -> None:
    code, result, output = run_kill(tmp_path, shared_cache, broken=False)
    assert code == 0, output
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["params_match"]["passed"], checks["params_match"]
    metrics = result["metrics"]
    assert 0 < metrics["time_to_detect_s"] < 5
    assert metrics["time_to_recover_s"] > metrics["time_to_detect_s"]
    # Killed after step 25 with checkpoints every 10 steps: steps 21.. were redone.
    assert 1 <= metrics["lost_steps"] <= 10
    assert (Path(result["run_dir"]) / "logs" / "launcher.stdout.log").stat().st_size > 0


def test_params_match_catches_a_job_that_resumes_wrongly(
    tmp_path: Path, shared_cache: Path
) -> None:
    code, result, output = run_kill(tmp_path, shared_cache, broken=True)
    assert code == 1, output
    checks = {c["name"]: c for c in result["checks"]}
    assert not checks["params_match"]["passed"]
    assert checks["params_match"]["observed"] == "0/2 ranks equal"
    assert checks["completes"]["passed"]  # it "works"; only the check sees it is wrong


def test_heap_bitflips_land_in_a_job_that_never_imported_the_probe(tmp_path: Path) -> None:
    path = tmp_path / "flip.yaml"
    path.write_text(f"""\
name: plain-torchrun-heap-bitflip
system:
  command: [{sys.executable}, -m, torch.distributed.run, --nproc-per-node=2,
            --max-restarts=0, {JOB}]
  env: {{JOB_CKPT: "${{run_dir}}/ckpt", JOB_STEPS: "30"}}
  probes:
    - {{pattern: '\\[rank (?P<rank>\\d+)\\] step (?P<step>\\d+)', event: step}}
  timeout: 3m
faults:
  - kind: memory.bitflip
    target: {{rank: 1}}
    at: {{step: 15}}
    region: heap
    count: 64
    seed: 7
expect:
  completes: false   # flipped heap bits may crash the job: here only the injection is checked
""")
    out = tmp_path / "flip.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "runs"),
               timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (fault,) = json.loads(out.read_text())[0]["faults"]
    assert fault["injected_at_s"] is not None
    assert "64 write(s)" in fault["detail"], fault["detail"]


def test_a_frozen_rank_that_never_comes_back_is_not_recovery(tmp_path: Path) -> None:
    # The user's report: rank 1 of a plain DDP job is SIGSTOPped and never resumed (Gloo
    # would wait for it until its timeout). torchrun's --tee copies the ranks' output in
    # batches, so step lines written just before the freeze reach the harness just after
    # it; they must not pass for recovery. The run ends at its own timeout (then the harness
    # thaws the rank to kill it; whatever it commits then is no recovery either). The
    # timeout is all the run waits: it leaves a loaded machine time to start torch in three
    # processes (the freeze landed 2.8 s after launch on an idle 2-core machine).
    path = tmp_path / "freeze.yaml"
    path.write_text(f"""\
name: plain-torchrun-freeze-forever
system:
  command: [{sys.executable}, -m, torch.distributed.run, --nproc-per-node=2,
            --max-restarts=0, --tee=3, '--log-dir=${{run_dir}}/torchrun', {JOB}]
  world: 2
  env: {{JOB_CKPT: "${{run_dir}}/ckpt", JOB_STEPS: "2000", JOB_STEP_SLEEP: "0.01",
         TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1"}}
  probes:
    - {STEP_PROBE}
  timeout: 20s
faults:
  - kind: process.freeze
    target: {{rank: 1}}
    at: {{step: 10}}
expect:
  completes: false
  time_to_recover: {{max: 60s}}
""")
    out = tmp_path / "freeze.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "runs"),
               timeout=120)
    (record,) = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["faults_injected"]["passed"], proc.stdout + proc.stderr
    assert not checks["time_to_recover"]["passed"], checks["time_to_recover"]
    assert record["metrics"]["time_to_recover_s"] is None
    assert "not observed" in checks["time_to_recover"]["message"]
    assert proc.returncode == 1


def test_a_job_that_splits_into_two_worlds_has_no_single_history(tmp_path: Path) -> None:
    # Rank 1 is frozen for a second at step 10: rank 0 goes on alone in a world of its own,
    # and rank 1, thawed, does too. Both commit steps 11.. from the same state.
    probe = ("{pattern: 'rank (?P<rank>\\d+) world (?P<generation>\\w+) step (?P<step>\\d+) "
             "t=(?P<time>[\\d.]+)', event: step}")
    path = tmp_path / "split.yaml"
    path.write_text(f"""\
name: split-brain
system:
  command: [{sys.executable}, {SPLIT_JOB}]
  world: 2
  env: {{JOB_DIR: "${{run_dir}}/job", JOB_STEPS: "40"}}
  probes:
    - {probe}
  timeout: 60s
faults:
  - kind: process.freeze
    target: {{rank: 1}}
    at: {{step: 10}}
    duration: 1s
expect:
  completes: true
  single_history: true
  time_to_recover: {{max: 30s}}
  lost_steps: {{max: 0}}
""")
    out = tmp_path / "split.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "runs"),
               timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["completes"]["passed"]
    assert checks["faults_injected"]["passed"]
    assert not checks["single_history"]["passed"]
    assert "solo0" in checks["single_history"]["message"]
    assert "solo1" in checks["single_history"]["message"]
    # Each world redid the steps after the freeze alone: ~30 steps computed twice.
    metrics = record["metrics"]
    assert metrics["forked_steps"] >= 20
    assert metrics["lost_steps"] >= metrics["forked_steps"]
    assert not checks["lost_steps"]["passed"]
    assert not checks["time_to_recover"]["passed"]
    assert metrics["time_to_recover_s"] is None
