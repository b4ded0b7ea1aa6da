"""A run of a Slurm job (`system: {slurm: ...}`) that ends early leaves nothing in the
queue: interrupted (Ctrl-C), or the harness killed (its reaper cancels the job), or the
harness and its reaper killed (`aftershock heal` cancels it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aftershock.faults import slurm_cli as _slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
SLEEPER = """\
name: slurm-sleeper
system:
  slurm: {nodes: 2, ntasks_per_node: 1, command: [sleep, "300"]}
  timeout: 4m
"""


def _ours() -> list[str]:
    """Run jobs (``aftershock-<run id> <job id> <state>``) queued or running."""
    text = _slurm.run(["squeue", "--noheader", "--format=%j %i %T"])
    return [line for line in text.splitlines() if line.startswith(_slurm.JOB_PREFIX)]


def _cancelled(job_id: str) -> None:
    """Slurm cancelled it (scancel), rather than its processes being killed on the nodes
    (which a heal on a site's cluster could not do)."""
    record = _slurm.show_job(job_id)
    assert record is not None
    assert record["JobState"] == "CANCELLED", record


@pytest.mark.parametrize("how", ["sigint", "harness-killed", "harness-and-reaper-killed"])
def test_a_run_that_ends_early_leaves_no_job_in_the_queue(
        test_cluster: None, tmp_path: Path, how: str) -> None:
    scenario = tmp_path / "sleeper.yaml"
    scenario.write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    harness = subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenario),
                                "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (running := [j for j in _ours() if j.endswith(" RUNNING")]):
            assert harness.poll() is None, "the harness ended before its job ran"
            assert time.monotonic() < deadline, "the job did not run within 90 s"
            time.sleep(0.2)
        job_id = running[0].split()[1]
        if how == "sigint":
            harness.send_signal(signal.SIGINT)
            assert harness.wait(timeout=120) == 130
            assert _ours() == []
            _cancelled(job_id)
            return
        if how == "harness-and-reaper-killed":
            from _helpers import reaper_of

            watcher = reaper_of(harness.pid)
            assert watcher is not None, "no reaper"
            os.kill(watcher, signal.SIGKILL)
        harness.kill()
        harness.wait(timeout=30)
        if how == "harness-and-reaper-killed":
            time.sleep(1)
            assert _ours(), "the job was cancelled with no one to cancel it"
            healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=120)
            assert healed.returncode == 0, healed.stdout + healed.stderr
        deadline = time.monotonic() + 90
        while _ours() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours() == []
        _cancelled(job_id)
        journals = Path(os.environ["AFTERSHOCK_STATE_DIR"]) / "journal"
        deadline = time.monotonic() + 30
        while list(journals.glob("*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(journals.glob("*.jsonl")), "the heal journal was not closed"
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)
        subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120, check=False)


DRAINER = """\
name: slurm-drainer
system:
  slurm: {nodes: 2, ntasks_per_node: 1, command: [sleep, "300"]}
  timeout: 4m
faults:
  - kind: slurm.node_down
    target: {node: 1}
    at: {time: 1s}
    state: drain
"""


def _node_states() -> dict[str, str]:
    text = _slurm.run(["sinfo", "--noheader", "--Node", "--format=%N %T"])
    return dict(line.split() for line in text.splitlines() if line.strip())


def test_a_killed_harness_leaves_no_node_drained(test_cluster: None, tmp_path: Path) -> None:
    """The harness is SIGKILLed with node 1 DRAINed by its fault and the job running: its
    reaper RESUMEs the node and cancels the job."""
    scenario = tmp_path / "drainer.yaml"
    scenario.write_text(DRAINER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    harness = subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenario),
                                "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while "drain" not in _node_states().get("node1", ""):
            assert harness.poll() is None, "the harness ended before the node was drained"
            assert time.monotonic() < deadline, "node1 was not drained within 90 s"
            time.sleep(0.2)
        harness.kill()
        harness.wait(timeout=30)
        deadline = time.monotonic() + 90
        while (_ours() or "drain" in _node_states()["node1"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours() == []
        assert _node_states()["node1"] == "idle", _node_states()
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)
        subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120, check=False)


SIGNALLED = """\
name: slurm-signalled
system:
  slurm:
    nodes: 2
    ntasks_per_node: 1
    command: [PYTHON, -c, "import os, signal, sys, time; signal.signal(signal.SIGUSR1, \
lambda *_: sys.exit(0)); open(os.path.join(os.environ['AFTERSHOCK_OUTPUT_DIR'], 'ready.' \
+ os.environ['SLURM_PROCID']), 'w').close(); time.sleep(120); sys.exit(3)"]
  timeout: 3m
faults:
  - kind: slurm.signal
    target: {node: 1}
    at: {file: output/ready.*, count: 2}
    signal: SIGUSR1
expect:
  completes: true
"""


def test_slurm_signal_reaches_every_task_of_the_job(test_cluster: None, tmp_path: Path) -> None:
    """Each task exits 0 on SIGUSR1 and 3 after two minutes without it; the signal is sent
    once both have their handler (each then writes output/ready.<task>): the job completes
    only if Slurm delivered it to the tasks on both nodes."""
    from aftershock.harness import api

    scenario = tmp_path / "signalled.yaml"
    scenario.write_text(SIGNALLED.replace("PYTHON", sys.executable))
    result = api.check(api.run(scenario, run_dir=tmp_path / "r", use_cache=False))
    assert result.passed
    assert _ours() == []
