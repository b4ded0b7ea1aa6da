"""N nodes of one run: containers on a private network of their own, each with its address.

A :class:`Cluster` makes a user-defined network (bridge driver, ``internal``: no route off
this machine) on a /24 of 198.18.0.0/15 (the range set aside for network tests between
devices, RFC 2544), and one container per node with a fixed address (``.10 + i``) and
hostname ``node<i>``: each node has its own network, PID, mount, UTS and IPC namespaces, as
a host does; the engine's restart policy plays the cluster's supervisor. Everything is
labelled ``aftershock.run=<run id>``, and the run's heal journal records that label before
anything is made (:meth:`Cluster.tracking`), so a killed harness's reaper or ``aftershock
heal`` removes it all (faults/heal.py).

One timeline, one clock: the run folder is mounted at the same path in every node, so every
node's probe appends to the same ``events.jsonl`` (one ``write`` on an ``O_APPEND``
descriptor keeps lines whole), and containers share the host's kernel, so
``CLOCK_MONOTONIC`` is one clock for the harness and every node (no time namespace is made).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftershock.faults import ProcessRef, all_pids, contract, kill_all, processes_with_env
from aftershock.faults import docker_engine as _docker
from aftershock.faults import process_environ as environ
from aftershock.harness import probe
from aftershock.harness.nodes import image

# 198.18.0.0/15 is reserved for benchmarking networks between devices (RFC 2544): never a
# real destination, and the network is `internal`, so nothing is routed off this machine.
SUBNET_FIRST, SUBNET_COUNT = "198.18", 256
RDZV_PORT = 29400  # torchrun's c10d rendezvous, hosted by node 0's agent
FIRST_HOST = 10  # node i is .(10 + i); .1 is the bridge on the host
#: A node's exit status when its init was SIGKILLed (node.kill, the kernel's OOM killer): the
#: whole node died, as opposed to its launcher exiting with a status of its own.
NODE_DIED = 128 + 9


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node as the engine reports it."""

    index: int
    container: str
    status: str
    exit_code: int
    restarts: int
    pid: int


def torchrun_argv(*, nodes: int, nproc: int, rdzv_host: str, run_id: str, max_restarts: int,
                  log_dir: Path, program: Sequence[str], rdzv_conf: str = "",
                  exit_barrier_s: float | None = None) -> list[str]:
    """torchrun on one node of ``nodes``, meeting the others through c10d rendezvous at node
    0's agent; global ranks follow the nodes' order in the rendezvous (torchrun sorts its
    participants by host name: node0 first) and local ranks within a node.
    ``rdzv_conf`` is torchrun's ``--rdzv-conf`` (e.g. ``keep_alive_interval=1``): how soon
    the survivors' agents give up on a lost node's agent. ``exit_barrier_s``: how long an
    agent whose ranks finished waits for the other agents (torchrun: 300 s, no flag), through
    ``aftershock.harness.nodes.launcher``."""
    launcher = ["torch.distributed.run"] if exit_barrier_s is None else \
        ["aftershock.harness.nodes.launcher", f"--exit-barrier={exit_barrier_s:g}"]
    return [
        sys.executable, "-m", *launcher,
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
        f"--log-dir={log_dir}",
        "--tee=3",
        *program,
    ]


