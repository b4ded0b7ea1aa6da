"""Recovery proven without editing the job: a step line read after the fault proves it
was committed after the fault when its writer's own log file appeared after the fault
(torchrun's per-attempt files), and its read time then bounds the recovery from above."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from _helpers import ROOT
from rich.console import Console

from aftershock.harness import api
from aftershock.harness.run.records import Event, RunResult
from aftershock.harness.run.timeline import read_events
from aftershock.harness.scenario.spec import Budget, Expect
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import Outcome, evaluate

LOGS = "/run/torchrun/abc"
FAULT = 6.5


def path(attempt: int, rank: int) -> str:
    return f"{LOGS}/attempt_{attempt}/{rank}/stdout.log"


def line(t: float, step: int, rank: int, attempt: int, **fields: Any) -> Event:
    """A step line of torchrun's per-rank file, stamped when the harness read it."""
    return Event(t, "step", "log", {"step": step, "rank": rank, "generation": attempt,
                                    "stream": path(attempt, rank), "clock": "read",
                                    "read_t": t, "line": f"Epoch {step}", **fields})


def appeared(t: float, attempt: int, rank: int, absent_at: float | None) -> Event:
    return Event(t, "log_appeared", "harness", {"path": path(attempt, rank),
                                                "absent_at": absent_at})


def killed_world(restart_absent_at: float | None = 8.99, *, appear: bool = True
                 ) -> list[Event]:
    """Two ranks under torchrun, rank 1 killed after step 4; attempt 1 resumes at step 4.
    Rank 0's old writer still has a step 5 line read just after the fault."""
    events = [appeared(1.0, 0, r, 0.99) for r in (0, 1)]
    events += [line(2.0 + s + 0.01 * r, s, r, 0) for s in range(5) for r in (0, 1)]
    events.append(Event(FAULT, "fault_injected", "harness",
                        {"kind": "process.kill", "applied_at": FAULT + 0.01}))
    events.append(line(FAULT + 0.02, 5, 0, 0))
    if appear:
        events += [appeared(9.0, 1, r, restart_absent_at) for r in (0, 1)]
    events += [line(12.0, 4, 0, 1), line(12.05, 4, 1, 1), line(13.0, 5, 0, 1),
               line(13.01, 5, 1, 1)]
    events.append(Event(20.0, "run_end", "harness", {"exit_code": 0}))
    return events


def test_a_restarted_writers_read_time_proves_recovery_as_an_upper_bound() -> None:
    found = metrics.recovery(killed_world(), 2)
    assert found.seconds == pytest.approx(12.05 - FAULT)
    assert found.at_least == pytest.approx(8.99 - FAULT)
    assert found.step == 4
    assert found.generation == 1
    assert found.proof == metrics.PROOF_WRITER_STARTED
    assert metrics.compute(killed_world(), 2)["time_to_recover_s"] == pytest.approx(5.55)


@pytest.mark.parametrize(("absent_at", "appear"), [
    (None, True),  # seen at the tailer's first look: when it appeared is unknown
    (FAULT - 0.5, True),  # it was there before the fault: its writer may be the old world's
    (FAULT + 0.005, True),  # absent after the fault began, but before it had landed
    (8.99, False),  # a timeline without the tailer's records (an older run)
])
def test_read_time_without_a_writer_started_after_the_fault_proves_nothing(
        absent_at: float | None, appear: bool) -> None:
    events = killed_world(absent_at, appear=appear)
    found = metrics.recovery(events, 2)
    assert found.seconds is None
    assert "read" in found.reason
    assert "log file" in found.reason
    assert metrics.compute(events, 2)["time_to_recover_s"] is None
    assert metrics.metric_proofs(events, 2).get("time_to_recover_s") is None


def test_one_rank_unproven_leaves_no_world_whole() -> None:
    # Rank 1's file of attempt 1 was there before the fault: rank 0 alone is proven.
    events = killed_world()
    events = [appeared(e.t, 1, 1, 1.5) if e.event == "log_appeared"
              and e.fields["path"] == path(1, 1) else e for e in events]
    found = metrics.recovery(events, 2)
    assert found.seconds is None
    assert "rank 1" in found.reason


