"""Slurm's own failures: a node set DOWN or DRAINed, a job signalled, a job preempted.

Each kind acts through Slurm's commands (``scontrol``, ``scancel``) on the job of the run
(a ``slurm:`` system: harness/systems/slurm.py) and the nodes it runs on. The target is a
process of the job (``target: {rank: 1}``, ``{node: 1}``): its environment names the job
(``SLURM_JOB_ID``) and the node it runs on (``SLURMD_NODENAME``), as Slurm gave them, and
the job must be named for this run (``SLURM_JOB_NAME=aftershock-<run id>``), so a fault
never acts on anyone else's job. A node set DOWN or DRAINed is journalled and RESUMEd on
exit, by the reaper or by ``aftershock heal``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from aftershock.faults import slurm_cli as _slurm
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef, all_pids
from aftershock.faults._proc import environ as process_environ
from aftershock.faults.journal import Journal, UndoContext, UndoRefused, undone_on_error
from aftershock.faults.params import Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")  # a Slurm node name
_REASON = "aftershock"  # the Reason Slurm shows for a node this harness took down


class NodeDownParams(FaultParams):
    state: Literal["down", "drain"] = Field(
        "down", description="down: the node fails now and its jobs with it (NODE_FAIL; a "
        "job with requeue goes back to the queue); drain: it takes no new job, the running "
        "ones finish")
    duration: Duration | None = Field(None, description="RESUME the node after this long; "
                                      "default: at the end of the run")


class SignalParams(FaultParams):
    signal: str = Field("SIGUSR1", pattern=r"^SIG[A-Z0-9]+$", description="the signal, "
                        "by name")
    scope: Literal["tasks", "batch", "full"] = Field(
        "tasks", description="tasks: every task of the job's steps (scancel --signal); "
        "batch: the batch script's shell only (--batch); full: both (--full)")


    @field_validator("signal")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in signal.Signals.__members__:
            raise ValueError(f"{value} is not a signal of this platform")
        return value


def _job_of(target: ProcessRef, journal: Journal) -> tuple[str, str]:
    """(job id, node name) of the target process, from the environment Slurm gave it; only
    a job named for this run."""
    env = process_environ(target.pid)
    job, node, name = env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME"), \
        env.get("SLURM_JOB_NAME")
    if not job or not node:
        raise FaultUnavailable(f"pid {target.pid} is not a task of a Slurm job (no "
                               "SLURM_JOB_ID, SLURMD_NODENAME in its environment)")
    if name != _slurm.job_name(journal.run_id):
        raise FaultUnavailable(f"job {job} ({name}) is not this run's "
                               f"({_slurm.job_name(journal.run_id)})")
    return job, node


def _preflight() -> list[str]:
    problem = _slurm.problem()
    return [] if problem is None else [problem]


class _SlurmKind:
    acts: Acts = "outside"
    needs = frozenset({"slurm"})

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        return _preflight()


class NodeDown(_SlurmKind):
    params = NodeDownParams
    info = KindInfo(
        kind="slurm.node_down",
        summary="Slurm takes the node of the target out of service: DOWN (it fails now, "
        "with its jobs: NODE_FAIL, requeued if the job allows it) or DRAIN (no new jobs).",
        caused_by="`scontrol update nodename=<node> state=DOWN|DRAIN reason=aftershock`, as "
        "an administrator or a health check does; the node's slurmd keeps running.",
        reverted_by="`scontrol update nodename=<node> state=RESUME`, after `duration` or at "
        "the end of the run; a crashed harness's reaper or `aftershock heal` does it too.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        state = NodeDownParams.bind(params).state
        job, node = _job_of(target, journal)
        undo = {"node": node, "run": journal.run_id, "job": job}
        entry = journal.intend(self.info.kind, undo)
        with undone_on_error(journal, entry, self.revert, undo):
            _slurm.run(["scontrol", "update", f"nodename={node}", f"state={state.upper()}",
                        f"reason={_REASON}"])
        return Applied(self.info.kind, entry, undo, f"node {node} of job {job} set "
                       f"{state.upper()}")

    def revert(self, undo: Mapping[str, Any]) -> None:
        node = str(undo["node"])
        record = _slurm.run(["scontrol", "show", "node", "-o", node])
        fields = _slurm.parse_record(record)
        states = fields.get("State", "")
        if "DOWN" in states or "DRAIN" in states:
            _slurm.run(["scontrol", "update", f"nodename={node}", "state=RESUME"])

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        if not isinstance(undo.get("node"), str) or not _NODE.match(undo["node"]):
            raise UndoRefused(f"node {undo.get('node')!r} is not a Slurm node name")
        if undo.get("run") != context.run_id:
            raise UndoRefused(f"run {undo.get('run')!r} is not this journal's {context.run_id}")


class Signal(_SlurmKind):
    params = SignalParams
    info = KindInfo(
        kind="slurm.signal",
        summary="Slurm signals the job of the target: every task of its steps, its batch "
        "script, or both, as `scancel --signal` does on any node of the cluster.",
        caused_by="`scancel --signal=<SIG> [--batch|--full] <job>`: slurmd on each node of "
        "the job delivers it.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        bound = SignalParams.bind(params)
        name = signal.Signals[bound.signal].name.removeprefix("SIG")
        job, _ = _job_of(target, journal)
        scope = {"tasks": [], "batch": ["--batch"], "full": ["--full"]}[bound.scope]
        _slurm.run(["scancel", f"--signal={name}", *scope, job])
        return Applied(self.info.kind, None, {}, f"SIG{name} -> job {job} ({bound.scope})")

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class Preempt(_SlurmKind):
    params = FaultParams
    info = KindInfo(
        kind="slurm.preempt",
        summary="The job of the target is preempted, as a higher-priority job's arrival does "
        "on a shared cluster: every process of it gets SIGTERM, SIGKILL after the cluster's "
        "grace (KillWait), and the job goes back to the queue (a job submitted with "
        "requeue) or is cancelled.",
        caused_by="`scontrol requeue <job>` when the job may be requeued, else `scancel "
        "<job>`: slurmctld ends the job as preemption does (slurmd sends SIGCONT and SIGTERM "
        "to the batch script and every step, SIGKILL after KillWait), then requeues it.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        job, _ = _job_of(target, journal)
        record = _slurm.show_job(job) or {}
        # Requeue=1: the job was submitted with --requeue (or the cluster's JobRequeue).
        if record.get("Requeue") == "1":
            _slurm.run(["scontrol", "requeue", job])
            return Applied(self.info.kind, None, {}, f"job {job} preempted: requeued")
        _slurm.run(["scancel", job])
        return Applied(self.info.kind, None, {}, f"job {job} preempted: cancelled (no requeue)")

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class KillSlurmdParams(FaultParams):
    duration: Duration | None = Field(None, description="start slurmd again after this long; "
                                      "default: at the end of the run")


_SLURMD = ("slurmd", "slurmd-wlm")  # Debian installs it as slurmd-wlm, linked as slurmd
SLURMD_START_S = 10.0  # how long a revert waits to see the slurmd it started running


def _slurmd_of(node: str) -> tuple[ProcessRef, list[str]] | None:
    """The slurmd of ``node`` on this host, and its arguments: one started ``-N <node>``."""
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = [a.decode(errors="replace") for a in handle.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv or argv[0].rsplit("/", 1)[-1] not in _SLURMD or "-N" not in argv:
            continue
        at = argv.index("-N")
        if argv[at + 1:at + 2] == [node]:
            ref = ProcessRef.of(pid)
            if ref is not None:
                return ref, argv
    return None


class KillSlurmd(_SlurmKind):
    params = KillSlurmdParams
    info = KindInfo(
        kind="slurm.kill_slurmd",
        summary="slurmd dies on the node of the target: the job's processes there run on, but "
        "slurmctld hears nothing from the node; past SlurmdTimeout it sets the node DOWN "
        "(NODE_FAIL for its jobs).",
        caused_by="SIGKILL to the node's slurmd (the one started `-N <node>`), found on this "
        "host: the nodes of `make slurm-cluster` only (docs/scale-out.md).",
        reverted_by="slurmd started again in the node's container with the same arguments, "
        "after `duration` or at the end of the run, unless one runs there; a crashed "
        "harness's reaper or `aftershock heal` does it too.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        from aftershock.faults import _docker

        job, node = _job_of(target, journal)
        found = _slurmd_of(node)
        if found is None:
            raise FaultUnavailable(f"no slurmd of node {node} on this host (only the nodes "
                                   "of `make slurm-cluster` are reachable)")
        ref, argv = found
        container = _docker.container_of(ref.pid)
        if container is None:
            raise FaultUnavailable(f"the slurmd of node {node} is not in a container")
        undo = {"node": node, "run": journal.run_id, "container": container, "argv": argv}
        entry = journal.intend(self.info.kind, undo)
        with undone_on_error(journal, entry, self.revert, undo):
            ref.signal(signal.SIGKILL)
        return Applied(self.info.kind, entry, undo,
                       f"SIGKILL -> slurmd of node {node} (pid {ref.pid}; job {job})")

    def revert(self, undo: Mapping[str, Any]) -> None:
        from aftershock.faults import _docker

        if _slurmd_of(str(undo["node"])) is not None:
            return  # one runs there again (the node was restarted)
        api = _docker.client()
        try:
            node = _docker.inspect(api, str(undo["container"]))
            if node is None or node.status != "running":
                return  # the node is gone: nothing to start slurmd in
            # Detached: slurmd daemonizes, but a start that hangs must not hold the heal
            # (a Ctrl-C's teardown) for the engine's whole API timeout; it is looked for.
            api.api.exec_start(api.api.exec_create(node.id, [str(a) for a in undo["argv"]]),
                               detach=True)
        finally:
            api.close()
        deadline = time.monotonic() + SLURMD_START_S
        while _slurmd_of(str(undo["node"])) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurmd of node {undo['node']} did not start again within "
                                   f"{SLURMD_START_S:g}s")
            time.sleep(0.1)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        from aftershock.faults import _docker

        NodeDown().validate(undo, context)
        argv = undo.get("argv")
        node = undo["node"]
        if not (isinstance(argv, list) and len(argv) == 5 and all(isinstance(a, str)
                                                                 for a in argv)
                and argv[0].rsplit("/", 1)[-1] in _SLURMD and argv[0].startswith("/usr/")
                and argv[1] == "-f" and argv[3:] == ["-N", node]):
            raise UndoRefused(f"argv {argv!r} is not `slurmd -f CONF -N {node}`")
        if not _docker.is_container_id(undo.get("container")):
            raise UndoRefused(f"container {undo.get('container')!r} is not a container id")
        with contextlib.closing(_docker.client()) as api:
            found = api.containers.get(str(undo["container"]))
            if found.labels.get(_docker.RUN_LABEL) != _slurm.TEST_CLUSTER_ID:
                raise UndoRefused(f"container {str(undo['container'])[:12]} is not a node of "
                                  "the Slurm test cluster")


NODE_DOWN = register(NodeDown())
KILL_SLURMD = register(KillSlurmd())
SIGNAL = register(Signal())
PREEMPT = register(Preempt())
