"""A run of a Slurm job (`system: {slurm: ...}`) that ends early leaves nothing in the
queue: interrupted (Ctrl-C), or the harness killed (its reaper cancels the job), or the
harness and its reaper killed (`aftershock heal` cancels it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _slurm_run import Harness

from aftershock.faults import slurm_cli as _slurm
from aftershock.harness.nodes.slurm_target import STOP_BUDGET_S

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
SLEEPER = """\
name: slurm-sleeper
system:
  slurm: {nodes: 2, ntasks_per_node: 1, command: [sleep, "300"]}
  timeout: 4m
"""


def _queued(name: str) -> list[str]:
    """The jobs named ``name`` (one run's) queued, running or ending, as ``<id> <state>``:
    the cluster is shared, and other runs' jobs are none of this test's business."""
    return [" ".join(pair) for pair in _slurm.live_states(name)]


def _cancelled(job_id: str) -> None:
    """Slurm cancelled it (scancel), rather than its processes being killed on the nodes
    (which a heal on a site's cluster could not do)."""
    record = _slurm.show_job(job_id)
    assert record is not None
    assert record["JobState"] == "CANCELLED", record


def _running(harness: Harness) -> tuple[str, str]:
    """(job id, name) of the harness's job once Slurm runs it."""
    submitted = harness.submitted(timeout=90)
    job_id, name = submitted["job_id"], submitted["name"]
    deadline = time.monotonic() + 90
    while (_slurm.show_job(job_id) or {}).get("JobState") != "RUNNING":
        assert harness.proc.poll() is None, harness.evidence("the harness ended before its "
                                                             "job ran")
        assert time.monotonic() < deadline, harness.evidence("the job did not run within 90 s")
        time.sleep(0.2)
    return job_id, name


@pytest.mark.parametrize("how", ["sigint", "harness-killed", "harness-and-reaper-killed"])
def test_a_run_that_ends_early_leaves_no_job_in_the_queue(
        test_cluster: None, tmp_path: Path, how: str) -> None:
    scenario = tmp_path / "sleeper.yaml"
    scenario.write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    harness = Harness.start(scenario, tmp_path / "r", env)
    try:
        job_id, name = _running(harness)
        if how == "sigint":
            harness.proc.send_signal(signal.SIGINT)
            # The stop's bound (slurm_target.STOP_BUDGET_S) and the rest of the teardown.
            try:
                code = harness.proc.wait(timeout=STOP_BUDGET_S + 60)
            except subprocess.TimeoutExpired:
                pytest.fail(harness.evidence(f"the harness was still running "
                                             f"{STOP_BUDGET_S + 60:g}s after SIGINT"))
            assert code == 130, harness.evidence(f"exit {code} after SIGINT")
            assert _queued(name) == [], harness.evidence("a job left in the queue")
            _cancelled(job_id)
            return
        if how == "harness-and-reaper-killed":
            from _helpers import reaper_of

            watcher = reaper_of(harness.proc.pid)
            assert watcher is not None, "no reaper"
            os.kill(watcher, signal.SIGKILL)
        harness.proc.kill()
        harness.proc.wait(timeout=30)
        if how == "harness-and-reaper-killed":
            time.sleep(1)
            assert _queued(name), "the job was cancelled with no one to cancel it"
            healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=120)
            assert healed.returncode == 0, healed.stdout + healed.stderr
        deadline = time.monotonic() + 90
        while _queued(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _queued(name) == [], harness.evidence("a job left in the queue")
        _cancelled(job_id)
        journals = Path(os.environ["AFTERSHOCK_STATE_DIR"]) / "journal"
        deadline = time.monotonic() + 30
        while list(journals.glob("*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(journals.glob("*.jsonl")), "the heal journal was not closed"
    finally:
        harness.stop()
        subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120, check=False)


def _slow_slurm(folder: Path) -> Path:
    """A folder of Slurm commands as an overloaded or unreachable slurmctld makes them: an
    ``scancel`` that is accepted but ends nothing, and an ``squeue`` that answers (the real
    one's answer) only after 25 s, each call."""
    folder.mkdir()
    real = shutil.which("squeue")
    assert real is not None
    (folder / "scancel").write_text("#!/bin/sh\nexit 0\n")
    (folder / "squeue").write_text(f"#!/bin/sh\nsleep 25\nexec {real} \"$@\"\n")
    for program in ("scancel", "squeue"):
        (folder / program).chmod(0o755)
    return folder


def test_a_sigint_ends_the_harness_in_bounded_time_when_slurm_does_not_end_the_job(
        test_cluster: None, tmp_path: Path) -> None:
    """Slurm accepts the cancel but the job stays (a node that does not answer, KillWait...),
    and every squeue takes 25 s: the harness still ends within its stop's bound after
    SIGINT, says which job it left, and `aftershock heal` (with Slurm answering again)
    cancels it."""
    scenario = tmp_path / "sleeper.yaml"
    scenario.write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    slow = {**env, "PATH": f"{_slow_slurm(tmp_path / 'bin')}:{env['PATH']}"}
    harness = Harness.start(scenario, tmp_path / "r", slow)
    try:
        job_id, name = _running(harness)
        harness.proc.send_signal(signal.SIGINT)
        began = time.monotonic()
        try:
            code = harness.proc.wait(timeout=STOP_BUDGET_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(harness.evidence(f"the harness was still running "
                                         f"{STOP_BUDGET_S + 30:g}s after SIGINT"))
        took = time.monotonic() - began
        said = harness.output_text()
        assert code == 130, harness.evidence(f"exit {code} after SIGINT")
        assert f"left behind, for `aftershock heal`: Slurm jobs named {name}" in said, \
            harness.evidence("the harness did not say what it left")
        left = [e for e in harness.events() if e.get("event") == "slurm_left"]
        assert left, harness.evidence("no slurm_left event")
        assert left[0]["jobs"] == [{"job_id": job_id, "state": "RUNNING"}], \
            harness.evidence("slurm_left does not name the job")
        # Still in the queue: RUNNING, or COMPLETING where the harness ended the job's
        # processes itself (the test cluster's share this host's kernel).
        assert [q.split()[0] for q in _queued(name)] == [job_id], f"{took:.0f}s"
        healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=120)
        assert healed.returncode == 0, healed.stdout + healed.stderr
        assert _queued(name) == []
    finally:
        harness.stop()
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
    harness = Harness.start(scenario, tmp_path / "r", env)
    try:
        name = harness.submitted(timeout=90)["name"]
        deadline = time.monotonic() + 90
        while "drain" not in _node_states().get("node1", ""):
            assert harness.proc.poll() is None, harness.evidence("the harness ended before "
                                                                 "the node was drained")
            assert time.monotonic() < deadline, harness.evidence("node1 was not drained "
                                                                 "within 90 s")
            time.sleep(0.2)
        harness.proc.kill()
        harness.proc.wait(timeout=30)
        deadline = time.monotonic() + 90
        while (_queued(name) or "drain" in _node_states()["node1"]) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert _queued(name) == [], harness.evidence("a job left in the queue")
        assert _node_states()["node1"] == "idle", _node_states()
    finally:
        harness.stop()
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
    events = (Path(result.run_dir) / "events.jsonl").read_text().splitlines()
    (submitted,) = [e for e in map(json.loads, events) if e.get("event") == "slurm_submitted"]
    assert _queued(submitted["name"]) == []
