"""Exit codes and records when the harness itself fails: never exit 1 (which says a check
failed), always a one-line message, the traceback kept, and the run still on record.

The harness is broken on purpose by tests/fixtures/broken_harness/sitecustomize.py, which
only this module puts on the harness's PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from _helpers import ROOT, quick_scenario, read_events

BROKEN = ROOT / "tests" / "fixtures" / "broken_harness"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def run(tmp_path: Path, scenario: str, *, broken: str = "",
        extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "scenario.yaml"
    path.write_text(scenario)
    env = {**os.environ, "PYTHONPATH": f"{BROKEN}{os.pathsep}{ROOT}",
           "AFTERSHOCK_TEST_BREAK": broken, "AFTERSHOCK_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "aftershock", "run", str(path), "--run-dir", str(tmp_path / "runs"),
         "--plain", "--json", str(tmp_path / "out.json"), "--junit", str(tmp_path / "out.xml"),
         *extra],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)


def records(tmp_path: Path, name: str) -> dict[str, object]:
    """The run's result.json, checked to equal its --json record and to be a JUnit error."""
    record = json.loads((tmp_path / "runs" / name / "result.json").read_text())
    assert json.loads((tmp_path / "out.json").read_text()) == [record]
    (case,) = ET.parse(tmp_path / "out.xml").getroot().iter("testcase")
    (error,) = case.iter("error")
    assert error.get("type") == "HarnessError"
    assert record["passed"] is False
    assert record["interrupted"] is False
    return dict(record)


def message(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr  # one line, no traceback on the terminal
    return lines[0]


def test_a_bug_in_the_harness_exits_3_with_the_traceback_kept(tmp_path: Path) -> None:
    done = run(tmp_path, quick_scenario("buggy", "expect: {completes: true}"), broken="metrics")
    assert done.returncode == 3, done.stdout + done.stderr
    line = message(done)
    assert line.startswith("aftershock: harness error: unexpected ZeroDivisionError: "
                           "broken on purpose")
    trace = tmp_path / "runs" / "buggy" / "harness_error.txt"
    assert f"(traceback: {trace})" in line
    assert "Traceback" in trace.read_text()
    assert "ZeroDivisionError" in trace.read_text()
    record = records(tmp_path, "buggy")
    assert "ZeroDivisionError" in str(record["error"])
    # The run itself happened and was torn down as usual.
    assert read_events(tmp_path / "runs" / "buggy" / "events.jsonl", "run_end")


def test_fault_unavailable_outside_a_fault_exits_3(tmp_path: Path) -> None:
    done = run(tmp_path, quick_scenario("unavailable", "expect: {completes: true}"),
               broken="heal")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FaultUnavailable: broken on purpose" in message(done)
    records(tmp_path, "unavailable")


PARTITION = """\
faults:
  - kind: net.partition
    target: {rank: 1}
    at: {step: 3}
expect: {completes: true}
"""


def test_a_missing_tool_fails_before_launch_with_the_install_hint(tmp_path: Path) -> None:
    done = run(tmp_path, quick_scenario("no-nft", PARTITION, duration=30), broken="no-nft")
    assert done.returncode == 3, done.stdout + done.stderr
    line = message(done)
    assert "fault 0 (net.partition): nft not installed: apt-get install nftables" in line
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "no-nft" / "harness_error.txt").exists()  # no bug
    record = records(tmp_path, "no-nft")
    assert "apt-get install nftables" in str(record["error"])
    # Refused before launching anything: no timeline, no 30 s job.
    assert not (tmp_path / "runs" / "no-nft" / "events.jsonl").exists()
    assert float(str(record["duration_s"])) < 5


def test_a_missing_working_directory_is_named(tmp_path: Path) -> None:
    scenario = quick_scenario("no-cwd", "expect: {completes: true}").replace(
        "  env:", "  cwd: not-there\n  env:")
    done = run(tmp_path, scenario)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"working directory {str(tmp_path / 'not-there')!r} does not exist" in message(done)
    records(tmp_path, "no-cwd")


def test_plain_output_shows_each_fault_healed_once(tmp_path: Path) -> None:
    """One fault healed after its duration, one at the end of the run (which it never
    finishes: a frozen rank holds it up until the time limit)."""
    freeze = """\
  timeout: 3s
faults:
  - kind: process.freeze
    target: {rank: 1}
    at: {step: 3}
    duration: 200ms
  - kind: process.freeze
    target: {rank: 0}
    at: {step: 10}
expect: {completes: true}
"""
    scenario = quick_scenario("healed", "", duration=1.5).rstrip("\n") + "\n" + freeze
    done = run(tmp_path, scenario)
    assert done.returncode == 1, done.stdout + done.stderr  # timed out, as it must
    assert "FAULT process.freeze -> rank 1" in done.stdout
    assert "FAULT process.freeze -> rank 0" in done.stdout
    assert done.stdout.count("healed process.freeze") == 2, done.stdout