def test_the_committers_own_clock_is_an_exact_proof() -> None:
    events = [Event(e.t - 0.3, e.event, e.source, {**e.fields, "clock": "line"})
              if e.event == "step" and e.fields.get("generation") == 1 else e
              for e in killed_world(None)]
    found = metrics.recovery(events, 2)
    assert found.seconds == pytest.approx(12.05 - 0.3 - FAULT)
    assert found.at_least == found.seconds
    assert found.proof == metrics.PROOF_OWN_CLOCK
    assert metrics.metric_proofs(events, 2)["time_to_recover_s"] == metrics.PROOF_OWN_CLOCK


def run_check(events: list[Event], limit_s: float) -> tuple[bool, str, Any]:
    (check,) = [c for c in evaluate(
        Expect(completes=False, time_to_recover=Budget(max=timedelta(seconds=limit_s))),
        outcome=Outcome(0, False, 20.0), metrics=metrics.compute(events, 2), faults=[],
        digests={}, baseline=None, events=events, world=2)
        if c.name == "time_to_recover"]
    return check.passed, check.message, check.observed


def test_a_budget_passes_on_the_upper_bound_and_says_so() -> None:
    passed, message, observed = run_check(killed_world(), 6.0)
    assert passed
    assert observed == pytest.approx(5.55)
    assert "at most" in message
    assert "at least 2.49" in message
    assert metrics.PROOF_WRITER_STARTED in message


def test_a_budget_the_lower_bound_meets_but_the_upper_bound_misses_fails() -> None:
    # Between 2.49 and 5.55 s: a 4 s budget is not proven met.
    passed, message, _ = run_check(killed_world(), 4.0)
    assert not passed
    assert "at most" in message


def test_proofs_name_each_time_metric() -> None:
    proofs = metrics.metric_proofs(killed_world(), 2)
    assert proofs["time_to_recover_s"].startswith(metrics.PROOF_WRITER_STARTED)
    assert "at least 2.490 s" in proofs["time_to_recover_s"]
    detected = [*killed_world(), Event(7.0, "failure_detected", "log",
                                       {"cause": "-9", "clock": "read", "read_t": 7.0})]
    assert metrics.metric_proofs(detected, 2)["time_to_detect_s"] == metrics.PROOF_READ_TIME


def test_the_report_the_record_and_junit_say_what_proves_each_metric(tmp_path: Path) -> None:
    from aftershock.harness.reporting.report import junit_xml, render_result
    from aftershock.harness.run.rundir import read_result

    events = killed_world()
    result = RunResult("kill", "kill.yaml", True, 0, 20.0, (), metrics.compute(events, 2), (),
                       str(tmp_path), proofs=metrics.metric_proofs(events, 2))
    buffer = io.StringIO()
    render_result(result, Console(file=buffer, width=300))
    shown = " ".join(buffer.getvalue().split())
    assert ("time_to_recover_s=5.550 (proof: read time, writer started after the fault "
            "(upper bound); at least 2.490 s)") in shown
    record = tmp_path / "result.json"
    record.write_text(json.dumps(result.to_json()))
    assert read_result(record).proofs["time_to_recover_s"].startswith(
        metrics.PROOF_WRITER_STARTED)
    assert 'name="time_to_recover_s_proof" value="read time, writer started' in junit_xml(
        [result])


EXAMPLE = ROOT / "examples" / "ddp_tutorial"
STEP_CLOCK = ROOT / "tests" / "step_clock"  # its sitecustomize.py: the truth, from inside


