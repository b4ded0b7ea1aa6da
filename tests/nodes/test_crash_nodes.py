"""A harness SIGKILLed while a node is paused and another is partitioned leaves nothing once its
reaper, or `aftershock heal`, is done: no container or network of the run, so no paused node
and no partition (the table lived in the removed node's network namespace).

The oracle asks the engine itself through the Docker SDK (containers and networks carrying
the run's label) and nft inside the node's namespace, never the heal code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import reaper_of

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "fixtures" / "node_harness.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _left(api: Any, run_id: str) -> list[str]:
    label = {"label": f"aftershock.run={run_id}"}
    # Listed while the reaper removes them: one gone before docker-py inspects it is gone.
    found = [f"container {c.short_id} ({c.status})"
             for c in api.containers.list(all=True, filters=label, ignore_removed=True)]
    return found + [f"network {n.name}" for n in api.networks.list(filters=label)]


def _tables_in(pid: int) -> str:
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "nft", "list", "tables"],
                          capture_output=True, text=True, check=False).stdout


@pytest.mark.parametrize("reaper", ["alive", "killed"])
def test_a_killed_harness_leaves_no_paused_or_partitioned_node(
        engine: None, tmp_path: Path, reaper: str) -> None:
    import docker

    api = docker.from_env()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    harness = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, text=True)
    run_id = ""
    try:
        assert harness.stdout is not None
        line = harness.stdout.readline()
        assert line.startswith("READY"), f"the stand-in harness failed: {line!r}"
        run_id = line.split()[1]
        label = {"label": f"aftershock.run={run_id}"}
        nodes = sorted(api.containers.list(filters=label),
                       key=lambda c: c.labels["aftershock.node"])
        # What the kill must leave to the reaper: a paused node, a partitioned one.
        assert [c.status for c in nodes] == ["paused", "running"]
        assert "aftershock_" in _tables_in(nodes[1].attrs["State"]["Pid"])
        watcher = reaper_of(harness.pid)
        assert watcher is not None, "no reaper"
        if reaper == "killed":
            os.kill(watcher, signal.SIGKILL)
        harness.kill()
        harness.wait(timeout=30)
        if reaper == "killed":
            time.sleep(0.5)
            assert len(_left(api, run_id)) == 3, "something was healed with no one to heal it"
            healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=90)
            assert healed.returncode == 0, healed.stdout + healed.stderr
        # The reaper removes the nodes first and its journal last: wait for both.
        journals = Path(os.environ["AFTERSHOCK_STATE_DIR"]) / "journal"
        deadline = time.monotonic() + 30
        while ((_left(api, run_id) or list(journals.glob("*.jsonl")))
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert _left(api, run_id) == []
        assert not list(journals.glob("*.jsonl"))
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)
        if harness.stdout is not None:
            harness.stdout.close()
        subprocess.run([sys.executable, "-m", "aftershock", "heal"], cwd=ROOT, env=env,
                       capture_output=True, timeout=90, check=False)
        api.close()


CRASH_SCENARIO = """\
name: crash-on-nodes
system:
  nodes: 2
  trainer: {steps: 1000, step_sleep: 50ms}
  restart: "no"
faults:
  - kind: node.freeze
    target: {node: 1}
    at: {time: 1s}
  - kind: node.partition
    target: {node: 0}
    at: {time: 1s}
"""


def test_aftershock_run_killed_on_nodes_leaves_nothing(engine: None, tmp_path: Path) -> None:
    """The same through `aftershock run` of a `nodes: 2` scenario: the harness is SIGKILLed
    once both node faults are applied; its reaper removes the run's containers and network."""
    import docker

    api = docker.from_env()
    scenario = tmp_path / "crash.yaml"
    scenario.write_text(CRASH_SCENARIO)
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AFTERSHOCK_STATE_DIR": str(state)}
    harness = subprocess.Popen([sys.executable, "-m", "aftershock", "run", str(scenario),
                                "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_id = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            journals = list((state / "journal").glob("*.jsonl"))
            timelines = list((tmp_path / "r").rglob("events.jsonl"))
            if journals and timelines and \
                    timelines[0].read_text().count('"event":"fault_injected"') == 2:
                run_id = journals[0].stem
                break
            assert harness.poll() is None, "the harness ended before both faults were applied"
            time.sleep(0.1)
        assert run_id is not None, "the faults were not applied within 60 s"
        labelled = {"label": f"aftershock.run={run_id}"}
        assert [c.status for c in api.containers.list(all=True, filters=labelled)].count(
            "paused") == 1
    finally:
        harness.send_signal(signal.SIGKILL)
        harness.wait()
    deadline = time.monotonic() + 60
    while _left(api, run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left(api, run_id) == []
