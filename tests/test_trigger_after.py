"""``at: {..., after: {event}}``: a fault waits until the system has also reported the
state it is meant for, and fails as not observed when that never comes. A torch-free job
that prints its steps; its "spare up" line comes late, as a warm spare's hello did on a
loaded machine (scenarios/nodes/kill_node_hot_spare.yaml)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import load_scenario

JOB = """\
import os, sys, time
for step in range(12):
    print(f"step {step}", flush=True)
    if step == int(sys.argv[1]):
        print(f"spare up pid {os.getpid()}", flush=True)
    time.sleep(0.05)
"""


def run(tmp_path: Path, up_at: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    (tmp_path / "job.py").write_text(JOB)
    path = tmp_path / "after.yaml"
    path.write_text(f"""\
name: after
system:
  command: [{sys.executable}, {tmp_path / 'job.py'}, '{up_at}']
  probes:
    - {{pattern: 'step (?P<step>\\d+)', event: step}}
    - {{pattern: '(?P<role>spare) up pid (?P<pid>\\d+)', event: hello}}
faults:
  - kind: process.freeze
    target: {{rank: 0}}
    at: {{step: 2, after: {{event: hello, role: spare}}}}
    duration: 50ms
expect: {{completes: true}}
""")
    run_dir = tmp_path / "run"
    result = run_scenario(load_scenario(path), run_dir=run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "result.json").read_text()) | {"passed": result.passed}, events


def test_the_fault_waits_for_the_awaited_event_past_its_step(tmp_path: Path) -> None:
    record, events = run(tmp_path, up_at=7)
    (hello,) = [e for e in events if e["event"] == "hello"]
    (hit,) = [e for e in events if e["event"] == "fault_injected"]
    assert hit["t"] >= hello["t"]
    steps_before = [e["step"] for e in events if e["event"] == "step" and e["t"] < hit["t"]]
    assert max(steps_before) >= 7, steps_before  # not at step 2, where it would have been
    assert record["passed"], record


def test_a_fault_whose_awaited_event_never_comes_is_not_observed(tmp_path: Path) -> None:
    record, events = run(tmp_path, up_at=99)  # never says it
    assert not [e for e in events if e["event"] == "fault_injected"]
    assert not record["passed"]
    (check,) = [c for c in record["checks"] if c["name"] == "faults_injected"]
    assert not check["passed"]
    assert "hello of role spare 0 of 1 time(s)" in json.dumps(record), check
