"""The Docker engine as the node faults and the heal see it: containers labelled with a run id.

Everything is done through the Docker SDK for Python (the `nodes` extra: ``pip install
'aftershock[nodes]'``), imported only when a function here is called, so ``import faults``
and ``import harness`` never import docker. Every container and network a run makes carries
the label ``aftershock.run=<run id>``; a node fault or a heal acts only on a container whose
label names the journal's own run (:func:`run_of`), never on one found by name alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aftershock.faults._errors import FaultUnavailable
from aftershock.faults.journal import UndoContext, UndoRefused

RUN_LABEL = "aftershock.run"  # the run id, on every container, network and image we make
NODE_LABEL = "aftershock.node"  # a node container's index in its run (0, 1, ...)
# What a heal is told to remove in the `launch` record of a run that made containers.
LAUNCH_KIND = "nodes"
# A container id: 64 hex digits, as the engine names it (and as cgroup paths carry it).
_ID = re.compile(r"[0-9a-f]{64}")
# Where the engine's cgroup drivers put a container: cgroupfs `/docker/<id>`, systemd
# `/system.slice/docker-<id>.scope`, nested engines `.../docker/<id>`.
_CGROUP_ID = re.compile(r"(?:^|/)(?:docker[-/])([0-9a-f]{64})(?:\.scope)?(?:/|$)")
# How long a call to the engine may take (a pause, a kill); a wedged engine is an error.
API_TIMEOUT_S = 60


def engine_problem() -> str | None:
    """Why no Docker engine can be used from here, or None if one answers.

    The one line says what to do: install the extra, or start an engine (``make
    docker-engine``, which CI runs as `.ci/run` does)."""
    try:
        import docker
    except ImportError:
        return "the Docker SDK is not installed: pip install 'aftershock[nodes]'"
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            # Knocked on first: the SDK's own connect to a socket nobody listens on leaks
            # the socket it made (docker 7.2), a ResourceWarning in whoever collects it.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.settimeout(5)
                knock.connect(host.removeprefix("unix://"))
        with contextlib.closing(docker.from_env(timeout=5)) as api:
            api.ping()
    except Exception as exc:  # DockerException, connection refused, permission denied
        return (f"no Docker engine answers at {host} ({type(exc).__name__}): start one with "
                "`make docker-engine` (ci/docker-engine)")
    return None


def client() -> Any:
    """A client of the engine named by the environment (DOCKER_HOST, else the local socket).
    Raises FaultUnavailable with what to do when there is none."""
    problem = engine_problem()
    if problem is not None:
        raise FaultUnavailable(problem)
    import docker

    return docker.from_env(timeout=API_TIMEOUT_S)


def container_of(pid: int) -> str | None:
    """The id of the container that holds process ``pid`` (from its cgroup path), or None
    for a process of the host."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            text = handle.read()
    except OSError:
        return None
    for line in text.splitlines():
        found = _CGROUP_ID.search(line.split(":", 2)[-1])
        if found:
            return found.group(1)
    return None


def is_container_id(value: object) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class Node:
    """A container as the engine sees it now."""

    id: str
    run: str | None  # its aftershock.run label
    index: int | None  # its aftershock.node label
    status: str  # created, running, paused, restarting, exited, dead
    pid: int  # its init process on the host, 0 when it is not running
    restarts: int


def inspect(api: Any, container_id: str) -> Node | None:
    """The container as it is now; None when it is gone."""
    import docker

    try:
        attrs = api.api.inspect_container(container_id)
    except docker.errors.NotFound:
        return None
    labels = attrs.get("Config", {}).get("Labels") or {}
    index = labels.get(NODE_LABEL)
    state = attrs.get("State", {})
    return Node(
        id=str(attrs["Id"]),
        run=labels.get(RUN_LABEL),
        index=int(index) if isinstance(index, str) and index.isdigit() else None,
        status=str(state.get("Status", "")),
        pid=int(state.get("Pid") or 0),
        restarts=int(attrs.get("RestartCount") or 0),
    )


def run_of(api: Any, container_id: str, run_id: str) -> Node | None:
    """The container if it belongs to run ``run_id`` (its label says so), None if it is gone;
    raises FaultUnavailable for anyone else's container: a fault never touches it."""
    node = inspect(api, container_id)
    if node is not None and node.run != run_id:
        found = "no aftershock.run label" if node.run is None else f"{RUN_LABEL}={node.run!r}"
        raise FaultUnavailable(f"container {container_id[:12]} is not of run {run_id}: {found}")
    return node


