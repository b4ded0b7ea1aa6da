"""In-process faults (collective.*, memory.* on named tensors) through the probe,
on a real 2-rank Gloo job under torchrun, and on the process groups the reference trainer's
hot_spare strategy builds itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import NAN_THEN_HANG, ROOT, cli

JOB = ROOT / "tests" / "fixtures" / "probe_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run(tmp_path: Path, faults: str, expect: str = "") -> tuple[int, dict, list[dict]]:
    return run_text(tmp_path, f"""\
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


def run_text(tmp_path: Path, text: str) -> tuple[int, dict, list[dict]]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    out = tmp_path / "out.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "runs"),
               "--plain", timeout=230)
    (record,) = json.loads(out.read_text())
    events = [json.loads(line) for line in
              (Path(record["run_dir"]) / "events.jsonl").read_text().splitlines()]
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, record, events


def test_nan_gradient_at_a_phase_is_detected_and_a_hang_holds_until_healed(
    tmp_path: Path,
) -> None:
    # Two faults that end no process share one run (each job costs seconds of torch start-up):
    # a NaN in rank 1's gradient at step 4, then a 1 s hang of its all_reduce at step 7.
    code, record, events = run(tmp_path, NAN_THEN_HANG, "expect: {time_to_detect: {max: 2s}}")
    assert code == 0, record
    nan, hang = record["faults"]
    assert (nan["kind"], nan["fault"], hang["kind"], hang["fault"]) == (
        "memory.nan", 0, "collective.hang", 1)

    # The NaN: injected at the named step, phase and tensor, seen by both ranks (the
    # all_reduce spread it), and the poisoned step was skipped, never committed.
    (hit,) = [e for e in events if e["event"] == "fault_injected" and e["fault"] == 0]
    assert (hit["rank"], hit["step"], hit["phase"], hit["tensor"]) == (1, 4, "backward",
                                                                        "grad:weight")
    detected = [e for e in events if e["event"] == "failure_detected"]
    assert {e["cause"] for e in detected} == {"non_finite"}
    assert {e["step"] for e in detected} == {4}
    committed = {(e["rank"], e["step"]): e["t"] for e in events if e["event"] == "step"}
    assert 4 not in {step for _, step in committed}
    assert nan["injected_at_s"] is not None

    # The hang: step 7 of rank 0 waited for rank 1's hung all_reduce, about the hang's length.
    assert committed[(0, 7)] - committed[(0, 6)] >= 0.9
    assert hang["healed_at_s"] - hang["injected_at_s"] == pytest.approx(1.0, abs=0.3)


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


def test_a_collective_fault_reaches_the_groups_hot_spare_builds(tmp_path: Path) -> None:
    """hot_spare never calls torch.distributed's functions: it builds a ProcessGroupGloo per
    membership generation and calls its methods (``group.allreduce``). The probe wraps those
    group objects, so the fault lands on the gradient all_reduce all the same; the trainer
    sees a failed collective, and regroups the same members without restarting anyone."""
    code, record, events = run_text(tmp_path, """\
name: inproc-hot-spare
system:
  reference: trainer
  world: {replicas: 2, shards: 1}
  recovery: hot_spare
  spares: 1
  steps: 20
  collective_timeout: 3s
faults:
  - kind: collective.error
    target: {rank: 1}
    at: {step: 8, phase: backward}
    op: all_reduce
expect:
  completes: true
""")
    # What went on, for the message of any assertion below.
    story = [{k: e.get(k) for k in ("event", "rank", "cause", "why", "role", "generation")}
             for e in events if e["event"] in ("hello", "failure_detected", "membership")]
    assert code == 0, (record["checks"], story)
    (hit,) = [e for e in events if e["event"] == "fault_injected"]
    assert (hit["rank"], hit["op"], hit["step"], hit["phase"]) == (1, "all_reduce", 8,
                                                                   "backward")
    seen = [e for e in events if e["event"] == "failure_detected" and e.get("rank") == 1
            and e["t"] >= hit["t"]]
    assert seen, ("rank 1 never reported its failed collective", story)
    assert seen[0]["cause"] == "collective_error", story
    assert "injected failure of all_reduce" in seen[0]["error"]
    # The same members regrouped: no spare took a rank over, no survivor said hello again.
    trainers = sorted(e["rank"] for e in events
                      if e["event"] == "hello" and e.get("role") == "trainer")
    assert trainers == [0, 1], story
    # Nobody applied step 8 when it failed: each rank committed every step exactly once.
    committed = sorted((e["rank"], e["step"]) for e in events if e["event"] == "step")
    assert committed == [(rank, step) for rank in (0, 1) for step in range(1, 21)]


def test_a_collective_wedged_for_good_is_fenced_under_hot_spare(tmp_path: Path) -> None:
    """A communicator that never comes back, on a member whose other threads run on. Its
    peers see the collective time out; recovery needs the wedged member replaced (fenced,
    then a spare takes its rank), since it will never join another generation. Its heartbeat
    goes on (another thread), so only its absence from the regrouped generation's start
    line can give it away."""
    code, record, events = run_text(tmp_path, """\
name: inproc-hot-spare-wedged
system:
  reference: trainer
  world: {replicas: 2, shards: 1}
  recovery: hot_spare
  spares: 1
  steps: 20
  collective_timeout: 3s
  timeout: 45s
faults:
  - kind: collective.hang
    target: {rank: 1}
    at: {step: 5, phase: backward}
    op: all_reduce
expect:
  completes: true
  time_to_detect: {max: 5s, cause: [collective_timeout]}
  time_to_recover: {max: 15s}
""")
    # It fails for the right reason: the wedge landed and the peers saw it time out.
    (hit,) = [e for e in events if e["event"] == "fault_injected"]
    assert (hit["rank"], hit["op"]) == (1, "all_reduce")
    assert any(e["cause"] == "collective_timeout" for e in events
               if e["event"] == "failure_detected" and e["t"] > hit["t"])
    story = [{k: e.get(k) for k in ("event", "rank", "cause", "why", "role", "generation")}
             for e in events if e["event"] in ("hello", "failure_detected", "membership")]
    assert code == 0, (record["checks"], story)
    # The wedged process itself was fenced for missing the start line, never for silence,
    # and a spare took its rank; rank 0 stayed in place.
    fenced = [e for e in events if e["event"] == "failure_detected"
              and e["cause"] in ("join_timeout", "heartbeat_timeout")]
    assert [(e["cause"], e["rank"], e["pid"]) for e in fenced] == [
        ("join_timeout", 1, hit["pid"])], story
    trainers = sorted(e["rank"] for e in events
                      if e["event"] == "hello" and e.get("role") == "trainer")
    assert trainers == [0, 1, 1], story
