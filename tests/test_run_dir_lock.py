"""A run folder belongs to one run at a time.

Two runs given the same ``--run-dir`` emptied each other's folder: one of them failed
(exit 1) or ended in a harness error (exit 3), and one record was lost. The second run
must say another run holds the folder and exit 2, touching nothing of the first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import quick_scenario


def _start(scenario: Path, run_dir: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenario),
                             "--run-dir", str(run_dir), "--json", str(out), "--plain"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
def test_a_second_run_in_a_held_run_folder_is_refused(tmp_path: Path) -> None:
    scenario = tmp_path / "held.yaml"
    # The first run's job lasts until the second has been answered, however slow the
    # machine (a fixed length once ended before a starved second run got to the folder).
    release = tmp_path / "release"
    text = quick_scenario("held", "expect: {completes: true}\n", duration=60.0)
    held = text.replace('JOB_DURATION: "60.0"}', f'JOB_DURATION: "60.0", JOB_UNTIL: "{release}"}}')
    assert held != text
    scenario.write_text(held)
    runs = tmp_path / "runs"
    first = _start(scenario, runs, tmp_path / "first.json")
    events = runs / "held" / "events.jsonl"
    deadline = time.monotonic() + 60
    while not (events.exists() and b'"step"' in events.read_bytes()):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first run never started its job"
        time.sleep(0.05)
    before = events.read_bytes()
    second = subprocess.run([sys.executable, "-m", "aftershock", "run", str(scenario),
                             "--run-dir", str(runs), "--json", str(tmp_path / "second.json"),
                             "--plain"], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert "another run" in second.stderr
    assert str(runs / "held") in second.stderr
    assert "Traceback" not in second.stderr
    # Nothing of the first run was touched: its timeline only grew.
    assert events.read_bytes().startswith(before)
    release.touch()
    out, err = first.communicate(timeout=90)
    assert first.returncode == 0, out + err
    (record,) = json.loads((tmp_path / "first.json").read_text())
    assert record["passed"]
    assert record["run_dir"] == str(runs / "held")
    # Once the first has ended, the folder is free again.
    third = subprocess.run([sys.executable, "-m", "aftershock", "run", str(scenario),
                            "--run-dir", str(runs), "--plain"], capture_output=True,
                           text=True, timeout=90)
    assert third.returncode == 0, third.stdout + third.stderr
