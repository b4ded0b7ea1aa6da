"""A Slurm job as the run loop drives it (a :class:`aftershock.harness.run.target.Target`).

``start`` writes the batch script into the run folder and submits it with ``sbatch``; the
job is named ``aftershock-<run id>`` (faults/slurm_cli.py), which the heal journal records
before anything is submitted, so a killed harness's reaper or ``aftershock heal`` cancels
it (faults/heal.py). ``poll`` asks Slurm for the job's state (``scontrol show job``) and
writes each change to the timeline (``slurm_state``: state, reason, requeue count, nodes),
and ``stop`` cancels the job, waits for Slurm to end it, and records Slurm's final view
(``slurm_job``). The job's output is ``logs/slurm-<job id>.out`` in the run folder.

Where the nodes share this host's kernel (the test cluster of ``make slurm-cluster``), the
job's processes are this host's too, found by the run id in their environment, so faults
that signal a process reach its ranks; on a site's cluster they are on other hosts, and
only Slurm's own faults (faults/slurm.py) reach the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from aftershock.faults import ProcessRef, processes_with_env
from aftershock.faults import process_environ as environ
from aftershock.faults import slurm_cli as slurm
from aftershock.harness import probe
from aftershock.harness.errors import TargetError
from aftershock.harness.nodes.cluster import end_run_processes, node_env
from aftershock.harness.run.logprobe import (
    LOG_UNREAD,
    TAILED_TIMES,
    CompiledProbes,
    ProbeReader,
    StreamStamps,
    compile_probes,
)
from aftershock.harness.run.records import Event
from aftershock.harness.run.target import (
    DRAIN_S,
    STOP_GRACE_S,
    Launch,
    Teardown,
    _Tailer,
    files_before,
    interpreter_bin,
    read_file_line,
)
from aftershock.harness.run.timeline import Timeline

POLL_S = 0.5  # how often Slurm is asked for the job's state (each ask is a command)
#: All that stop may take, every Slurm command included: scancel, then the wait for Slurm to
#: end the job (the cluster's KillWait, SIGTERM to SIGKILL, and the epilogue), then Slurm's
#: final view of it. A Ctrl-C waits this long at most for Slurm; what is left then is said
#: and left to `aftershock heal`.
STOP_BUDGET_S = 60.0
RECORD_RESERVE_S = 10.0  # of the budget, kept for the final record after the cancel
CALL_S = 5.0  # the most one command of that final record may take
#: What the timeline keeps of Slurm's view of the job.
FIELDS = ("JobId", "JobState", "Reason", "Restarts", "Requeue", "ExitCode", "NodeList",
          "BatchHost", "NumNodes", "NumTasks", "Partition", "Account", "RunTime",
          "SubmitTime", "StartTime", "EndTime", "PreemptTime")


def _view(record: dict[str, str]) -> dict[str, str]:
    return {key: record[key] for key in FIELDS if key in record}


class SlurmTarget:
    """One Slurm job of one run."""

    #: Signals and memory reach the ranks where the nodes share this host's kernel; the run
    #: folder is the job's shared storage; the test cluster's nodes are containers (node.freeze
    #: and node.partition act on them: faults/node.py).
    capabilities: ClassVar[frozenset[str]] = frozenset({"signals", "files", "slurm",
                                                        "containers"})

    def __init__(self, launch: Launch, *, run_dir: Path, run_id: str,
                 timeline: Timeline) -> None:
        self.launch = launch
        self.run_dir = run_dir.absolute()
        self.run_id = run_id
        self.timeline = timeline
        self.name = slurm.job_name(run_id)
        self.job_id: str | None = None
        self.coordinates: dict[int, tuple[int, int]] = {}
        self._last_poll = 0.0
        self._last: dict[str, str] = {}
        self._code: int | None = None
        self._names: dict[str, list[str]] = {}  # a node list -> its host names
        # The job's log lines, read as they are written (a `command` or `script` job's
        # probes): the output file Slurm appends to over requeues, and its `logs` files.
        self._tailer: _Tailer | None = None
        self._reader = ProbeReader(timeline.write)
        self._submitted = False  # sbatch was called: a job of this name may exist
        self._started = time.monotonic()
        self._clock_offset = time.time() - self._started

    def tracking(self) -> dict[str, Any]:
        """The heal journal's launch record: the job by its name (a heal cancels it) and,
        as for local processes, the run id every process of the job carries."""
        return {"env": probe.RUN_ID_ENV, "value": self.run_id, "cgroup": None,
                "slurm_job_name": self.name}

    def folders(self) -> list[Path]:
        return []

    def env(self) -> dict[str, str]:
        """The job's environment (sbatch --export=ALL): the harness's own, the run's (the
        shared timeline, the run id) and the scenario's."""
        # As an activated environment would: the harness's own bin folder first, so a
        # script's `torchrun` is the one installed beside the harness.
        path = os.environ.get("PATH", "/usr/bin:/bin")
        if path.split(os.pathsep)[0] != interpreter_bin():
            path = os.pathsep.join([interpreter_bin(), path])
        return {**os.environ, **node_env(self.run_dir, self.run_id), **self.launch.env,
                "PATH": path}

    def start(self) -> None:
        for folder in ("logs", "output", "nvml", "slurm", "checkpoints"):
            (self.run_dir / folder).mkdir(parents=True, exist_ok=True)
        problem = slurm.problem()
        if problem is not None:
            raise TargetError(f"a slurm system is submitted with sbatch: {problem}")
        self._write_files()
        script = self.run_dir / "slurm" / "job.sh"
        script.write_text(getattr(self.launch, "script", ""))
        script.chmod(0o755)
        argv = ["sbatch", "--parsable", f"--job-name={self.name}",
                f"--chdir={self.launch.cwd}", *getattr(self.launch, "sbatch", ()), str(script)]
        before = files_before(self.launch.tails)
        self._submitted = True
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env(),
                              timeout=slurm.CALL_TIMEOUT_S)
        if done.returncode != 0:
            raise TargetError(f"sbatch refused the job: {done.stderr.strip()}")
        self.job_id = done.stdout.strip().split(";")[0]
        self.timeline.emit("slurm_submitted", job_id=self.job_id, name=self.name,
                           sbatch=argv[1:-1])
        if self.launch.tails:
            self._tailer = _Tailer(self.launch.tails, self._on_line(),
                                   self.run_dir / "logs" / TAILED_TIMES,
                                   self._file_appeared, self.timeline.room, before)
            self._tailer.start()

    def _write_files(self) -> None:
        """The files the job runs besides its batch script (a user's script and the `srun`
        that records its steps: systems/slurm.py's srun_files), executable."""
        from aftershock.harness.systems.slurm import SRUN_EPILOG_MARK

        files: tuple[tuple[str, str], ...] = getattr(self.launch, "files", ())
        if not files:
            return
        # srun --epilog would replace a site's own SrunEpilog: the steps' ids go unrecorded
        # there rather than the site's epilog unrun.
        try:
            mark = "" if slurm.srun_epilog() else "1"
        except slurm.SlurmError:
            mark = ""
        for relative, text in files:
            path = self.run_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace(SRUN_EPILOG_MARK, mark))
            path.chmod(0o755)

    def _file_appeared(self, path: str, absent_at: float | None) -> None:
        self.timeline.write(Event(t=time.monotonic(), event="log_appeared", source="harness",
                                  fields={"path": path, "absent_at": absent_at}))

    def _on_line(self) -> Callable[[str, bytes, float], None]:
        # Slurm's output file holds the job's stdout and stderr both: every probe reads it.
        # The per-process files of `logs` are each a stream of their own (`stream: logs`).
        output: CompiledProbes = compile_probes(
            [p.model_copy(update={"stream": "both"}) for p in self.launch.probes], "both")
        files: CompiledProbes = compile_probes(self.launch.probes, "logs")
        stamps: dict[str, StreamStamps] = {}
        prefix = str(self.run_dir / "logs" / "slurm-")

        def on_line(path: str, raw: bytes, read_t: float) -> None:
            compiled = output if path.startswith(prefix) else files
            read_file_line(self._reader, compiled, path, raw, read_t=read_t, stamps=stamps,
                           clock_offset=self._clock_offset, started=self._started)

        return on_line

    def _drain(self) -> None:
        """Read what the job wrote last, then say which streams were left unread."""
        if self._tailer is None:
            return
        self._tailer.finish(time.monotonic() + DRAIN_S)
        self._tailer.thread.join(timeout=DRAIN_S + 1.0)
        self._tailer = None
        matching = self._reader.close()
        if matching:
            where = next(iter(matching.values()))
            self.timeline.emit(LOG_UNREAD, "log-reader", stream="the job's output",
                               why=f"its probes were still on line {where}",
                               kinds=sorted({p.event for p in self.launch.probes}))

    def launched(self) -> dict[str, Any]:
        return {"tracking": "slurm", "job_id": self.job_id, "job_name": self.name}

    def observe(self, event: Event) -> None:
        # A hello's pid is its node's own (a PID namespace of its own on the test cluster, a
        # host of its own on a site's): ranks are found by RANK in their environment instead.
        if event.event != "hello":
            return
        replica, shard = event.fields.get("replica"), event.fields.get("shard")
        if event.rank is not None and isinstance(replica, int) and isinstance(shard, int):
            self.coordinates[event.rank] = (replica, shard)

    def _refresh(self, force: bool = False) -> dict[str, str]:
        now = time.monotonic()
        if self.job_id is None or (not force and now - self._last_poll < POLL_S):
            return self._last
        self._last_poll = now
        try:
            record = slurm.show_job(self.job_id)
        except slurm.SlurmError:
            return self._last  # slurmctld busy or away for a moment: asked again next poll
        if record is None:
            return self._last
        view = _view(record)
        keys = ("JobState", "Reason", "Restarts", "NodeList")
        if [view.get(k) for k in keys] != [self._last.get(k) for k in keys]:
            changed: dict[str, Any] = {k.lower(): view.get(k) for k in keys}
            self.timeline.emit("slurm_state", job_id=self.job_id, **changed)
        self._last = view
        if view.get("JobState") in slurm.TERMINAL:
            self._code = slurm.exit_status(record)
        return view

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        self._refresh()
        return self._code

    def processes(self) -> list[ProcessRef]:
        """The job's processes this host can see (the test cluster's nodes share its
        kernel); none on a site's cluster."""
        return processes_with_env(probe.RUN_ID_ENV, self.run_id)

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> its process: the topmost process of the job with that ``RANK``."""
        by_rank: dict[int, list[ProcessRef]] = {}
        for ref in self.processes():
            value = environ(ref.pid).get("RANK")
            if value is not None and value.isdigit():
                by_rank.setdefault(int(value), []).append(ref)
        return {rank: min(refs, key=lambda r: r.start) for rank, refs in by_rank.items()}

    def role_processes(self, role: str) -> list[ProcessRef]:
        return []

    def node_processes(self, node: int) -> list[ProcessRef]:
        """Node ``node`` of the job's allocation (in Slurm's order of its node list), as the
        topmost process of the job there: its environment names the job and the node
        (``SLURM_JOB_ID``, ``SLURMD_NODENAME``), which the Slurm faults act on."""
        names = self._hostnames(self._refresh().get("NodeList", ""))
        if not 0 <= node < len(names):
            return []
        there = [ref for ref in self.processes()
                 if environ(ref.pid).get("SLURMD_NODENAME") == names[node]]
        return [min(there, key=lambda r: r.start)] if there else []

    def _hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist == "(null)":
            return []
        if nodelist not in self._names:
            try:
                text = slurm.run(["scontrol", "show", "hostnames", nodelist])
            except slurm.SlurmError:
                return []
            self._names[nodelist] = text.split()
        return self._names[nodelist]

    def _record_steps(self, job_id: str, deadline: float) -> None:
        """Each step's exit code on the timeline (``slurm_step``), from Slurm's accounting
        where the cluster keeps one (``sacct``), else from the job's own record of its steps
        (``<run>/slurm/steps.jsonl``: the batch script the harness wrote records its one
        step, the `srun` it puts before a user's script each of that script's); a verdict
        then rests on more than the job's own logs."""
        from aftershock.harness.systems.slurm import STEPS_FILE

        rows = slurm.job_steps(job_id, timeout=max(1.0, min(deadline - time.monotonic(),
                                                            CALL_S)))
        if rows is not None:
            for row in rows:
                code, _, sig = row.get("ExitCode", "").partition(":")
                status = int(code) if code.isdigit() else None
                if status == 0 and sig.isdigit() and int(sig):
                    status = 128 + int(sig)
                self.timeline.emit("slurm_step", job_id=job_id, step=row.get("JobID"),
                                   state=row.get("State"), exit_code=status,
                                   nodes=row.get("NodeList"), source="sacct")
            return
        with contextlib.suppress(OSError):
            for line in (self.run_dir / "slurm" / STEPS_FILE).read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a node that died mid-write
                if isinstance(record, dict) and record.get("job_id") == job_id:
                    self.timeline.emit("slurm_step", job_id=job_id, step=record.get("step"),
                                       restart=record.get("restart"),
                                       exit_code=record.get("exit_code"),
                                       nodes=record.get("nodes"),
                                       source=record.get("source", "batch script"))

    def stop(self, grace: float = STOP_GRACE_S) -> Teardown:
        """Cancel the job (SIGTERM, SIGKILL after the cluster's KillWait), wait until Slurm
        has ended it, and record Slurm's final view of it; then end whatever process of the
        run this host still has. All of it within STOP_BUDGET_S, however slow or absent
        slurmctld is (a Ctrl-C must end the harness): a job still in the queue then is said
        (``slurm_left``) and stays in the heal journal, for ``aftershock heal``."""
        cancelled = True
        deadline = time.monotonic() + STOP_BUDGET_S
        # Cancelled by name, with or without a job id: an sbatch that Ctrl-C cut short may
        # have submitted the job all the same.
        if self._submitted:
            try:
                slurm.cancel_named(self.name, patience_s=STOP_BUDGET_S - RECORD_RESERVE_S)
            except slurm.SlurmError as exc:
                cancelled = False  # the journal's launch record stays pending: heal retries
                jobs = exc.jobs if isinstance(exc, slurm.JobsLeft) else []
                self.timeline.emit("slurm_left", name=self.name, job_id=self.job_id,
                                   jobs=[{"job_id": j, "state": st} for j, st in jobs],
                                   error=str(exc), heal="aftershock heal")
        if self.job_id is not None:
            with contextlib.suppress(slurm.SlurmError):
                left = deadline - time.monotonic()
                record = slurm.show_job(self.job_id, timeout=max(1.0, min(left, CALL_S)))
                if record is not None:
                    view: dict[str, Any] = _view(record)
                    self.timeline.emit("slurm_job", **view)
                self._record_steps(self.job_id, deadline)
        self._drain()
        survivors = end_run_processes(self.run_id)
        return Teardown(tracking="slurm", survivors=survivors, logs_open=(),
                        cgroup_removed=None if cancelled else False)