def validate_container(undo: Mapping[str, Any], context: UndoContext) -> str:
    """An undo record's ``container``, if it is a container id, the record names this
    journal's run, and the container (when it still exists) carries this run's label: the
    engine is asked, since a record can say anything. Raises UndoRefused otherwise."""
    container_id = undo.get("container")
    if not is_container_id(container_id):
        raise UndoRefused(f"{container_id!r} is not a container id")
    if undo.get("run") != context.run_id:
        raise UndoRefused(f"run {undo.get('run')!r} is not this journal's run {context.run_id}")
    with contextlib.closing(client()) as api:
        node = inspect(api, str(container_id))
    if node is not None and node.run != context.run_id:
        raise UndoRefused(f"container {str(container_id)[:12]} is not labelled "
                          f"{RUN_LABEL}={context.run_id} (found {node.run!r})")
    return str(container_id)


def member(container_id: str) -> int | None:
    """A live process of the container (host pid), found by its cgroup without the engine:
    the way into the container's namespaces when the process a fault hit is gone."""
    for name in os.listdir("/proc"):
        if name.isdigit() and container_of(int(name)) == container_id:
            return int(name)
    return None


def wait_status(api: Any, container_id: str, wanted: Sequence[str], timeout: float) -> Node | None:
    """Poll until the container's status is one of ``wanted`` (or it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        node = inspect(api, container_id)
        if node is None or node.status in wanted or time.monotonic() > deadline:
            return node
        time.sleep(0.02)


def kill_node(node: Node) -> bool:
    """The node dies as a host does: SIGKILL to its init process from outside, which takes
    every process of its PID namespace with it at once. Unlike ``docker kill`` (a manual
    stop) the engine then applies the container's restart policy, as a cluster's supervisor
    brings a lost node back. False if it was not running."""
    if node.pid <= 1:
        return False
    with open(f"/proc/{node.pid}/cgroup") as handle:
        if node.id not in handle.read():
            return False  # the init process ended and its pid was reused meanwhile
    try:
        os.kill(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def netns_of(api: Any, node: Node) -> Iterator[int]:
    """A descriptor of the node's network namespace, held open so that it stays the same
    namespace while it is used (the init process may die meanwhile, the namespace may not
    be reused: an open descriptor keeps it alive)."""
    if node.pid <= 0:
        raise FaultUnavailable(f"container {node.id[:12]} is not running")
    fd = os.open(f"/proc/{node.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        now = inspect(api, node.id)
        if now is None or now.pid != node.pid:
            raise FaultUnavailable(f"container {node.id[:12]} restarted while its network "
                                   "namespace was opened")
        yield fd
    finally:
        os.close(fd)


def run_containers(api: Any, run_id: str) -> list[Any]:
    """Every container of run ``run_id``, whatever its state. docker-py inspects each listed
    container: one removed in between (the reaper and `aftershock heal` removing one run at
    once) is left out, not a NotFound."""
    return list(api.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"},
                                    ignore_removed=True))


def remove_run(run_id: str, *, patience_s: float = 30.0) -> None:
    """Remove every container and network of run ``run_id``: paused ones are thawed first
    (the engine refuses to kill a frozen cgroup on some versions), then each is removed
    with force (SIGKILL). What the label does not name is never touched."""
    import docker

    with contextlib.closing(client()) as api:
        deadline = time.monotonic() + patience_s
        while True:
            left = run_containers(api, run_id)
            if not left:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"containers {[c.short_id for c in left]} of run {run_id} "
                                   f"outlived removal by {patience_s:g}s")
            for container in left:
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    if container.status == "paused":
                        container.unpause()
                with contextlib.suppress(docker.errors.NotFound):
                    try:
                        container.remove(force=True)
                    except docker.errors.APIError as exc:
                        if "already in progress" not in str(exc):
                            raise
            time.sleep(0.05)
        for network in api.networks.list(filters={"label": f"{RUN_LABEL}={run_id}"}):
            with contextlib.suppress(docker.errors.NotFound):
                network.remove()
