"""A slow log probe never starves the log reader (issue 48, finding 7).

A user's probe whose regex backtracks (``(a+)+b`` against ``aaaa...c``) once stalled the
reader for minutes: the job printed its 30 steps in 3 s, yet its faults were "never
injected" and its detection "never observed", with no warning. Each probe now has a bounded
time per line (harness/run/logprobe.py); a line it gave up on is a ``probe_timeout`` on the
timeline, and a check that reads that probe's events says "not observed" naming the probe,
the file and the line. A reader still behind when the run is judged says so too
(``log_unread``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from _helpers import cli, read_events

from aftershock.harness.run.logprobe import (
    PROBE_LINE_CHARS,
    PROBE_LINE_S,
    LogProbe,
    ProbeReader,
    compile_probes,
    line_events,
)
from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.scenario import presets
from aftershock.harness.scenario.spec import Expect
from aftershock.harness.verdict.checks import Outcome, evaluate

HOSTILE = LogProbe(pattern="(?P<cause>(a+)+b)", event="failure_detected")
STEP = LogProbe(pattern=r"step (?P<step>\d+)", event="step")


def test_a_probe_gives_up_on_a_line_within_its_budget_and_says_where() -> None:
    line = "step 7 " + "a" * 5000 + "c"
    began = time.process_time()
    events = line_events(line, compile_probes([HOSTILE, STEP], "stdout"), read_t=5.0,
                         clock_offset=0.0, started=0.0, where="logs/launcher.stdout.log:3")
    # A few budgets at most (the CPU clock the budget is counted on), not the hours the
    # backtracking takes.
    assert time.process_time() - began < 4 * PROBE_LINE_S + 1
    gave_up, step = events
    assert gave_up.event == "probe_timeout"
    assert gave_up.fields["where"] == "logs/launcher.stdout.log:3"
    assert gave_up.fields["pattern"] == HOSTILE.pattern
    assert gave_up.fields["kind"] == "failure_detected"
    assert gave_up.t == 5.0
    # The other probes still read the line.
    assert (step.event, step.fields["step"]) == ("step", 7)


def test_a_line_past_the_cap_is_read_up_to_it_and_its_events_say_so() -> None:
    line = "step 3 " + "x" * (2 * PROBE_LINE_CHARS) + " step 4"
    events = line_events(line, compile_probes([STEP], "stdout"), read_t=1.0,
                         clock_offset=0.0, started=0.0)
    assert [e.fields["step"] for e in events] == [3]  # step 4 lies past the cap
    assert events[0].fields["line_cut"] is True


def test_the_framework_presets_finish_a_hostile_line_within_the_budget() -> None:
    # torchft's prefix once tried every split of `[000...` (a tensor dumped into the log).
    probes = compile_probes(presets.probes("torchft"), "logs")
    for line in ("[" + "0" * PROBE_LINE_CHARS, ("[1:" + "f" * 300) * 200, "[" * 60000,
                 "[x:" + "0" * 60000 + "/0 - step 1] should_commit=True"):
        events = line_events(line, probes, read_t=1.0, clock_offset=0.0, started=0.0)
        assert not [e for e in events if e.event == "probe_timeout"], line[:20]


def test_a_reader_writes_nothing_once_closed_and_numbers_each_stream() -> None:
    written: list[Event] = []
    reader = ProbeReader(written.append)
    probes = compile_probes([HOSTILE, STEP], "stdout")
    reader.read("out.log", "hello", probes, read_t=1.0, clock_offset=0.0, started=0.0)
    reader.read("out.log", "a" * 2000 + "c", probes, read_t=2.0, clock_offset=0.0,
                started=0.0)
    reader.read("err.log", "step 1", probes, read_t=3.0, clock_offset=0.0, started=0.0)
    assert [(e.event, e.fields.get("where")) for e in written] == [
        ("probe_timeout", "out.log:2"), ("step", None)]
    assert reader.close() == {}
    reader.read("err.log", "step 2", probes, read_t=4.0, clock_offset=0.0, started=0.0)
    assert len(written) == 2  # after close: the timeline may be gone


def _judged(names: dict[str, bool], *holes: Event) -> dict[str, CheckResult]:
    from aftershock.harness.run.logprobe import unread

    results = [CheckResult(n, ok, None, None, "as judged") for n, ok in names.items()]
    return {c.name: c for c in unread(results, list(holes))}


def test_checks_that_read_what_a_probe_gave_up_on_are_not_observed() -> None:
    gave_up = line_events("a" * 2000 + "c", compile_probes([HOSTILE], "stdout"), read_t=1.0,
                          clock_offset=0.0, started=0.0, where="x.log:9")
    judged = _judged({"completes": True, "faults_injected": True, "time_to_detect": True,
                      "lost_steps": True, "a_plugin_check": True}, *gave_up)
    assert judged["completes"].passed  # reads no log line
    assert judged["faults_injected"].passed  # the injections are the harness's own record
    assert judged["lost_steps"].passed  # reads steps; the probe made detections
    for name in ("time_to_detect", "a_plugin_check"):  # a check we cannot see into: all
        assert not judged[name].passed
        assert judged[name].message.startswith(
            f"not observed: probe {HOSTILE.pattern!r} timed out on x.log:9"), judged[name]
    missed = _judged({"faults_injected": False}, *gave_up)["faults_injected"]
    assert not missed.passed
    assert missed.message.startswith("not observed: probe")
    # The harness's judgement applies it: `evaluate` over a timeline with the hole.
    expect = Expect.model_validate({"completes": True, "time_to_detect": {"max": "5s"}})
    completes, detect = evaluate(expect, outcome=Outcome(0, False, 1.0),
                                 metrics={"time_to_detect_s": 0.5}, faults=[], digests={},
                                 baseline=None, events=gave_up)
    assert completes.passed
    assert not detect.passed
    assert detect.message.startswith("not observed: probe"), detect


def test_lines_left_unread_make_the_checks_of_their_stream_not_observed() -> None:
    behind = Event(t=9.0, event="log_unread", source="log-reader",
                   fields={"stream": "logs/launcher.stdout.log", "why": "3 bytes",
                           "kinds": ["step"]})
    judged = _judged({"step_rate": True, "params_match": True}, behind)
    assert not judged["step_rate"].passed
    assert judged["step_rate"].message.startswith(
        "not observed: the log reader was still behind on logs/launcher.stdout.log")
    assert judged["params_match"].passed  # no probe of that stream makes params


def test_validate_refuses_a_pattern_the_engine_cannot_compile(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"""\
name: bad
system:
  command: [{sys.executable}, job.py]
  probes:
    - {{pattern: 'step (?P<step>\\d+', event: step}}
