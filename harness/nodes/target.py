"""The nodes of a multi-node run as the run loop drives them (a
:class:`aftershock.harness.run.target.Target`).

Each node is a container of the local engine (:class:`aftershock.harness.nodes.cluster.Cluster`)
running
the same launcher (torchrun, meeting the others at node 0's rendezvous). The nodes share the
host's kernel, so their processes are this host's processes (``faults.ProcessRef`` works on
them: signals, memory) and every fault that acts from outside reaches them; their network is
their own namespace, which the net kinds enter (docs/nodes.md); their files are the run
folder, mounted at the same path in every node. What the probe reports names a pid inside
its node's PID namespace and the node (``hello``'s ``node``): :meth:`NodesTarget.observe`
maps it to the host's process (``Cluster.host_process``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from aftershock.faults import ProcessRef, contract
from aftershock.faults import docker_engine as _docker
from aftershock.faults import parent_pid as _parent
from aftershock.harness import probe
from aftershock.harness.errors import TargetError
from aftershock.harness.nodes.cluster import Cluster, end_run_processes, node_env
from aftershock.harness.run.records import Event
from aftershock.harness.run.target import (
    STOP_GRACE_S,
    Launch,
    Teardown,
    names_ranks,
    reported_ranks,
)
from aftershock.harness.run.timeline import Timeline

#: What a node's processes get from the harness's own environment (a node starts from an
#: empty one): the code under test as the harness imports it, and the vector ISA torch's CPU
#: kernels use, which decides the bits and the platform a golden is recorded for
#: (harness/twin/golden.py).
INHERITED = ("PYTHONPATH", "ATEN_CPU_CAPABILITY")
#: Settings that change how kernels round: each node gets the harness's, as a local system's
#: processes do, so the golden key and the oracle (harness/twin/golden.py reads the same names)
#: describe how the nodes really round (a run under MKL_CBWR=COMPATIBLE failed every node
#: scenario's fault_free_golden: the oracle rounded one way, the nodes another).
ROUNDING = ("MKL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_", "BLIS_", "ATEN_", "DNNL_",
            "ONEDNN_", "NVIDIA_TF32", "TORCH_ALLOW_TF32")


class NodesTarget:
    """``nodes`` containers, each running ``launch.argv``; the job is over when every node
    is, as the engine's restart policy (``restart``, ``max_restarts``) leaves them."""

    #: Processes in a node are the host's (signals, /proc/PID/mem); the net kinds act in the
    #: process's own network namespace; the run folder is the same path in every node; and
    #: node faults act on its containers.
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {"signals", "memory", "network", "files", "containers"})

    def __init__(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline,
                 nodes: int, restart: str, max_restarts: int,
                 mounts: Sequence[str] = (), node0_argv: Sequence[str] = (),
                 node_loss_ok: bool = False) -> None:
        run_dir = run_dir.absolute()  # the same path in every node: an absolute one
        self.launch = launch
        self.run_dir = run_dir
        self.run_id = run_id
        self.timeline = timeline
        env = {**node_env(run_dir, run_id), **launch.env}
        for name in INHERITED:
            if os.environ.get(name):
                env.setdefault(name, os.environ[name])
        for name, value in os.environ.items():
            if name.startswith(ROUNDING) and name != "MKL_VERBOSE":
                env.setdefault(name, value)
        self.cluster = Cluster(run_id=run_id, run_dir=run_dir, nodes=nodes, env=env,
                               cwd=launch.cwd, restart=restart, max_restarts=max_restarts,
                               mounts=mounts, node_loss_ok=node_loss_ok)
        self.node0_argv = list(node0_argv)  # node 0's command, when not launch.argv
        self.coordinates: dict[int, tuple[int, int]] = {}  # rank -> (replica, shard)
        # host pid -> (rank, role) as the process said in its hello
        self._reported: dict[int, tuple[int | None, str | None]] = {}

    def tracking(self) -> dict[str, Any]:
        """The heal journal's launch record: the run's containers by their label (a heal
        removes them) and, as for local processes, the run id every process carries."""
        return {"env": probe.RUN_ID_ENV, "value": self.run_id, "cgroup": None,
                **self.cluster.tracking()}

    def folders(self) -> list[Path]:
        return []  # everything a node writes is under the run folder

    def start(self) -> None:
        for folder in ("logs", "output", "nvml"):
            (self.run_dir / folder).mkdir(parents=True, exist_ok=True)
        if not self.launch.cwd.is_dir():
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: its working directory "
                              f"{str(self.launch.cwd)!r} does not exist")
        problem = _docker.engine_problem()
        if problem is not None:
            raise TargetError(f"a nodes system runs each node as a container: {problem}")
        try:
            rest = [self.launch.argv] * (self.cluster.nodes - 1)
            self.cluster.start([self.node0_argv or self.launch.argv, *rest])
        except Exception as exc:  # the engine refused: say what it said
            raise TargetError(f"cannot start {self.cluster.nodes} nodes: "
                              f"{type(exc).__name__}: {exc}") from exc

    def launched(self) -> dict[str, Any]:
        return {"tracking": "containers", "nodes": self.cluster.nodes,
                "network": self.cluster.subnet,
                "startup": {k: round(v, 3) for k, v in self.cluster.timings.items()}}

    def observe(self, event: Event) -> None:
        fields = event.fields
        if event.event != contract.HELLO:
            return
        pid, node = fields.get("pid"), fields.get("node")
        if not isinstance(pid, int) or not isinstance(node, int) or \
                not 0 <= node < self.cluster.nodes:
            return  # a hello without its node names no process of the host
        ref = self.cluster.host_process(node, pid)
        if ref is None:
            return  # gone already
        role = fields.get("role")
        self._reported[ref.pid] = (event.rank, role if isinstance(role, str) else None)
        replica, shard = fields.get("replica"), fields.get("shard")
        if event.rank is not None and isinstance(replica, int) and isinstance(shard, int):
            self.coordinates[event.rank] = (replica, shard)

    def poll(self) -> int | None:
        return self.cluster.poll() if self.cluster.containers else None

    def processes(self) -> list[ProcessRef]:
        return self.cluster.processes() if self.cluster.containers else []

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> process, from the ranks' hellos (a rank of the node's own pid mapped to
        the host's); before any hello, from ``RANK`` in their environment."""
        if not names_ranks(self._reported):
            return self.cluster.rank_processes() if self.cluster.containers else {}
        return reported_ranks(self._reported, self.processes())

    def role_processes(self, role: str) -> list[ProcessRef]:
        """``launcher``: each running node's launcher (torchrun's agent, the child of the
        node's init); any other role: the processes that said so in their hello."""
        if role != "launcher":
            live = {ref.pid: ref for ref in self.processes()}
            return [live[pid] for pid, (_, said) in self._reported.items()
                    if said == role and pid in live]
        inits = {self._init(i) for i in range(self.cluster.nodes)} - {None}
        return [ref for ref in self.processes() if _parent(ref.pid) in inits]

    def node_processes(self, node: int) -> list[ProcessRef]:
        init = self._init(node) if 0 <= node < self.cluster.nodes else None
        ref = ProcessRef.of(init) if init is not None else None
        return [ref] if ref is not None and ref.alive() else []

    def _init(self, node: int) -> int | None:
        if node >= len(self.cluster.containers):
            return None
        (state,) = [s for s in self.cluster.states() if s.index == node]
        return state.pid if state.status == "running" and state.pid > 0 else None

    def stop(self, grace: float = STOP_GRACE_S) -> Teardown:
        """Collect each node's log, remove the run's containers and network (paused ones
        thawed first), then end whatever process of the run the host still has. (No
        ``grace``: removing a container is the engine's stop, with its own.)"""
        if self.cluster.containers:
            with contextlib.suppress(Exception):  # the engine's account, as evidence
                states = self.cluster.states()
                self.timeline.emit("nodes_ended", restarts=[n.restarts for n in states],
                                   status=[n.status for n in states])
        removed = True
        try:
            self.cluster.stop()
        except Exception:
            removed = False  # the journal's launch record stays pending: a heal retries
        survivors = end_run_processes(self.run_id)
        return Teardown(tracking="containers", survivors=survivors, logs_open=(),
                        cgroup_removed=None if removed else False)


