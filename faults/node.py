"""Node faults: a whole node (a container of a multi-node run) dies, freezes, drops off the
network or reboots.

A node is a container on a real Docker engine (`harness/nodes/`, docs/nodes.md). The fault's
target is any process of the node (its ranks, its torchrun agent): the container that holds
it is found from the process's cgroup, or named by ``params["container"]``; either way it is
hit only if its ``aftershock.run`` label names this run (the journal's run id), so a node
fault never touches a container the run did not make. The one exception: a node of the Slurm
test cluster (``make slurm-cluster``, labelled with the cluster's id), frozen or partitioned
while the target process in it is one of this run's Slurm job (undone at the end). The engine
is reached through the Docker SDK (faults/_docker.py), imported only when a node fault is used.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field

from aftershock.faults import _docker, _nft, _proc, slurm_cli
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, UndoContext, UndoRefused, undone_on_error
from aftershock.faults.params import Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register


class NodeParams(FaultParams):
    container: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="the container (full id) instead of the "
        "target's own; default: the container of the target process")


class FreezeParams(NodeParams):
    duration: Duration | None = Field(None, description="thaw after this long; default: at "
                                      "the end of the run")


class PartitionParams(NodeParams):
    direction: Literal["both", "in", "out"] = Field(
        "both", description="both, in (nothing reaches the node) or out (nothing leaves it)")
    duration: Duration | None = Field(None, description="heal after this long; default: at "
                                      "the end of the run")


class RestartParams(NodeParams):
    grace: Duration = Field(timedelta(0), description="time the node's processes get to exit "
                            "after SIGTERM; 0 (the default) is a hard reset")


class _NodeKind:
    """What every node kind declares: it acts from outside, on a node's container."""

    params: type[NodeParams] = NodeParams
    acts: Acts = "outside"
    needs = frozenset({"containers"})


def _cluster_node(api: Any, container_id: str, target: ProcessRef,
                  journal: Journal) -> Any:
    """A node of the Slurm test cluster (``make slurm-cluster``): its containers carry the
    cluster's label, not a run's, and outlive every run. One is this run's to hit only while
    it runs this run's job: the target process must be in that very container and be a
    process of the run's Slurm job (its SLURM_JOB_NAME names the run). Anything else is
    refused as any other container is."""
    node = _docker.inspect(api, container_id)
    if node is None or node.run != slurm_cli.TEST_CLUSTER_ID:
        return None
    if _docker.container_of(target.pid) != container_id or \
            _proc.environ(target.pid).get("SLURM_JOB_NAME") != slurm_cli.job_name(
                journal.run_id):
        raise FaultUnavailable(f"container {container_id[:12]} is a node of the Slurm test "
                               f"cluster, but pid {target.pid} in it is not of this run's job")
    return node


def _node(target: ProcessRef, params: Mapping[str, Any], journal: Journal,
          cluster: bool = False) -> tuple[Any, Any]:
    """(engine client, the node as it is now) for the target's container. ``cluster``: a
    node of the Slurm test cluster that runs this run's job will do too (kinds that undo
    what they do: the cluster outlives the run)."""
    explicit = NodeParams.bind(params).container
    container_id = explicit if explicit else _docker.container_of(target.pid)
    if not _docker.is_container_id(container_id):
        where = (f"container {explicit!r} is not a full container id" if explicit
                 else f"pid {target.pid} is not in a container")
        raise FaultUnavailable(f"node faults act on containers: {where}")
    api = _docker.client()
    try:
        try:
            node = _docker.run_of(api, str(container_id), journal.run_id)
        except FaultUnavailable:
            node = _cluster_node(api, str(container_id), target, journal) if cluster \
                else None
            if node is None:
                raise
    except BaseException:
        api.close()
        raise
    if node is None:
        api.close()
        raise FaultUnavailable(f"container {str(container_id)[:12]} is gone")
    return api, node


