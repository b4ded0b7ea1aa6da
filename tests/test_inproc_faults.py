"""In-process faults (collective.*, memory.* on named tensors) through the probe,
on a real 2-rank Gloo job under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "fixtures" / "probe_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run(tmp_path: Path, faults: str, expect: str = "") -> tuple[int, dict, list[dict]]:
    path = tmp_path / "s.yaml"
    path.write_text(f"""\
name: inproc
system:
  command: [{sys.executable}, -m, torch.distributed.run, --nproc-per-node=2,
            --max-restarts=1, --monitor-interval=0.1, {JOB}]
  world: 2
  env: {{JOB_STEPS: "30", PYTHONPATH: "{ROOT}", TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1"}}
  timeout: 3m
faults:
{faults}
{expect}
""")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "run", str(path), "--json", str(out),
         "--run-dir", str(tmp_path / "runs"), "--plain"],
        capture_output=True, text=True, timeout=230, env=dict(os.environ),
    )
    (record,) = json.loads(out.read_text())
    events = [json.loads(line) for line in
              (Path(record["run_dir"]) / "events.jsonl").read_text().splitlines()]
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, record, events


def test_nan_gradient_at_a_step_and_phase_is_detected(tmp_path: Path) -> None:
    code, record, events = run(tmp_path, """\
  - kind: memory.nan
    target: {rank: 1}
    at: {step: 7, phase: backward}
    tensor: "grad:weight"
""", "expect: {time_to_detect: {max: 2s}}")
    assert code == 0, record
    (hit,) = [e for e in events if e["event"] == "fault_injected"]
    assert (hit["rank"], hit["step"], hit["phase"], hit["tensor"]) == (1, 7, "backward",
                                                                        "grad:weight")
    detected = [e for e in events if e["event"] == "failure_detected"]
    assert {e["cause"] for e in detected} == {"non_finite"}
    assert {e["step"] for e in detected} == {7}  # both ranks: the all_reduce spread the NaN
    # The poisoned step was skipped, never committed.
    assert 7 not in {e["step"] for e in events if e["event"] == "step"}
    assert record["faults"][0]["injected_at_s"] is not None


def test_collective_error_on_the_kth_call(tmp_path: Path) -> None:
    code, record, events = run(tmp_path, """\
  - kind: collective.error
    target: {rank: 0}
    at: {step: 5}
    op: all_reduce
    call: 2
""")
    assert code == 0, record
    (hit,) = [e for e in events if e["event"] == "fault_injected"]
    assert (hit["rank"], hit["op"]) == (0, "all_reduce")
    assert hit["step"] == 5  # steps are counted by fault points: the 2nd all_reduce of step 5
    causes = [e["cause"] for e in events if e["event"] == "failure_detected"]
    assert any("injected failure of all_reduce" in c for c in causes)
    # torchrun restarted the job once, and the fault did not fire again in the restart.
    assert max(e["generation"] for e in events if e["event"] == "hello") == 1


def test_collective_hang_holds_until_healed(tmp_path: Path) -> None:
    code, record, events = run(tmp_path, """\
  - kind: collective.hang
    target: {rank: 1}
    at: {step: 4}
    duration: 1s
""")
    assert code == 0, record
    steps = {(e["rank"], e["step"]): e["t"] for e in events if e["event"] == "step"}
    # Step 4 of rank 0 waited for rank 1's hung all_reduce: about the hang's duration.
    assert steps[(0, 4)] - steps[(0, 3)] >= 0.9
    fault = record["faults"][0]
    assert fault["healed_at_s"] - fault["injected_at_s"] == pytest.approx(1.0, abs=0.3)
