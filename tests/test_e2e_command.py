"""End to end: a plain torchrun job that knows nothing about Aftershock, attacked
through a command-kind scenario and measured from its log lines alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli

JOB = ROOT / "tests" / "fixtures" / "plain_ddp_job.py"

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
    - {{pattern: '\\[rank (?P<rank>\\d+)\\] step (?P<step>\\d+)', event: step}}
    - {{pattern: 'failed \\(exitcode: (?P<cause>-?\\d+)\\)', event: failure_detected}}
    - {{pattern: '\\[rank (?P<rank>\\d+)\\] params sha256=(?P<digest>[0-9a-f]+)', event: params}}
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