""")
    proc = cli("validate", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bad.yaml:5:17: system.probes.0.pattern: not a valid regular expression" in (
        proc.stdout + proc.stderr)

# The job prints one 200 KB line that makes the backtracking probe's regex explode, then its
# steps: a probe that cannot finish its line must not keep them from the run.
JOB = """\
import time
print("a" * 200_000 + "c", flush=True)
for step in range(30):
    print(f"step {step} t={time.monotonic():.6f}", flush=True)
    time.sleep(0.1)
"""

SCENARIO = f"""\
name: slow-probe
system:
  command: [{sys.executable}, job.py]
  cwd: .
  probes:
    - {{pattern: 'step (?P<step>\\d+) t=(?P<time>\\S+)', event: step}}
    - {{pattern: '(?P<cause>(a+)+b)', event: failure_detected}}
  timeout: 60s
faults:
  - {{kind: process.freeze, target: {{rank: 0}}, at: {{step: 15}}, duration: 0.2s}}
expect:
  completes: true
  time_to_detect: {{max: 5s}}
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_backtracking_probe_is_bounded_and_its_check_says_not_observed(
        tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    scenario = tmp_path / "slow.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out.json"
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(run_dir),
               timeout=120)
    took = time.monotonic() - began
    output = proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    # The step lines after the long one were read in time: the fault fired at its step.
    # (Where the machine is so busy that the probe's quarter second of CPU took longer than
    # the job's 3 s, the fault missed the job; that is said as not observed, never silently.)
    injected = checks["faults_injected"]
    assert injected["passed"] or injected["message"].startswith(
        "not observed: probe '(?P<cause>(a+)+b)' timed out"), (checks, output)
    assert checks["completes"]["passed"], checks
    # The probe gave up on line 1, and the run says so: an event naming the probe, the
    # file and the line, and the check that needs that probe's events is not observed.
    (timeout,) = read_events(run_dir / "slow-probe" / "events.jsonl", "probe_timeout")
    assert timeout["pattern"] == "(?P<cause>(a+)+b)"
    assert timeout["where"] == "logs/launcher.stdout.log:1"
    assert timeout["kind"] == "failure_detected"
    assert timeout["line_cut"] is True  # 200 KB: the probes read its first 64 KiB
    detect = checks["time_to_detect"]
    assert not detect["passed"]
    assert detect["message"].startswith(
        "not observed: probe '(?P<cause>(a+)+b)' timed out on logs/launcher.stdout.log:1"
    ), detect
    assert proc.returncode == 1, output
    assert "WARNING probe '(?P<cause>(a+)+b)' (failure_detected) gave up on" in output, output
    # Bounded: a probe gives up within its budget, not after minutes (the job runs ~1 s;
    # the rest is starting Python twice).
    assert took < 100, took