# Over a minute on a busy 2-core machine: with the examples' sweep (make test-scenarios).
@pytest.mark.slow
@pytest.mark.scenarios
@pytest.mark.timeout(600)
def test_the_ddp_tutorial_unmodified_recovers_within_10_percent_of_its_first_step(
        tmp_path: Path) -> None:
    """PyTorch's DDP tutorial job, unmodified (its lines carry no time), killed at an epoch:
    the harness's time_to_recover, an upper bound from read times, is within 10% of the
    restarted world's first optimizer step as the workers themselves recorded it."""
    data = yaml.safe_load((EXAMPLE / "kill_epoch_recover.yaml").read_text())
    clock = tmp_path / "first_steps.jsonl"
    path = [str(STEP_CLOCK), os.environ.get("PYTHONPATH", "")]
    data["system"]["env"] = {**data["system"].get("env", {}),
                             "PYTHONPATH": os.pathsep.join(p for p in path if p),
                             "AFTERSHOCK_TEST_STEP_CLOCK": str(clock)}
    result = api.run(api.from_dict(data, folder=EXAMPLE), run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert checks["time_to_recover"].passed, checks["time_to_recover"].message
    assert result.passed, [(c.name, c.message) for c in result.failed_checks()]

    events = read_events(Path(result.run_dir) / "events.jsonl")
    t_fault = metrics.first_fault_time(events)
    assert t_fault is not None
    found = metrics.recovery(events, 2)
    assert found.proof == metrics.PROOF_WRITER_STARTED
    assert found.seconds == result.metrics["time_to_recover_s"]
    firsts = [json.loads(line) for line in clock.read_text().splitlines()]
    # The killed world trained before the fault; the world that recovered is torchrun's
    # restart the harness named (attempt_N), both of its ranks.
    assert all(s["t"] < t_fault for s in firsts if s["restart"] == 0)
    restarted = [s for s in firsts if s["restart"] == found.generation]
    assert sorted(s["rank"] for s in restarted) == [0, 1]
    truth = max(s["t"] for s in restarted) - t_fault
    assert found.seconds == pytest.approx(truth, rel=0.10), (
        f"harness: at most {found.seconds:.3f} s, at least {found.at_least} s; "
        f"the workers' own first step: {truth:.3f} s")
    assert found.at_least is not None
    assert found.at_least <= truth
    assert result.proofs["time_to_recover_s"].startswith(metrics.PROOF_WRITER_STARTED)
    # The proof is the restarted workers' log files appearing after the fault: without the
    # tailer's record of that, the same lines prove nothing.
    unproven = [e for e in events if e.event != "log_appeared"]
    assert metrics.recovery(unproven, 2).seconds is None


JOB = """
import pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
(folder / "attempt_0" / "0").mkdir(parents=True)
(folder / "attempt_0" / "0" / "stdout.log").write_text("step 1\\n")
time.sleep(0.5)
before = time.monotonic()
(folder / "attempt_1" / "0").mkdir(parents=True)
(folder / "attempt_1" / "0" / "stdout.log").write_text("step 2\\n")
after = time.monotonic()
(folder / "created.txt").write_text(f"{before} {after}")
with open(folder / "before" / "stdout.log", "a") as early:  # a file there before the launch
    early.write("step 3\\n")
time.sleep(0.3)
"""


@pytest.mark.slow
def test_the_tailer_records_when_each_log_file_was_last_seen_absent(tmp_path: Path) -> None:
    from aftershock.harness.run.target import Launch, LocalTarget
    from aftershock.harness.run.timeline import Timeline
    from aftershock.harness.scenario.spec import LogProbe

    logs = tmp_path / "logs"
    early = logs / "before" / "stdout.log"  # there before the job starts: an earlier run's
    early.parent.mkdir(parents=True)
    early.write_text("step 0\n")
    probe = LogProbe(pattern=r"step (?P<step>\d+)", event="step")
    run_dir = tmp_path / "run"
    launch = Launch([sys.executable, "-c", JOB, str(logs)], tmp_path, {}, 1, (probe,),
                    (str(logs / "**" / "stdout.log"),))
    timeline = Timeline(run_dir / "events.jsonl")
    job = LocalTarget(launch, run_dir=run_dir, run_id="appeared", timeline=timeline)
    job.start()
    while job.poll() is None:
        time.sleep(0.05)
    job.stop()
    timeline.close()
    events = read_events(run_dir / "events.jsonl")
    seen = {e.fields["path"]: e for e in events if e.event == "log_appeared"}
    assert str(early) not in seen  # it did not appear: it was there before the launch
    before, after = map(float, (logs / "created.txt").read_text().split())
    late = seen[str(logs / "attempt_1" / "0" / "stdout.log")]
    # Absent at a moment before it was created (its look did not find it), found after.
    assert late.fields["absent_at"] < after
    assert late.t >= before
    assert after - late.fields["absent_at"] < 1.0  # every 10 ms, on a busy machine
    # Its line is proven written after that moment; the early file's lines are not.
    by_step = {c.step: c for c in metrics.Reading.of(events).commits}
    assert by_step[2].written_after == late.fields["absent_at"]
    # What the early file held before the launch is an earlier run's: not read. What the
    # job appended to it is, proven written after nothing (the file was there all along).
    assert 0 not in by_step
    assert by_step[3].written_after is None
