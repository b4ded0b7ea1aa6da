"""node.kill, node.freeze, node.partition and node.restart on real containers of a real engine.

Each node runs udp_node.py, which sends a datagram to every other node every 50 ms and logs
what it hears (sender, CLOCK_MONOTONIC) in the shared folder: who heard whom, and when, is
the oracle, read from those files and from the engine and /proc, never from faults/node.py.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import _docker
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef, state
from aftershock.faults.heal import heal_journal
from aftershock.faults.journal import Journal
from aftershock.faults.node import FREEZE, KILL, PARTITION, RESTART

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _heard(cluster: Any, listener: int, sender: int | str, since: float,
           until: float | None = None) -> int:
    """How many lines ``listener`` logged from ``sender`` in [since, until): a node index for
    its UDP datagrams, ``t<index>`` for its TCP lines, ``reset`` for broken connections."""
    path = Path(cluster.run_dir) / f"recv-{listener}.log"
    if not path.exists():
        return 0
    count = 0
    for line in path.read_text().splitlines():
        who, _, when = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            t = float(when)
            if who.split()[0] == str(sender) and t >= since and (until is None or t < until):
                count += 1
    return count


def _wait(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _talking(cluster: Any) -> None:
    """Every node hears every other one (the agents are up)."""
    now = time.monotonic()
    assert _wait(lambda: all(_heard(cluster, a, b, now) >= 2 for a in range(cluster.nodes)
                             for b in range(cluster.nodes) if a != b)), "nodes never talked"


def _journal(cluster: Any) -> Journal:
    return Journal.create(cluster.run_id, folders=[cluster.run_dir])


def _agent(cluster: Any, index: int) -> ProcessRef:
    """A process inside node ``index``: the fault's target, as a rank would be."""
    refs = cluster.processes(index)
    assert refs, f"node {index} has no process"
    return refs[-1]


def test_freeze_stops_every_process_of_the_node_until_reverted(udp_nodes: Any) -> None:
    cluster = udp_nodes()
    _talking(cluster)
    journal = _journal(cluster)
    applied = FREEZE.inject(_agent(cluster, 0), {}, journal)
    frozen_at = time.monotonic()
    time.sleep(1.0)
    assert _docker.inspect(cluster.api, cluster.containers[0]).status == "paused"  # type: ignore[union-attr]
    # The cgroup freezer, not a signal: no process of the node is running or stopped (T).
    assert all(state(r.pid) not in ("R", "T") for r in cluster.processes(0))
    assert _heard(cluster, 1, 0, frozen_at + 0.3) == 0, "a frozen node kept sending"
    assert _heard(cluster, 0, 1, frozen_at + 0.3) == 0, "a frozen node kept receiving"
    FREEZE.revert(applied.undo)
    journal.done(str(applied.journal_id))
    thawed = time.monotonic()
    assert _wait(lambda: _heard(cluster, 1, 0, thawed) >= 2), "node 0 never came back"


@pytest.mark.parametrize(("direction", "node0_hears", "node1_hears"), [
    ("both", False, False), ("in", False, True), ("out", True, False)])
def test_partition_cuts_the_node_off_in_the_given_direction(
        udp_nodes: Any, direction: str, node0_hears: bool, node1_hears: bool) -> None:
    cluster = udp_nodes()
    _talking(cluster)
    journal = _journal(cluster)
    applied = PARTITION.inject(_agent(cluster, 0), {"direction": direction}, journal)
    cut = time.monotonic()
    time.sleep(1.0)
    during = (_heard(cluster, 0, 1, cut + 0.2), _heard(cluster, 1, 0, cut + 0.2))
    assert (during[0] > 0, during[1] > 0) == (node0_hears, node1_hears), during
    # Node 0's own processes still reach each other over its loopback: not a dead host.
    assert _agent(cluster, 0).alive()
    PARTITION.revert(applied.undo)
    journal.done(str(applied.journal_id))
    healed = time.monotonic()
    assert _wait(lambda: _heard(cluster, 0, 1, healed) >= 2 and _heard(cluster, 1, 0, healed) >= 2)


