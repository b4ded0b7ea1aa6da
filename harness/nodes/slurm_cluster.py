"""A real Slurm cluster for the tests, on the local Docker engine: ``make slurm-cluster``.

One container runs ``slurmctld`` (hostname ``slurmctld``) and N more run ``slurmd``
(hostnames ``node0``, ``node1``, ...), each with its own network namespace and address on an
``internal`` network of its own (a /24 of 198.18.0.0/15, as the run's nodes get:
:class:`aftershock.harness.nodes.cluster.Cluster`), made from the same base image with the host's
programs mounted read-only (``/usr`` holds Debian's slurm-wlm and munge). Every container
runs its own ``munged`` with one shared key, and so does the host, so ``sinfo``, ``squeue``,
``sbatch``, ``srun``, ``scontrol`` and ``scancel`` work from the host as from a login node:
the host reaches the cluster through the network's bridge (``.1``).

The cluster is nothing the harness assumes: the ``slurm`` system kind and the Slurm faults
talk to whatever cluster ``sbatch`` reaches (``SLURM_CONF``), this one or a site's.
Containers in a node share the host's kernel, so Slurm tracks processes by their parents
(``proctrack/linuxproc``), binds no tasks (``task/none``), gathers no accounting and makes
no cgroups; the nodes' CPUs and memory are the configured ones (``config_overrides``).

Everything lives under ``STATE`` (``AFTERSHOCK_SLURM_DIR``, default
``/var/lib/aftershock-slurm``): the configuration (``conf/``), the daemons' logs
(``logs/``), the host's munge socket and a shared folder (``shared/``); the folders jobs
write to are mounted read-write at the same path in every node (``AFTERSHOCK_SLURM_SHARED``,
``:``-separated; default ``/tmp``, the project's ``.aftershock`` and ``shared/``), as NFS is
on a real cluster. ``down`` removes the containers, the network, the host's munged, the
link in ``/etc/slurm`` and ``STATE``.

Usage: ``python -m aftershock.harness.nodes.slurm_cluster up|down|status [--nodes N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aftershock.faults import docker_engine as _docker
from aftershock.faults import slurm_cli as _slurm
from aftershock.harness.nodes import image
from aftershock.harness.nodes.cluster import Cluster

#: The run label every container and the network carry (faults/_docker.py removes by it);
#: never a run's id, so a run's heal never touches the cluster.
CLUSTER_ID = _slurm.TEST_CLUSTER_ID
CONFIG_LABEL = "aftershock.slurm.config"  # a digest of what the containers were made from
CONF_VERSION = 4  # bump when slurm.conf changes: a cluster made from an older one is remade
PARTITION = "debug"
CLUSTER_NAME = "aftershock"
CPUS_PER_NODE = 4  # what each node offers Slurm (config_overrides: not what it has)
MEMORY_MB = 2000
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
HOST_SLURM_CONF = Path("/etc/slurm/slurm.conf")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def state_dir() -> Path:
    return Path(os.environ.get("AFTERSHOCK_SLURM_DIR", "/var/lib/aftershock-slurm"))


def shared_folders() -> list[Path]:
    """Folders mounted read-write, at the same path, in every node: where jobs write
    (run folders default to ``.aftershock/`` of the folder the cluster is started from,
    the repository for ``make slurm-cluster``; never the installed package's folder)."""
    named = os.environ.get("AFTERSHOCK_SLURM_SHARED")
    if named:
        return [Path(p).absolute() for p in named.split(":") if p]
    return [Path("/tmp"), Path.cwd() / ".aftershock", state_dir() / "shared"]


def munge_socket() -> Path:
    """The munge socket of every daemon and of the host's clients: a private one, so a
    munged the host may already run (a site's) is left alone."""
    return Path("/run/aftershock-slurm/munge.socket")


def slurm_conf(*, nodes: int, addresses: list[str]) -> str:
    """slurm.conf of the test cluster: ``addresses[0]`` is slurmctld, ``[1 + i]`` node i."""
    state = state_dir()
    lines = [
        "# Made by harness/nodes/slurm_cluster.py (make slurm-cluster); removed by its down.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost=slurmctld({addresses[0]})",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        # cred_expire is also how long a requeued job waits before it may start again
        # (Slurm's default 120 s); a test cluster requeues at once.
        f"AuthInfo=socket={munge_socket()},cred_expire=10",
        "CredType=cred/munge",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        # Nodes are containers on one kernel: no cgroups of Slurm's own, no binding.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        # A requeued job becomes eligible by the clock, which only the periodic pass sees
        # (60 s by default): a test cluster looks every 2 s.
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        # A node that was DOWN comes back by itself once its slurmd registers again.
        "ReturnToService=2",
        "SlurmdTimeout=20",
        "SlurmctldTimeout=20",
        "InactiveLimit=0",
        # Between SIGTERM and SIGKILL when a job is cancelled, preempted or out of time.
        "KillWait=5",
        "MinJobAge=600",
        "JobRequeue=1",
        f"SlurmctldLogFile={state}/logs/slurmctld.log",
        f"SlurmdLogFile={state}/logs/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for index in range(nodes):
        lines.append(f"NodeName=node{index} NodeAddr={addresses[1 + index]} "
                     f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _host_munged_pid() -> int | None:
    pidfile = munge_socket().parent / "munged.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        if Path(f"/proc/{pid}/comm").read_text().strip() == "munged":
            return pid
    return None


def _munged_argv(folder: str, log: str) -> list[str]:
    conf = state_dir() / "conf"
    return [_program("munged"), "--force", f"--socket={munge_socket()}",
            f"--key-file={conf}/munge.key", f"--pid-file={folder}/munged.pid",
            f"--seed-file={folder}/munged.seed", f"--log-file={log}"]


def _start_host_munged() -> None:
    if _host_munged_pid() is not None:
        return
    folder = munge_socket().parent
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    subprocess.run(_munged_argv(str(folder), str(folder / "munged.log")), check=True)


def _stop_host_munged() -> None:
    pid = _host_munged_pid()
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    shutil.rmtree(munge_socket().parent, ignore_errors=True)


def _daemon_command(daemon: list[str], *, foreground: bool) -> list[str]:
    """A node's PID 1 child: its own munged, then the Slurm daemon: slurmctld in the
    foreground; slurmd as a daemon of its own, the container kept by a ``sleep``, so that
    slurm.kill_slurmd ends slurmd alone (the node, its job steps, stay) as on a host."""
    folder = str(munge_socket().parent)
    munged = " ".join(_munged_argv(folder, f"{folder}/munged.log"))
    script = (f"mkdir -p -m 755 {folder} /var/spool/slurmctld /var/spool/slurmd && "
              f"{munged} && " + (f"exec {' '.join(daemon)}" if foreground else
                                 f"{' '.join(daemon)} && exec sleep infinity"))
    return ["/bin/sh", "-c", script]


def _program(name: str) -> str:
    """The file a program of the host's PATH is: Debian links slurmd through
    /etc/alternatives, which a node (only the host's /usr) does not have."""
    found = shutil.which(name, path=SBIN_PATH)
    if found is None:
        raise RuntimeError(f"{name} is not installed (make slurm-cluster installs it)")
    return os.path.realpath(found)


def _containers(api: Any) -> list[Any]:
    return list(api.containers.list(
        all=True, filters={"label": f"{_docker.RUN_LABEL}={CLUSTER_ID}"}))


def container_ids() -> list[str]:
    """The cluster's containers (slurmctld first), by id; none when it is down."""
    with contextlib.closing(_docker.client()) as api:
        found = _containers(api)
    return [str(c.id) for c in sorted(
        found, key=lambda c: (c.labels.get("aftershock.slurm.role") != "slurmctld", c.name))]


def _digest(nodes: int) -> str:
    text = f"{CONF_VERSION}|{nodes}|{shared_folders()}|{image.host_mounts()}|{state_dir()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _exited() -> str | None:
    """What a container of the cluster that has stopped said last, or None."""
    with contextlib.closing(_docker.client()) as api:
        for container in _containers(api):
            if container.status in ("exited", "dead"):
                said = container.logs(tail=5).decode(errors="replace").strip()
                return f"{container.name} exited: {said}"
    return None


def _answers(timeout: float, dead: Callable[[], str | None] | None = None) -> bool:
    """Whether slurmctld answers the host's clients with every node idle (or allocated);
    ``dead`` says why waiting is pointless (a daemon exited), raised as an error."""
    deadline = time.monotonic() + timeout
    while True:
        if dead is not None and (why := dead()) is not None:
            raise RuntimeError(f"the Slurm cluster did not come up: {why}")
        done = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True,
                              text=True, timeout=30, env=client_env())
        states = done.stdout.split()
        if done.returncode == 0 and states and all(
                s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")
                for s in states):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def client_env() -> dict[str, str]:
    """The environment for the host's Slurm clients: this cluster's slurm.conf."""
    return {**os.environ, "SLURM_CONF": str(state_dir() / "conf" / "slurm.conf")}


def up(nodes: int = 2, *, timeout: float = 60.0) -> float:
    """Bring the cluster up (or keep the one that is up, made the same way); returns the
    seconds it took."""
    started = time.monotonic()
    digest = _digest(nodes)
    with contextlib.closing(_docker.client()) as api:
        present = _containers(api)
        if present and len(present) == nodes + 1 and all(
                c.status == "running" and c.labels.get(CONFIG_LABEL) == digest
                for c in present) and _host_munged_pid() is not None and _answers(5):
            return time.monotonic() - started
    down()
    _make(nodes, digest)
    if not _answers(timeout, dead=_exited):
        raise RuntimeError(f"the Slurm cluster did not come up in {timeout:g}s: see "
                           f"{state_dir()}/logs/")
    return time.monotonic() - started


def _make(nodes: int, digest: str) -> None:
    state = state_dir()
    conf, logs = state / "conf", state / "logs"
    for folder in (conf, logs, state / "shared"):
        folder.mkdir(parents=True, exist_ok=True)
    shared = shared_folders()
    for folder in shared:
        folder.mkdir(parents=True, exist_ok=True)
    key = conf / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    holder = Cluster(run_id=CLUSTER_ID, run_dir=state, nodes=nodes + 1, env={}, cwd=Path("/"))
    with contextlib.closing(_docker.client()) as api:
        holder._api = api
        image_id, _ = image.ensure_base(api)
        holder.make_network()
        addresses = [holder.address(i) for i in range(nodes + 1)]
        (conf / "slurm.conf").write_text(slurm_conf(nodes=nodes, addresses=addresses))
        (conf / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        _link_host_conf(conf / "slurm.conf")
        _start_host_munged()
        names = ["slurmctld", *(f"node{i}" for i in range(nodes))]
        hosts = dict(zip(names, addresses, strict=True))
        binds = [*image.host_mounts(), f"{conf}:{conf}:ro", f"{logs}:{logs}:rw",
                 # Users made since the base image was (slurm, munge), and Debian's
                 # links of slurmd, slurmstepd... through /etc/alternatives.
                 "/etc/passwd:/etc/passwd:ro", "/etc/group:/etc/group:ro",
                 "/etc/alternatives:/etc/alternatives:ro",
                 *(f"{p}:{p}:rw" for p in shared)]
        slurm_file = str(conf / "slurm.conf")
        low = api.api
        made = []
        for index, name in enumerate(names):
            daemon = [_program("slurmctld"), "-D", "-i", "-f", slurm_file] if index == 0 \
                else [_program("slurmd"), "-f", slurm_file, "-N", name]
            host_config = low.create_host_config(
                binds=binds, extra_hosts=hosts, init=True, shm_size="256m",
                restart_policy={"Name": "no"})
            networking = low.create_networking_config(
                {holder.name: low.create_endpoint_config(ipv4_address=addresses[index])})
            created = low.create_container(
                image_id, command=_daemon_command(daemon, foreground=index == 0), hostname=name,
                name=f"aftershock_slurm_{name}", working_dir="/",
                environment={"SLURM_CONF": slurm_file, "PATH": SBIN_PATH},
                labels={_docker.RUN_LABEL: CLUSTER_ID, CONFIG_LABEL: digest,
                        "aftershock.slurm.role": name},
                host_config=host_config, networking_config=networking)
            made.append(str(created["Id"]))
        for container in made:
            low.start(container)


def _link_host_conf(conf: Path) -> None:
    """``/etc/slurm/slurm.conf`` points at this cluster's when the host has none of its
    own, so plain ``sinfo`` works; a site's file is never replaced (``SLURM_CONF`` then)."""
    if HOST_SLURM_CONF.is_symlink() or not HOST_SLURM_CONF.exists():
        HOST_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            HOST_SLURM_CONF.unlink()
        HOST_SLURM_CONF.symlink_to(conf)


def down() -> None:
    """Remove everything ``up`` made; nothing else."""
    if _docker.engine_problem() is None:
        _docker.remove_run(CLUSTER_ID)
    _stop_host_munged()
    if HOST_SLURM_CONF.is_symlink() and \
            os.readlink(HOST_SLURM_CONF).startswith(str(state_dir())):
        HOST_SLURM_CONF.unlink()
    # The shared folder and the logs go with the cluster; the folders named in
    # AFTERSHOCK_SLURM_SHARED are the user's and stay.
    shutil.rmtree(state_dir(), ignore_errors=True)


def status() -> str | None:
    """None when the cluster is up and answers, else why not (one line)."""
    problem = _docker.engine_problem()
    if problem is not None:
        return problem
    if shutil.which("sinfo") is None:
        return "Slurm's clients are not installed (make slurm-cluster installs them)"
    with contextlib.closing(_docker.client()) as api:
        if not _containers(api):
            return "no Slurm test cluster is up: start one with `make slurm-cluster`"
    if _host_munged_pid() is None:
        return "the host's munged of the Slurm test cluster is not running: make slurm-cluster"
    if not _answers(5):
        return "the Slurm test cluster does not answer `sinfo` with idle nodes"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aftershock.harness.nodes.slurm_cluster",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--nodes", type=int, default=2, help="slurmd nodes (default 2)")
    args = parser.parse_args(argv)
    if args.action == "down":
        down()
        print("slurm-cluster: removed")
        return 0
    if args.action == "status":
        problem = status()
        print(problem or f"slurm-cluster: up ({state_dir()})")
        return 0 if problem is None else 1
    problem = _docker.engine_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 3
    took = up(args.nodes)
    print(f"slurm-cluster: {args.nodes} nodes up in {took:.1f}s; "
          f"partition {PARTITION}; SLURM_CONF={state_dir()}/conf/slurm.conf")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