# Lines short enough for the pipe's buffer (the job never waits on the reader) that make the
# same probe give up, each after its whole budget: the job has printed everything and exited
# long before the reader has been through them.
BEHIND_JOB = """\
for _ in range(16):
    print("a" * 1000 + "c", flush=True)
for step in range(10):
    print(f"step {step}", flush=True)
"""

BEHIND = f"""\
name: reader-behind
system:
  command: [{sys.executable}, job.py]
  cwd: .
  probes:
    - {{pattern: 'step (?P<step>\\d+)', event: step}}
    - {{pattern: '(?P<cause>(a+)+b)', event: failure_detected}}
  timeout: 60s
expect:
  completes: true
  skipped_steps: {{max: 0}}
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_reader_still_behind_when_the_run_ends_says_so(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(BEHIND_JOB)
    scenario = tmp_path / "behind.yaml"
    scenario.write_text(BEHIND)
    out = tmp_path / "out.json"
    run_dir = tmp_path / "run"
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(run_dir),
               timeout=120)
    output = proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    (behind,) = read_events(run_dir / "reader-behind" / "events.jsonl", "log_unread")
    assert behind["stream"] == "logs/launcher.stdout.log", behind
    assert behind["kinds"] == ["failure_detected", "step"], behind
    assert "its probes were still on line logs/launcher.stdout.log:" in behind["why"], behind
    # The step lines were never matched: a gap in them is not judged from what was read.
    skipped = checks["skipped_steps"]
    assert not skipped["passed"], skipped
    assert skipped["message"].startswith(
        "not observed: the log reader was still behind on logs/launcher.stdout.log"), skipped
    assert checks["completes"]["passed"], checks
    assert "WARNING the log reader was behind" in output, output
    assert proc.returncode == 1, output


def test_what_a_reader_left_in_the_pipe_is_counted() -> None:
    # A reader that reached the drain's deadline still busy leaves the job's last lines in
    # the pipe: they were never read, and log_unread counts them.
    import os

    from aftershock.harness.run.target import _pending

    read, write = os.pipe()
    with os.fdopen(read, "rb") as stream:
        os.write(write, b"step 1\nstep 2\n")
        os.close(write)
        assert _pending(stream) == 14
        stream.read()
        assert _pending(stream) == 0
    assert _pending(stream) == 0  # closed: nothing can be told