def test_kill_ends_the_node_and_its_restart_policy_brings_it_back(udp_nodes: Any) -> None:
    cluster = udp_nodes(restart="on-failure", max_restarts=2)
    _talking(cluster)
    before = _docker.inspect(cluster.api, cluster.containers[1])
    assert before is not None
    victims = cluster.processes(1)
    applied = KILL.inject(_agent(cluster, 1), {}, _journal(cluster))
    assert "SIGKILL" in applied.detail
    # Every process of the node died at once, as with a host that lost power.
    assert _wait(lambda: not any(r.alive() for r in victims), 10)
    # "running" alone may still be the state from before the death (the engine had not
    # seen it yet under load): wait for the restart itself.
    seen: list[Any] = []

    def restarted() -> bool:
        state = _docker.inspect(cluster.api, cluster.containers[1])
        seen.append(state)
        return (state is not None and state.status == "running"
                and state.restarts > before.restarts)

    assert _wait(restarted, 20), seen[-1:]
    back = seen[-1]
    assert back.restarts == before.restarts + 1
    assert back.pid != before.pid
    again = time.monotonic()
    assert _wait(lambda: _heard(cluster, 0, 1, again) >= 2), "node 1 never came back"


def test_restart_reboots_the_node_at_the_same_address(udp_nodes: Any) -> None:
    cluster = udp_nodes()
    _talking(cluster)
    before = _docker.inspect(cluster.api, cluster.containers[1])
    assert before is not None
    RESTART.inject(_agent(cluster, 1), {}, _journal(cluster))
    after = _docker.inspect(cluster.api, cluster.containers[1])
    assert after is not None
    assert after.status == "running"
    assert after.pid != before.pid
    again = time.monotonic()
    # Node 0 sends to node 1's old address: hearing it proves the address is the same.
    assert _wait(lambda: _heard(cluster, 1, 0, again) >= 2)


def test_a_pid_inside_a_node_maps_to_its_host_process(udp_nodes: Any) -> None:
    """Events from a node carry the pid its own PID namespace gives (1 is the node's init);
    the cluster finds the host's process for it, and no other node's."""
    cluster = udp_nodes()
    init = _docker.inspect(cluster.api, cluster.containers[1])
    assert init is not None
    found = cluster.host_process(1, 1)
    assert found is not None
    assert found.pid == init.pid
    assert cluster.host_process(0, 1) != found
    assert cluster.host_process(1, 99999) is None


def test_a_container_of_another_run_or_a_host_process_is_never_hit(udp_nodes: Any) -> None:
    cluster = udp_nodes(nodes=1)
    stranger = Journal.create(uuid.uuid4().hex, folders=[cluster.run_dir])
    with pytest.raises(FaultUnavailable, match="is not of run"):
        FREEZE.inject(_agent(cluster, 0), {}, stranger)
    me = ProcessRef.of(__import__("os").getpid())
    assert me is not None
    with pytest.raises(FaultUnavailable, match="not in a container"):
        FREEZE.inject(me, {}, _journal(cluster))
    assert _docker.inspect(cluster.api, cluster.containers[0]).status == "running"  # type: ignore[union-attr]


def test_heal_thaws_and_removes_the_run_and_refuses_another_runs_container(
        udp_nodes: Any) -> None:
    mine, other = udp_nodes(nodes=1), udp_nodes(nodes=1)
    journal = _journal(mine)
    journal.intend("nodes", mine.tracking(), op="launch")
    FREEZE.inject(_agent(mine, 0), {}, journal)
    PARTITION.inject(_agent(mine, 0), {}, journal)
    # A forged record naming the other run's container: a heal must not touch it.
    other_api = other.api
    other_api.api.pause(other.containers[0])
    journal.intend("node.freeze", {"container": other.containers[0], "run": mine.run_id})
    results = heal_journal(journal.path)
    outcomes = sorted((r.entry.kind if r.entry else "journal", r.outcome) for r in results)
    assert outcomes == [("node.freeze", "refused"), ("node.freeze", "undone"),
                        ("node.partition", "undone"), ("nodes", "undone")], results
    assert _docker.run_containers(mine.api, mine.run_id) == []
    assert not mine.api.networks.list(filters={"label": f"{_docker.RUN_LABEL}={mine.run_id}"})
    assert _docker.inspect(other_api, other.containers[0]).status == "paused"  # type: ignore[union-attr]
    other_api.api.unpause(other.containers[0])


