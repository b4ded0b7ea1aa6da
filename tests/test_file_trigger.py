"""`at: {file: ..., when: ...}` end to end: a job that knows nothing about Aftershock is hit
the moment its own file operation happens (inotify), not at the next poll of the timeline."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, read_events

from harness.runner import run_scenario
from harness.spec import LoadedScenario, parse_scenario

JOB = ROOT / "tests" / "fixtures" / "files_job.py"

pytestmark = pytest.mark.timeout(120)


def run(tmp_path: Path, faults: str, steps: int = 20) -> tuple[Path, dict[str, bool]]:
    text = f"""\
name: file-trigger
system:
  command: [{sys.executable}, {JOB}]
  env: {{JOB_OUT: "${{run_dir}}/out", JOB_STEPS: "{steps}"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
{faults}
expect:
  completes: false
"""
    loaded = LoadedScenario(parse_scenario(text), tmp_path / "s.yaml", text)
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    return tmp_path / "run", {c.name: c.passed for c in result.checks}


def began(run_dir: Path) -> dict[int, float]:
    """step -> when the job says it began the step's file operations (its monotonic clock,
    the harness's too)."""
    text = (run_dir / "logs" / "launcher.stdout.log").read_text()
    return {int(s): float(t) for s, t in re.findall(r"step (\d+) at ([\d.]+)", text)}


def test_a_kill_lands_within_milliseconds_of_the_file(tmp_path: Path) -> None:
    run_dir, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/step_*/data', when: created, count: 3}
""")
    assert checks["faults_injected"]
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file"] == "out/step_3/data"
    times = began(run_dir)
    # The kill follows the job's third rename, before the job begins its fourth step (200 ms
    # later): the harness waits on the inotify descriptor, not for its next tick.
    assert max(times) == 3
    assert times[3] < hit["t"] < times[3] + 0.2


def test_closed_counts_files_closed_after_writing(tmp_path: Path) -> None:
    """In a folder that is watched when the file is closed (see faults/_inotify.py for
    folders made a moment before)."""
    run_dir, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/latest', when: closed, count: 3}
""")
    assert checks["faults_injected"]
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file"] == "out/latest"
    assert max(began(run_dir)) == 3  # killed right after its third rewrite


def test_a_file_that_never_appears_fails_the_run(tmp_path: Path) -> None:
    _, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/step_*/COMMIT'}
""", steps=3)
    assert checks["faults_injected"] is False
