"""``hot_spare`` across nodes: the controller on node 0 fences a member of node 1 through its
heartbeat counter, never by a pid that names a process of node 0's own PID namespace; and the
shipped scenario (scenarios/nodes/kill_node_hot_spare.yaml) catches a broken trainer.

The first test is the controller alone on a hand-written timeline (a real in-memory store,
real processes, the clock in the test's hands; no engine). The others run the shipped
scenario on a real engine against a deliberately broken trainer (tests/broken/): the passing
side of each pair is the shipped scenario itself (tests/test_shipped_scenarios.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch.distributed as dist
from _broken import checks, run_broken
from _helpers import ROOT, killed, read_events

from aftershock.reference_impl import controller
from aftershock.reference_impl.trainer import TrainConfig

SCENARIO = ROOT / "scenarios" / "nodes" / "kill_node_hot_spare.yaml"
T = 3.0  # collective timeout, and so the heartbeat timeout
ELSEWHERE = "node1/4026531836"  # another node's host_id(): its pids are not this host's


def _bug(name: str) -> Any:
    """One broken variant's patch from tests/broken/sitecustomize.py, loaded as a module of
    its own (no import hook is installed: the bug variable is unset here)."""
    path = ROOT / "tests" / "broken" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("_broken_variants", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BUGS[name][1]


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("broken", [False, True], ids=["fixed", "fence_by_pid"])
def test_a_silent_member_on_another_node_is_fenced_by_its_heartbeat_not_by_pid(
        broken: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sleepers: list[subprocess.Popen[bytes]]) -> None:
    """2 replicas, one per node, and a spare on node 0 (slot 1, ``--first-spare=1``): node 1
    dies, so its member falls silent and no supervisor reports it. The process of node 0
    that happens to have the dead member's pid must live on; the member's heartbeat counter
    says it is fenced; the spare takes its rank. The broken variant (the single-host fence,
    SIGKILL by pid) kills that bystander."""
    if broken:
        monkeypatch.setattr(controller.Controller, "fence", controller.Controller.fence)
        _bug("fence_by_pid")(controller)
    now = [1000.0]
    monkeypatch.setattr(controller, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: None))
    monkeypatch.setenv("AFTERSHOCK_EVENTS", str(tmp_path / "events.jsonl"))
    cfg = TrainConfig(replicas=2, shards=1, recovery="hot_spare", spares=1, first_spare=1,
                      collective_timeout=T)
    store = dist.HashStore()
    ctl = controller.Controller(cfg, store, 3)
    for slot, host in ((0, ctl.host), (1, ctl.host), (2, ELSEWHERE)):
        sleepers.append(subprocess.Popen(["sleep", "120"]))
        # Slot 2's pid is node 1's; here it names the bystander, a process of node 0.
        ctl.handle({"type": "ready", "slot": slot, "inc": 1, "pid": sleepers[-1].pid,
                    "host": host})
    assert ctl.plan is not None
    assert ctl.plan["members"] == {"0": (0, 1), "1": (2, 1)}, "the spare is slot 1"
    assert ctl.plan["spares"] == [1]
    bystander = sleepers[2]
    for _ in range(int(2 * T / 0.02)):
        for slot in (0, 1):  # node 1 died: slot 2 beats no more
            store.add(f"hb/{slot}/1", 1)
        now[0] += 0.02
        ctl.check_heartbeats()
    assert ctl.gen == 1
    assert ctl.plan["members"] == {"0": (0, 1), "1": (1, 1)}
    assert not killed(sleepers[0])
    assert killed(bystander) == broken
    if not broken:
        assert int(store.get("hb/2/1")) == controller.FENCED


def test_the_default_spares_follow_every_rank() -> None:
    """Without ``--first-spare`` the single-host layout is unchanged: ranks in slots
    0..world-1, spares after them."""
    cfg = TrainConfig(replicas=2, shards=2, recovery="hot_spare", spares=2)
    assert [controller.rank_slot(cfg, r) for r in range(4)] == [0, 1, 2, 3]
    assert [s for s in range(6) if controller.is_spare_slot(cfg, s)] == [4, 5]
    placed = TrainConfig(replicas=2, shards=2, recovery="hot_spare", spares=2, first_spare=2)
    assert [controller.rank_slot(placed, r) for r in range(4)] == [0, 1, 4, 5]
    assert [s for s in range(6) if controller.is_spare_slot(placed, s)] == [2, 3]


# A whole shipped node scenario per broken trainer (11-33 s each): with the scenario sweep.
@pytest.mark.scenarios
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("bug", "extra"), [
    # The replacement on node 0 loads a state one step old on top of its live peer's.
    # Fingerprints off: the parameter comparison alone must catch it.
    ("stale_snapshot", ("--fingerprint-every=0",)),
    # The controller fences node 1's silent member by its pid, in node 0's namespace.
    ("fence_by_pid", ()),
])
def test_the_node_scenario_catches_a_broken_hot_spare(
        bug: str, extra: tuple[str, ...], engine: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, shared_cache: Path) -> None:
    result = run_broken(SCENARIO, tmp_path / "run", monkeypatch, shared_cache, bug=bug,
                        extra_args=extra)
    found = checks(result)
    assert found["faults_injected"].passed, found["faults_injected"].message
    assert not result.passed
    events = tmp_path / "run" / "events.jsonl"
    if bug == "stale_snapshot":
        # The recovery itself looked perfect: complete, fast, nothing recomputed.
        for name in ("completes", "time_to_detect", "time_to_recover", "lost_steps"):
            assert found[name].passed, found[name].message
        assert not found["params_match"].passed
        assert "parameters differ" in found["params_match"].message
    else:
        # The controller's SIGKILL hit node 0's own processes: the job restarts.
        assert not all(found[n].passed for n in ("completes", "lost_steps", "single_history"))
        assert read_events(events, "failure_detected")


@pytest.mark.parametrize(("codes", "loss_ok", "job"), [
    ((0, 137), True, 0),  # node 1 died and stays down; node 0 finished the job
    ((1, 137), True, 1),  # ... and node 0 failed: the job failed
    ((137, 137), True, 137),  # every node died: nobody finished it
    ((0, 137), False, 137),  # restart: a dead node is the job's failure
    ((0, 1), True, 1),  # node 1's launcher failed (not a lost node)
])
def test_a_node_lost_for_good_fails_the_job_only_where_no_spare_covers_it(
        codes: tuple[int, int], loss_ok: bool, job: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aftershock.harness.nodes.cluster import Cluster, NodeState

    cluster = Cluster(run_id="x", run_dir=tmp_path, nodes=2, env={}, cwd=tmp_path,
                      restart="no", node_loss_ok=loss_ok)
    states = [NodeState(i, f"c{i}", "exited", code, 0, 0) for i, code in enumerate(codes)]
    monkeypatch.setattr(cluster, "states", lambda: states)
    assert cluster.poll() == job
