"""`--trace FILE`: Chrome trace-event JSON that Perfetto opens, checked against the format.

The oracle is the Trace Event Format itself (its JSON object form: ``traceEvents``; "X"
complete events with ``ts`` and ``dur`` in microseconds; "i" instants with a scope ``s``
of g, p or t; "M" metadata naming processes) and the run's own events.jsonl, read here
independently of the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import read_events

from aftershock.harness.errors import SpecError
from aftershock.harness.reporting.trace import write_trace
from aftershock.harness.run.rundir import load_run

RUNS = Path(__file__).parent / "fixtures" / "recorded"
TRAINING = RUNS / "train-kill-rank-hot-spare"
SERVING = RUNS / "serve-kill-worker"
PHASES = {"X", "i", "M"}


def _trace(tmp_path: Path, *runs: Path, clock: str = "run") -> dict:
    out = tmp_path / "trace.json"
    write_trace([load_run(r) for r in runs], out, clock=clock)
    return json.loads(out.read_text())


def _check_format(document: dict) -> list[dict]:
    events = document["traceEvents"]
    assert isinstance(events, list)
    assert events
    assert document["displayTimeUnit"] in ("ms", "ns")
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int), e
        assert isinstance(e["tid"], int), e
        assert isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float), e
            assert e["dur"] >= 0, e
        elif e["ph"] == "i":
            assert isinstance(e["ts"], int | float), e
            assert e["s"] in ("g", "p", "t"), e
        else:
            assert e["name"] in ("process_name", "process_sort_index", "thread_name",
                                 "thread_sort_index"), e
            assert isinstance(e["args"], dict), e
    return events


def test_training_trace_has_a_track_per_process_fault_spans_and_instants(tmp_path: Path
                                                                         ) -> None:
    events = _check_format(_trace(tmp_path, TRAINING))
    recorded = read_events(TRAINING / "events.jsonl")
    # A track per process: every pid that wrote an event is named.
    pids = {e["pid"] for e in recorded if isinstance(e.get("pid"), int)}
    named = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert pids <= set(named), pids - set(named)
    for e in recorded:
        if e["event"] == "hello" and e.get("rank") is not None:
            assert f"rank {e['rank']}" in named[e["pid"]]
    # Each committed step is a slice on its process's track.
    steps = [e for e in recorded if e["event"] == "step"]
    slices = [e for e in events if e["ph"] == "X" and e.get("cat") == "step"]
    assert len(slices) == len(steps)
    assert {(e["pid"], e["name"]) for e in slices} == {(e["pid"], f"step {e['step']}")
                                                        for e in steps}
    # Each fault a span from its injection, in microseconds of the same clock.
    faults = [e for e in recorded if e["event"] == "fault_injected"]
    spans = [e for e in events if e["ph"] == "X" and e.get("cat") == "fault"]
    assert len(spans) == len(faults) == 1
    assert spans[0]["ts"] == pytest.approx(faults[0]["t"] * 1e6, abs=1)
    # Detection and recovery: instants across the trace at fault + the recorded metric.
    metrics = json.loads((TRAINING / "result.json").read_text())["metrics"]
    instants = {e["name"].split(" ")[0]: e for e in events if e["ph"] == "i" and e["s"] == "g"}
    for word, metric in (("detected", "time_to_detect_s"), ("recovered", "time_to_recover_s")):
        assert instants[word]["ts"] == pytest.approx((faults[0]["t"] + metrics[metric]) * 1e6,
                                                     abs=1)
    detected = [e for e in events if e["ph"] == "i" and e["name"] == "failure_detected"]
    assert len(detected) == sum(1 for e in recorded if e["event"] == "failure_detected")


def test_serving_trace_has_a_row_per_request(tmp_path: Path) -> None:
    events = _check_format(_trace(tmp_path, SERVING))
    sent = {e["request"] for e in read_events(SERVING / "events.jsonl", "request_sent")}
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == sent
    requests = [e for e in events if e["ph"] == "X" and e.get("cat") == "request"
                and e["name"].startswith("req")]
    assert len(requests) == len(sent)


def test_wall_clock_trace_and_runs_side_by_side(tmp_path: Path) -> None:
    recorded = read_events(TRAINING / "events.jsonl", "launch")[0]
    wall = _check_format(_trace(tmp_path, TRAINING, clock="wall"))
    run = _check_format(_trace(tmp_path, TRAINING))
    shift = recorded["wall_offset"] * 1e6
    assert [e["ts"] for e in wall if "ts" in e] == pytest.approx(
        [e["ts"] + shift for e in run if "ts" in e], abs=2)
    both = _check_format(_trace(tmp_path, TRAINING, SERVING))
    names = [e["args"]["name"] for e in both if e["name"] == "process_name"]
    assert any(n.startswith("train-kill-rank-hot-spare #1") for n in names)
    assert any(n.startswith("serve-kill-worker #2") for n in names)
    # The two runs' tracks never share a pid.
    first = {e["pid"] for e in both if e["name"] == "process_name"
             and e["args"]["name"].startswith("train")}
    second = {e["pid"] for e in both if e["name"] == "process_name"
              and e["args"]["name"].startswith("serve")}
    assert not first & second


def test_wall_clock_needs_the_recorded_offset(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    for name in ("result.json", "scenario.yaml"):
        (run / name).write_bytes((TRAINING / name).read_bytes())
    lines = (TRAINING / "events.jsonl").read_text().splitlines()
    launch = json.loads(lines[0])
    assert launch["event"] == "launch"
    del launch["wall_offset"]
    (run / "events.jsonl").write_text("\n".join([json.dumps(launch), *lines[1:]]) + "\n")
    with pytest.raises(SpecError, match="no wall-clock offset"):
        _trace(tmp_path, run, clock="wall")
