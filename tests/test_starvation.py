"""A latency verdict on a starved machine says the machine was starved.

At a load average of 20-35 on a 2-core machine, recovery budgets failed from load alone,
with messages that blamed the recovery. Each run now records how starved it was (the
harness's own timer slip, the CPU pressure of the machine and of the job's own cgroup),
and a latency check that fails on a starved machine says so; a correctness check never
does, and nor does a latency check that passed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aftershock.harness.run import _load
from aftershock.harness.run.records import Event
from aftershock.harness.run.runner import assess, run_scenario
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.verdict.checks import Outcome


def _sample(t: float, **fields: float) -> Event:
    return Event(t=t, event=_load.MACHINE_LOAD, source="harness",
                 fields={"window_s": 2.0, **fields})


def test_the_summary_weighs_each_window_and_keeps_the_worst_slip() -> None:
    events = [_sample(2, timer_slip_max_s=0.01, cpu_pressure=0.1, job_cpu_pressure=0.0),
              _sample(4, timer_slip_max_s=1.5, cpu_pressure=0.9, job_cpu_pressure=0.8)]
    assert _load.summary(events) == {"timer_slip_max_s": 1.5, "cpu_pressure": 0.5,
                                     "job_cpu_pressure": 0.4}
    assert _load.summary([]) == {"timer_slip_max_s": None, "cpu_pressure": None,
                                 "job_cpu_pressure": None}


SCENARIO = """\
name: starved
system:
  command: [python, -c, pass]
  world: 2
  probes:
    - {pattern: 'rank (?P<rank>\\\\d+) step (?P<step>\\\\d+)', event: step}
expect:
  completes: true
  step_rate: {min: 1000}
"""


def _judge(samples: list[Event]) -> dict[str, str]:
    spec = parse_scenario(SCENARIO)
    steps = [Event(t=1.0 + i * 0.5, event="step", source="log", fields={"step": i, "rank": r})
             for i in range(10) for r in (0, 1)]
    _, checks = assess(spec, events=sorted([*steps, *samples], key=lambda e: e.t),
                       outcome=Outcome(0, False, 6.0), faults=(), baseline=None,
                       baseline_outputs=None, baseline_note="")
    return {c.name: c.message for c in checks}


def test_a_missed_budget_on_a_starved_machine_says_so_and_only_then() -> None:
    starved = _judge([_sample(3, timer_slip_max_s=2.1, cpu_pressure=0.95,
                              job_cpu_pressure=0.89)])
    assert "the machine was starved" in starved["step_rate"]
    assert "timer slipped up to 2.1 s" in starved["step_rate"]
    assert "the job's processes waited for a CPU 89%" in starved["step_rate"]
    assert "starved" not in starved["completes"]  # correctness: never
    quiet = _judge([_sample(3, timer_slip_max_s=0.002, cpu_pressure=0.01,
                            job_cpu_pressure=0.0)])
    assert "starved" not in quiet["step_rate"]


BUSY_JOB = """\
import os, subprocess, sys, time
if os.environ.get("RANK") is None:
    ranks = [subprocess.Popen([sys.executable, __file__], env={**os.environ, "RANK": str(r)})
             for r in (0, 1)]
    sys.exit(max(p.wait() for p in ranks))
rank, end, step = os.environ["RANK"], time.monotonic() + 4, 0
while time.monotonic() < end:  # CPU-bound: a rank that always wants a core
    x = 0
    for i in range(200_000):
        x += i
    step += 1
    print(f"rank {rank} step {step}", flush=True)
"""


@pytest.mark.skipif(not _load.SYSTEM_PRESSURE.exists(), reason="no PSI (/proc/pressure/cpu) "
                    "on this kernel: CPU pressure cannot be measured")
@pytest.mark.timeout(120)
def test_a_run_beside_cpu_hogs_records_its_starvation(tmp_path: Path) -> None:
    """Three busy loops beside a CPU-bound 2-rank job on this machine: the job's processes
    wait for a CPU much of the time, and the run's record says so."""
    (tmp_path / "busy.py").write_text(BUSY_JOB)
    path = tmp_path / "starved.yaml"
    path.write_text(SCENARIO.replace("[python, -c, pass]", f"[{sys.executable}, busy.py]"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        result = run_scenario(load_scenario(path), run_dir=tmp_path / "run")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert f'"event":"{_load.MACHINE_LOAD}"' in events
    pressure = result.metrics["job_cpu_pressure"] or result.metrics["cpu_pressure"]
    assert pressure is not None
    assert pressure >= _load.STARVED_PRESSURE, result.metrics
    rate = next(c for c in result.checks if c.name == "step_rate")
    assert not rate.passed
    assert "the machine was starved" in rate.message