def test_net_partition_of_one_process_in_a_node_cuts_only_its_sockets(udp_nodes: Any) -> None:
    """net.partition on a process inside a container: its TCP connections to the other node
    go silent, while the node itself (its UDP, not marked) still talks: a process's partition,
    not the node's. Reverted, the same connections carry data again."""
    from aftershock.faults.net import PARTITION as NET_PARTITION

    cluster = udp_nodes()
    now = time.monotonic()
    assert _wait(lambda: _heard(cluster, 1, "t0", now) >= 2), "no TCP from node 0"
    journal = _journal(cluster)
    applied = NET_PARTITION.inject(_agent(cluster, 0), {"new_connections": False}, journal)
    cut = time.monotonic()
    time.sleep(1.0)
    assert _heard(cluster, 1, "t0", cut + 0.3) == 0, "node 0's TCP went on"
    assert _heard(cluster, 1, 0, cut + 0.3) > 0, "the whole node was cut, not the process"
    assert applied.undo["container"] == cluster.containers[0]
    NET_PARTITION.revert(applied.undo)
    journal.done(str(applied.journal_id))
    healed = time.monotonic()
    assert _wait(lambda: _heard(cluster, 1, "t0", healed) >= 2), "TCP never resumed"


def test_net_reset_of_a_process_in_a_node_resets_its_connections(udp_nodes: Any) -> None:
    from aftershock.faults.net import RESET

    cluster = udp_nodes()
    now = time.monotonic()
    assert _wait(lambda: _heard(cluster, 1, "t0", now) >= 2), "no TCP from node 0"
    before = time.monotonic()
    applied = RESET.inject(_agent(cluster, 0), {"port": 9001}, _journal(cluster))
    assert "reset" in applied.detail
    # The agent's own connection to node 1 broke (it logs the reset) and was made again.
    assert _wait(lambda: _heard(cluster, 0, "reset", before) >= 1, 10), applied.detail
    again = time.monotonic()
    assert _wait(lambda: _heard(cluster, 1, "t0", again) >= 2)



def test_removing_a_run_that_another_remover_is_removing_finishes(engine: None) -> None:
    """The reaper and `aftershock heal` may remove one run at once: each lists the run's
    containers while the other deletes them. A container gone between the engine's list and
    docker-py's inspect of it must not make the remover fail (as it did: NotFound)."""
    import threading

    from aftershock.harness.nodes.image import BASE_IMAGE, ensure_base

    api = _docker.client()
    ensure_base(api)
    run_id = f"race-{uuid.uuid4().hex[:8]}"
    labelled = {"label": f"{_docker.RUN_LABEL}={run_id}"}
    ids = [api.containers.create(BASE_IMAGE, ["true"], labels={_docker.RUN_LABEL: run_id}).id
           for _ in range(40)]  # created, never started: cheap to make and to remove

    def other_remover() -> None:
        other = _docker.client()
        for container_id in ids:
            with contextlib.suppress(Exception):
                other.api.remove_container(container_id, force=True)

    thread = threading.Thread(target=other_remover)
    try:
        thread.start()
        _docker.remove_run(run_id)
        thread.join(timeout=90)
    finally:
        for container_id in ids:
            with contextlib.suppress(Exception):
                api.api.remove_container(container_id, force=True)
    assert api.api.containers(all=True, filters=labelled) == []
