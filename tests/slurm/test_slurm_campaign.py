"""``aftershock run --executor slurm``: each run of a campaign as a task of one Slurm array
job gives the verdicts a local run gives (harness/nodes/slurm_campaign.py), and a harness
killed mid-campaign leaves nothing behind: no job in the queue, no node DOWN or DRAINed,
no container of its runs, and ``aftershock heal`` says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import slurm_cli as _slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
# Two small runs with different verdicts: a job that completes, and one that is killed by its
# fault (completes fails, the fault's own checks pass).
PASSING = """\
name: campaign-passes
system:
  command: [PYTHON, -c, "import time; time.sleep(1)"]
  timeout: 1m
expect:
  completes: true
"""
KILLED = """\
name: campaign-killed
system:
  command: [PYTHON, -c, "import time; time.sleep(60)"]
  timeout: 2m
faults:
  - kind: process.kill
    target: {role: launcher}
    at: {time: 1s}
    signal: SIGKILL
expect:
  completes: true
"""
SLEEPER = """\
name: campaign-sleeper-NAME
system:
  command: [sleep, "317"]
  timeout: 6m
"""


def _aftershock(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aftershock", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _verdicts(record: Path) -> list[tuple[str, bool, list[str]]]:
    runs: list[dict[str, Any]] = json.loads(record.read_text())
    return [(r["name"], r["passed"], sorted(c["name"] for c in r["checks"] if not c["passed"]))
            for r in runs]


def test_a_campaign_on_slurm_gives_the_local_verdicts(test_cluster: None,
                                                      tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "a_passes.yaml").write_text(PASSING.replace("PYTHON", sys.executable))
    (scenarios / "b_killed.yaml").write_text(KILLED.replace("PYTHON", sys.executable))
    here = _aftershock("run", str(scenarios), "--run-dir", str(tmp_path / "local"),
                       "--json", str(tmp_path / "local.json"), "--plain")
    there = _aftershock("run", str(scenarios), "--executor", "slurm", "--run-dir",
                        str(tmp_path / "slurm"), "--json", str(tmp_path / "slurm.json"),
                        "--junit", str(tmp_path / "slurm.xml"), "--plain")
    assert here.returncode == there.returncode == 1, here.stderr + there.stdout + there.stderr
    local = _verdicts(tmp_path / "local.json")
    assert local == [("campaign-passes", True, []), ("campaign-killed", False, ["completes"])]
    assert _verdicts(tmp_path / "slurm.json") == local
    assert "array job" in there.stdout
    assert 'tests="2"' in (tmp_path / "slurm.xml").read_text()
    # Each run ran as a task of the array job, which Slurm no longer has queued.
    assert len(list((tmp_path / "slurm").glob("slurm-*_*.out"))) == 2
    assert not [j for j in _ours() if j.startswith(_array_name(there.stdout))]


def _array_name(said: str) -> str:
    """The array job's name, as the harness announced it: ``... array job N (NAME) ...``."""
    return said.split("array job ", 1)[1].split("(", 1)[1].split(")", 1)[0]


def _ours() -> list[str]:
    text = _slurm.run(["squeue", "--noheader", "--format=%j %i %T"])
    return [line for line in text.splitlines() if line.startswith(_slurm.JOB_PREFIX)]


def _node_states() -> dict[str, str]:
    text = _slurm.run(["sinfo", "--noheader", "--Node", "--format=%N %T"])
    return dict(line.split() for line in text.splitlines() if line.strip())


@pytest.mark.parametrize("how", ["harness-killed", "harness-and-reaper-killed"])
def test_a_harness_killed_mid_campaign_leaves_nothing_behind(
        test_cluster: None, tmp_path: Path, how: str) -> None:
    """The harness of a two-run campaign is SIGKILLed while both tasks run: its reaper, or
    else `aftershock heal`, cancels the array job; each task's own harness heals its run on
    Slurm's SIGTERM. Nothing is left: no job, no node DOWN or DRAINed, no container, and a
    heal afterwards finds nothing."""
    from _helpers import reaper_of

    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    for name in ("a", "b"):
        (scenarios / f"{name}.yaml").write_text(SLEEPER.replace("NAME", name))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = set(_slurm.run(["squeue", "--noheader", "--format=%j"]).split())
    harness = subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenarios),
                                "--executor", "slurm", "--run-dir", str(tmp_path / "c"),
                                "--plain"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        # Both tasks running, each with its own harness started (its run folder exists).
        while not (len([j for j in _ours() if j.endswith(" RUNNING")
                        and j.split()[0] not in before]) == 2
                   and len(list((tmp_path / "c").glob("*/campaign-sleeper-*/events.jsonl")))
                   == 2):
            assert harness.poll() is None, "the harness ended before its tasks ran"
            assert time.monotonic() < deadline, "the tasks did not run within 90 s"
            time.sleep(0.2)
        (name,) = {j.split()[0] for j in _ours()} - before
        if how == "harness-and-reaper-killed":
            watcher = reaper_of(harness.pid)
            assert watcher is not None, "no reaper"
            os.kill(watcher, signal.SIGKILL)
        harness.kill()
        harness.wait(timeout=30)
        if how == "harness-and-reaper-killed":
            time.sleep(1)
            assert [j for j in _ours() if j.startswith(name)], "cancelled with no one to do it"
            healed = _aftershock("heal", timeout=180)
            assert healed.returncode == 0, healed.stdout + healed.stderr
            assert "undone" in healed.stdout, healed.stdout
        deadline = time.monotonic() + 90
        while [j for j in _ours() if j.startswith(name)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [j for j in _ours() if j.startswith(name)]
        states = _node_states()
        assert not [n for n, s in states.items() if "down" in s or "drain" in s], states
        labels = subprocess.run(["docker", "ps", "-a", "--format", '{{.Label "aftershock.run"}}'],
                                capture_output=True, text=True, timeout=60, check=True)
        assert name.removeprefix(_slurm.JOB_PREFIX) not in labels.stdout.split()
        assert not subprocess.run(["pgrep", "-f", "sleep 317"], capture_output=True,
                                  check=False).stdout, "a task's job outlived the cancel"
        again = _aftershock("heal", timeout=180)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "nothing was left behind" in again.stdout, again.stdout
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)
        _aftershock("heal", timeout=180)