def _undo_of(node: Any, journal: Journal) -> dict[str, Any]:
    """What an undo record names the node by: the container and the run, and, for a node of
    the Slurm test cluster, the cluster (what its label says instead of the run)."""
    undo: dict[str, Any] = {"container": node.id, "run": journal.run_id}
    if node.run == slurm_cli.TEST_CLUSTER_ID:
        undo["cluster"] = slurm_cli.TEST_CLUSTER_ID
    return undo


def _validate_node(undo: Mapping[str, Any], context: UndoContext) -> None:
    """An undo record's container is this run's (faults/_docker.py), or a node of the Slurm
    test cluster the record says it is, still labelled so, in a record of this run."""
    if undo.get("cluster") is None:
        _docker.validate_container(undo, context)
        return
    container_id = undo.get("container")
    if undo.get("cluster") != slurm_cli.TEST_CLUSTER_ID or \
            not _docker.is_container_id(container_id):
        raise UndoRefused(f"{container_id!r} of {undo.get('cluster')!r} is not a node of the "
                          "Slurm test cluster")
    if undo.get("run") != context.run_id:
        raise UndoRefused(f"run {undo.get('run')!r} is not this journal's run {context.run_id}")
    with contextlib.closing(_docker.client()) as api:
        node = _docker.inspect(api, str(container_id))
    if node is not None and node.run != slurm_cli.TEST_CLUSTER_ID:
        raise UndoRefused(f"container {str(container_id)[:12]} is not labelled "
                          f"{_docker.RUN_LABEL}={slurm_cli.TEST_CLUSTER_ID} (found {node.run!r})")


def _preflight_engine() -> list[str]:
    problem = _docker.engine_problem()
    return [] if problem is None else [problem]