class Cluster:
    """The nodes of one run on the local engine."""

    def __init__(self, *, run_id: str, run_dir: Path, nodes: int, env: Mapping[str, str],
                 cwd: Path, restart: str = "no", max_restarts: int = 0,
                 mounts: Sequence[str] = (), node_loss_ok: bool = False) -> None:
        if restart not in ("no", "on-failure", "always"):
            raise ValueError(f"restart {restart!r}: one of no, on-failure, always")
        self.run_id = run_id
        self.run_dir = run_dir
        self.nodes = nodes
        self.env = dict(env)
        self.cwd = cwd
        self.restart = restart
        self.max_restarts = max_restarts
        self.mounts = list(mounts)
        # A node that died (NODE_DIED) and stays down is a lost host, not the job's failure:
        # the job is what the other nodes finish (hot_spare: node 0's spares took over).
        self.node_loss_ok = node_loss_ok
        self.name = f"aftershock_{run_id[:16]}"
        self.containers: list[str] = []
        self.subnet: str | None = None
        self.timings: dict[str, float] = {}  # what start-up cost, for the timeline
        self._api: Any = None

    def tracking(self) -> dict[str, Any]:
        """The heal journal's launch record (kind ``nodes``): whatever carries this label."""
        return {"label": _docker.RUN_LABEL, "value": self.run_id}

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = _docker.client()
        return self._api

    def address(self, index: int) -> str:
        assert self.subnet is not None, "the cluster has not started"
        return f"{self.subnet.split('/')[0].rsplit('.', 1)[0]}.{FIRST_HOST + index}"

    def make_network(self) -> None:
        """A network on a /24 that no other network of this engine holds: tried at random
        (concurrent runs), the engine refusing an overlap. ``start`` makes it when it was not
        made before; made first, the nodes' addresses are known before their commands are."""
        import docker

        taken = set()
        for net in self.api.networks.list():
            for config in (net.attrs.get("IPAM") or {}).get("Config") or []:
                taken.add(str(config.get("Subnet", "")))
        base_a, base_b = (int(x) for x in SUBNET_FIRST.split("."))
        free = [f"{base_a}.{base_b + n // 256}.{n % 256}.0/24" for n in range(SUBNET_COUNT)]
        random.shuffle(free)
        for subnet in (s for s in free if s not in taken):
            pool = docker.types.IPAMPool(subnet=subnet, gateway=subnet.replace(".0/24", ".1"))
            try:
                self.api.networks.create(
                    self.name, driver="bridge", internal=True, check_duplicate=True,
                    ipam=docker.types.IPAMConfig(pool_configs=[pool]),
                    labels={_docker.RUN_LABEL: self.run_id},
                )
            except docker.errors.APIError as exc:
                if "overlap" in str(exc).lower():
                    continue
                raise
            self.subnet = subnet
            return
        raise RuntimeError(f"no free /24 left in {SUBNET_FIRST}.0.0/16 for the nodes' network")

    def start(self, commands: Sequence[Sequence[str]]) -> None:
        """Make the network and one container per node running ``commands[i]``, all started
        together; each node's output goes to the engine's log (`logs()` collects it)."""
        assert len(commands) == self.nodes
        started = time.monotonic()
        image_id, self.timings["image_s"] = image.ensure_base(self.api)
        if self.subnet is None:
            self.make_network()
        self.timings["network_s"] = time.monotonic() - started
        hosts = {f"node{i}": self.address(i) for i in range(self.nodes)}
        binds = [*image.host_mounts(), *self.mounts, f"{self.run_dir}:{self.run_dir}:rw"]
        policy: dict[str, Any] = {"Name": self.restart}
        if self.restart == "on-failure":
            policy["MaximumRetryCount"] = self.max_restarts
        for index, argv in enumerate(commands):
            low = self.api.api
            host_config = low.create_host_config(
                binds=binds, restart_policy=policy, extra_hosts=hosts,
                # A real init as PID 1 (the engine's docker-init): it reaps orphans, and its
                # death is the node's death (node.kill).
                init=True,
                # The ranks' shared memory (torch's data loader, Gloo's shm transport).
                shm_size="256m",
            )
            networking = low.create_networking_config(
                {self.name: low.create_endpoint_config(ipv4_address=self.address(index))}
            )
            created = low.create_container(
                image_id, command=list(argv), hostname=f"node{index}",
                name=f"{self.name}_node{index}", working_dir=str(self.cwd),
                environment={**self.env, contract.NODE_ENV: str(index),
                             "PYTHONUNBUFFERED": "1"},
                labels={_docker.RUN_LABEL: self.run_id, _docker.NODE_LABEL: str(index)},
                host_config=host_config, networking_config=networking,
            )
            self.containers.append(str(created["Id"]))
        self.timings["create_s"] = time.monotonic() - started
        for container in self.containers:
            self.api.api.start(container)
        self.timings["start_s"] = time.monotonic() - started

    def states(self) -> list[NodeState]:
        found = []
        for index, container in enumerate(self.containers):
            try:
                attrs = self.api.api.inspect_container(container)
            except Exception:
                found.append(NodeState(index, container, "gone", -1, 0, 0))
                continue
            state = attrs["State"]
            found.append(NodeState(index, container, str(state["Status"]),
                                   int(state.get("ExitCode") or 0),
                                   int(attrs.get("RestartCount") or 0), int(state.get("Pid") or 0)))
        return found

    def poll(self) -> int | None:
        """None while any node runs or may still be restarted by its policy; else the job's
        exit code: 0 when every node exited 0, otherwise the first non-zero one."""
        states = self.states()
        if any(s.status in ("created", "running", "paused", "restarting") for s in states):
            return None
        for state in states:
            if state.exit_code != 0 and self._may_restart(state):
                return None
        judged = states
        if self.node_loss_ok:
            judged = [s for s in states if s.exit_code != NODE_DIED] or states
        codes = [s.exit_code for s in judged if s.exit_code != 0]
        return codes[0] if codes else 0

    def _may_restart(self, state: NodeState) -> bool:
        """The engine restarts a failed node after a short back-off (100 ms, doubling): until
        its retries are spent it is not finished."""
        if self.restart == "no" or state.status == "gone":
            return False
        return self.restart == "always" or state.restarts < self.max_restarts

    def processes(self, index: int | None = None) -> list[ProcessRef]:
        """Every live process of the nodes (or of node ``index``), as host pids: found by the
        container id in their cgroup."""
        wanted = set(self.containers if index is None else [self.containers[index]])
        found = []
        for pid in all_pids():
            container = _docker.container_of(pid)
            if container in wanted:
                ref = ProcessRef.of(pid)
                if ref is not None and ref.alive():
                    found.append(ref)
        return found

    def host_process(self, index: int, ns_pid: int) -> ProcessRef | None:
        """The host's view of the process that node ``index`` calls ``ns_pid``: what a probe
        event's ``pid`` names inside a node (its own PID namespace), from the ``NSpid`` line
        of /proc/PID/status (host pid first, the node's last)."""
        for ref in self.processes(index):
            with contextlib.suppress(OSError, ValueError), \
                    open(f"/proc/{ref.pid}/status") as handle:
                for line in handle:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return ref
                        break
        return None

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Global rank -> its worker process, from the RANK torchrun gave it; the topmost
        process with that RANK (a rank's own children inherit it)."""
        by_rank: dict[int, list[ProcessRef]] = {}
        for ref in self.processes():
            value = environ(ref.pid).get("RANK")
            if value is not None and value.isdigit():
                by_rank.setdefault(int(value), []).append(ref)
        return {rank: min(refs, key=lambda r: r.start) for rank, refs in by_rank.items()}

    def logs(self) -> None:
        """Each node's output so far (every start of it) into ``logs/node<i>.log``."""
        folder = self.run_dir / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        for index, container in enumerate(self.containers):
            with contextlib.suppress(Exception):
                data = self.api.api.logs(container, stdout=True, stderr=True, timestamps=False)
                (folder / f"node{index}.log").write_bytes(data)

    def stop(self) -> None:
        """Collect the logs, then remove every container and the network of the run."""
        try:
            self.logs()
        finally:
            try:
                _docker.remove_run(self.run_id)
            finally:
                if self._api is not None:
                    self._api.close()
                    self._api = None


#: How long a teardown keeps ending processes of the run left on the host.
KILL_S = 5.0


def end_run_processes(run_id: str) -> tuple[int, ...]:
    """Kill (woken first, if stopped) every process on this host carrying the run's id, for
    up to ``KILL_S``; the pids still alive after that."""
    deadline = time.monotonic() + KILL_S
    while (refs := processes_with_env(probe.RUN_ID_ENV, run_id)) and \
            time.monotonic() < deadline:
        for ref in refs:
            ref.signal(signal.SIGCONT)
        kill_all(refs)
        time.sleep(0.05)
    return tuple(sorted(r.pid for r in refs if r.alive()))


def node_env(run_dir: Path, run_id: str) -> dict[str, str]:
    """What every node's processes get from the harness: the shared timeline, command file and
    output folder (all under the run folder, mounted at the same path in each node), and the
    run id that marks them."""
    return {
        "AFTERSHOCK_EVENTS": str(run_dir / "events.jsonl"),
        "AFTERSHOCK_COMMANDS": str(run_dir / "commands.jsonl"),
        "AFTERSHOCK_OUTPUT_DIR": str(run_dir / "output"),
        "AFTERSHOCK_RUN_ID": run_id,
        "AFTERSHOCK_NVML_DIR": str(run_dir / "nvml"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "HOME": "/root",
        "PATH": f"{os.path.dirname(os.path.abspath(sys.executable))}:/usr/local/bin:"
        "/usr/bin:/bin",
    }