class Kill(_NodeKind):
    info = KindInfo(
        kind="node.kill",
        summary="The node dies: every process in its container at once, as when a host "
        "loses power. It comes back only if its restart policy (`restart:` of the nodes "
        "system) brings it back, as a cluster's supervisor would.",
        caused_by="SIGKILL from the host to the container's init process (the engine's "
        "State.Pid), which ends its whole PID namespace at once; its sockets close and its "
        "network namespace goes with it. Not `docker kill`: the engine takes that for a "
        "manual stop and would not apply the restart policy.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        return _preflight_engine()

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        api, node = _node(target, params, journal)
        with contextlib.closing(api):
            killed = _docker.kill_node(node)
        what = f"node {node.index} (container {node.id[:12]}, init pid {node.pid})"
        return Applied(self.info.kind, None, {},
                       f"SIGKILL -> {what}" + ("" if killed else f": not running ({node.status})"))

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class Freeze(_NodeKind):
    params = FreezeParams
    info = KindInfo(
        kind="node.freeze",
        summary="The node freezes: every process in its container stops at once and keeps "
        "its sockets, as a host wedged in the kernel or a VM paused by its hypervisor.",
        caused_by="`pause` through the engine: the container's cgroup freezer stops all its "
        "processes (not a signal: they cannot see or catch it); its network stays up, so "
        "peers see silence, not a closed connection.",
        reverted_by="`unpause` through the engine, if the container is still paused; a "
        "crashed harness's reaper or `aftershock heal` removes the run's containers.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        return _preflight_engine()

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        api, node = _node(target, params, journal, cluster=True)
        with contextlib.closing(api):
            undo = _undo_of(node, journal)
            entry = journal.intend(self.info.kind, undo)
            with undone_on_error(journal, entry, self.revert, undo):
                api.api.pause(node.id)
        return Applied(self.info.kind, entry, undo,
                       f"paused node {node.index} (container {node.id[:12]})")

    def revert(self, undo: Mapping[str, Any]) -> None:
        with contextlib.closing(_docker.client()) as api:
            node = _docker.inspect(api, str(undo["container"]))
            if node is not None and node.status == "paused":
                api.api.unpause(node.id)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate_node(undo, context)


def _partition_rules(table: str, direction: str) -> str:
    """Drop every packet into and/or out of the node on its network interfaces: everything
    but loopback, so the node's own ranks still talk to each other, as on a host whose
    uplink died. Silent drops: peers see timeouts, not resets."""
    chains = {"in": ("input", "iifname"), "out": ("output", "oifname")}
    text = f"table inet {table} {{\n"
    for name in (("in", "out") if direction == "both" else (direction,)):
        hook, dev = chains[name]
        text += (f"  chain {name} {{\n    type filter hook {hook} priority -10; "
                 f"policy accept;\n    {dev} != \"lo\" drop\n  }}\n")
    return text + "}\n"


class Partition(_NodeKind):
    params = PartitionParams
    info = KindInfo(
        kind="node.partition",
        summary="The node drops off the network: nothing reaches it from the other nodes and "
        "nothing leaves it (direction: both), or one way only (in, out); its own processes "
        "still talk to each other over loopback.",
        caused_by="An nftables table `inet aftershock_<id>` inside the container's own "
        "network namespace (nft run in that namespace through setns(2)) that drops every "
        "packet on its non-loopback interfaces on the input and/or output hook. Packets are "
        "dropped silently, as by a failed switch port: peers see timeouts, not resets. One "
        "way (`in`) also starves the node's own connections of their acknowledgements, as a "
        "real one-way link failure does.",
        reverted_by="`nft delete table inet aftershock_<id>` in the container's network "
        "namespace, if the container still runs in it (a node that restarted has a new, "
        "clean namespace). Established connections resume on TCP's next retransmission.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        problems = _preflight_engine()
        try:
            _nft.nft_binary()
        except FaultUnavailable as exc:
            problems.append(str(exc))
        return problems

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        direction = PartitionParams.bind(params).direction
        _nft.nft_binary()
        api, node = _node(target, params, journal, cluster=True)
        table = f"{_nft.TABLE_PREFIX}{uuid.uuid4().hex[:12]}"
        with contextlib.closing(api), _docker.netns_of(api, node) as netns:
            # The init pid names the namespace the table goes into; revert deletes it only
            # from that same namespace, never from a later one of a restarted node.
            undo = {**_undo_of(node, journal), "table": table, "pid": node.pid}
            entry = journal.intend(self.info.kind, undo)
            with undone_on_error(journal, entry, self.revert, undo):
                _nft.load(_partition_rules(table, direction), netns=netns)
        return Applied(self.info.kind, entry, undo,
                       f"node {node.index} (container {node.id[:12]}) partitioned "
                       f"({direction}, table {table} in its network namespace)")

    def revert(self, undo: Mapping[str, Any]) -> None:
        with contextlib.closing(_docker.client()) as api:
            node = _docker.inspect(api, str(undo["container"]))
            if node is None or node.pid != int(undo["pid"]) or node.pid <= 0:
                return  # gone or restarted: the namespace that held the table is gone too
            with _docker.netns_of(api, node) as netns:
                _nft.delete_table(str(undo["table"]), netns=netns)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        context.name(undo.get("table"))
        if not isinstance(undo.get("pid"), int):
            raise UndoRefused(f"pid {undo.get('pid')!r} is not a number")
        _validate_node(undo, context)


class Restart(_NodeKind):
    params = RestartParams
    info = KindInfo(
        kind="node.restart",
        summary="The node reboots: its container is stopped and started again, every process "
        "in it starts from its command, with a new network namespace and the same address.",
        caused_by="`restart` through the engine: SIGTERM to the container's init process, "
        "SIGKILL after `grace`, then the same container (same address, same mounts) started "
        "again.",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        return _preflight_engine()

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        grace = RestartParams.bind(params).grace.total_seconds()
        api, node = _node(target, params, journal)
        with contextlib.closing(api):
            # The engine counts whole seconds: 0 is a hard reset.
            api.api.restart(node.id, timeout=round(grace))
            after = _docker.inspect(api, node.id)
        pid = after.pid if after is not None else 0
        return Applied(self.info.kind, None, {},
                       f"restarted node {node.index} (container {node.id[:12]}, init pid "
                       f"{node.pid} -> {pid})")

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


KILL = register(Kill())
FREEZE = register(Freeze())
PARTITION = register(Partition())
RESTART = register(Restart())
