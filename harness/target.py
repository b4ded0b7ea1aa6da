"""Local target: launch the system under test as real processes, find its ranks, end it.

Everything launched starts inside the run's own cgroup v2 group, where the machine
allows one, and carries ``AFTERSHOCK_RUN_ID`` in its environment. The group holds
every descendant, including one that scrubbed its environment and started a new
session (``env -i setsid daemon &``); the run id finds torchrun's workers, which
start their own sessions and so escape process-group signals, where there is no
group, and lets a later ``aftershock heal`` find a crashed harness's processes.
Both are in the heal journal's ``launch`` record (``LocalTarget.tracking``).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from faults import _cgroup
from faults._proc import ProcessRef, environ, kill_all, processes_with_env
from harness import probe
from harness.errors import TargetError
from harness.logprobe import TIMES_SUFFIX, CompiledProbes, compile_probes, line_events
from harness.spec import CommandSystem, LogProbe, ServerSystem, TrainerSystem
from harness.timeline import Timeline

LINE_LIMIT = 64 * 1024  # bytes of one log line the probes see; a longer line is only logged
LOG_LIMIT = 1 << 30  # bytes kept per launcher log file (1 GiB); the rest is read and dropped
KILL_S = 5.0  # how long teardown keeps killing the run's processes before it reports survivors
DRAIN_S = 1.0  # after the kill, how long the log pumps may still read what the job wrote


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    world: int | None
    probes: tuple[LogProbe, ...]


def trainer_argv(system: TrainerSystem, run_dir: Path, seed: int) -> list[str]:
    """torchrun running the reference trainer: the harness reaches it only by command line."""
    spares = system.spares if system.recovery == "hot_spare" else 0
    extra = [f"--spares={spares}", f"--snapshot-every={system.snapshot_every}"] if spares else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={system.world.size + spares}",
        f"--max-restarts={system.max_restarts}",
        # Short monitor interval: the agent's reaction to a dead worker is part of
        # what `restart` recovery costs; the 0.1 s default is already fine, be explicit.
        "--monitor-interval=0.1",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "--tee=3",
        "-m",
        "reference_impl.trainer",
        f"--replicas={system.world.replicas}",
        f"--shards={system.world.shards}",
        f"--steps={system.steps}",
        f"--seed={seed}",
        f"--checkpoint-every={system.checkpoint_every}",
        f"--checkpoint-dir={run_dir / 'checkpoints'}",
        f"--collective-timeout={system.collective_timeout.total_seconds():g}",
        f"--recovery={system.recovery}",
        f"--backend={system.backend}",
        f"--step-sleep={system.step_sleep.total_seconds():g}",
        f"--device={'cuda' if system.backend == 'nccl' else 'cpu'}",
        *extra,
    ]


def server_argv(system: ServerSystem) -> list[str]:
    """The reference server's launcher (router + workers); it says where it listens
    through the probe's ``serving_ready`` event."""
    def seconds(value: timedelta) -> str:
        return f"{value.total_seconds():g}"

    flags = [("--no-journal", not system.journal), ("--no-checksums", not system.checksums),
             ("--no-batch-invariant", not system.batch_invariant)]
    return [
        sys.executable, "-m", "reference_impl.serving.server",
        f"--workers={system.workers}",
        f"--seed={system.model_seed}",
        f"--max-batch={system.max_batch}",
        f"--recovery={system.recovery}",
        f"--heartbeat={seconds(system.heartbeat)}",
        f"--dead-after={seconds(system.dead_after)}",
        f"--wedged-after={seconds(system.wedged_after)}",
        f"--step-sleep={seconds(system.step_sleep)}",
        *[flag for flag, on in flags if on],
        *system.args,
    ]


def plan_launch(
    system: TrainerSystem | ServerSystem | CommandSystem, *, run_dir: Path, scenario_dir: Path,
    seed: int, extra_args: tuple[str, ...] = (),
) -> Launch:
    if isinstance(system, ServerSystem):
        return Launch([*server_argv(system), *extra_args], Path.cwd(), dict(system.env),
                      system.workers, ())
    if isinstance(system, TrainerSystem):
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **system.env}
        argv = [*trainer_argv(system, run_dir, seed), *extra_args]
        return Launch(argv, Path.cwd(), env, system.world.size, ())
    cwd = (scenario_dir / system.cwd).resolve() if system.cwd else scenario_dir.resolve()
    variables = {"run_dir": str(run_dir), "scenario_dir": str(scenario_dir.resolve())}

    def expand(text: str) -> str:
        # Only ${run_dir} and ${scenario_dir}: a fresh folder per run keeps a job's
        # checkpoints from leaking from the fault-free baseline into the faulted run.
        return re.sub(r"\$\{(run_dir|scenario_dir)\}", lambda m: variables[m.group(1)], text)

    return Launch(
        [expand(arg) for arg in system.command],
        cwd,
        {key: expand(value) for key, value in system.env.items()},
        system.world,
        tuple(system.probes),
    )


@dataclass(frozen=True, slots=True)
class Teardown:
    """What ending a run's processes achieved, for its timeline and its heal journal."""

    tracking: str  # "cgroup": the run's own cgroup; "env": the AFTERSHOCK_RUN_ID scan alone
    survivors: tuple[int, ...]  # pids of the run still alive when the harness gave up
    logs_open: tuple[str, ...]  # launcher streams still held open by a process not ended
    cgroup_removed: bool | None  # None: the run had no cgroup

    @property
    def complete(self) -> bool:
        return not self.survivors and self.cgroup_removed is not False


class _LogPump:
    """Copies one launcher pipe into its log file and feeds each line to the log probes.

    It reads the raw descriptor with a short poll, so no wait of the harness depends on
    the pipe's writers: a daemon the harness could not end may hold the pipe open for
    ever, and after ``finish(deadline)`` the pump stops at end-of-file or at the
    deadline, whichever comes first. Memory is bounded whatever the job writes: a line
    longer than LINE_LIMIT is logged whole but only its prefix reaches the probes, and a
    log file stops growing at LOG_LIMIT, with a note saying how much was dropped.
    """

    def __init__(self, name: str, stream: IO[bytes], path: Path,
                 on_line: Callable[[bytes, float], None]) -> None:
        self.name = name
        self.stream = stream
        self.path = path
        self.eof = False
        self._on_line = on_line
        self._line = bytearray()
        self._line_start = 0  # offset in the stream where the current line began
        self._fed = 0  # bytes of the stream fed to the probes so far
        self._times: IO[str] | None = None  # <log>.times: each line's offset and read time
        self._written = 0
        self._dropped = 0
        self._stop_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"log-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self, deadline: float) -> None:
        self._stop_at = deadline

    def _run(self) -> None:
        fd = self.stream.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        with open(self.path, "wb") as log, \
                open(str(self.path) + TIMES_SUFFIX, "w") as self._times:
            try:
                while self._stop_at is None or time.monotonic() < self._stop_at:
                    if not poller.poll(100):
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        self.eof = True
                        break
                    self._log(log, chunk)
                    self._feed(chunk)
            finally:
                if self._line:  # the last line had no newline
                    self._emit_line()
                if self._dropped:
                    log.write(f"\n[aftershock: {self._dropped} more bytes were read and "
                              "dropped]\n".encode())

    def _log(self, log: IO[bytes], chunk: bytes) -> None:
        room = max(0, LOG_LIMIT - self._written)
        if room:
            log.write(chunk[:room])
            self._written += min(room, len(chunk))
        if len(chunk) > room:
            if not self._dropped:
                log.write(f"\n[aftershock: log truncated at {LOG_LIMIT} bytes; the rest of "
                          "this stream is read and dropped]\n".encode())
            self._dropped += len(chunk) - room
        log.flush()

    def _feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start : len(chunk) if end < 0 else end]
            room = LINE_LIMIT - len(self._line)
            if room > 0:
                self._line += piece[:room]
            if end < 0:
                self._fed += len(chunk) - start
                return
            self._fed += end + 1 - start
            self._emit_line()
            start = end + 1

    def _emit_line(self) -> None:
        """One whole line (or the unterminated last one): its capture time is now, when the
        harness has all of it; `<log>.times` keeps it by the line's offset in the log, so a
        re-check (harness/recheck.py) can time a match the live probes never made."""
        raw = bytes(self._line)
        self._line.clear()
        read_t = time.monotonic()
        if self._times is not None and self._line_start < LOG_LIMIT:
            with contextlib.suppress(OSError):
                self._times.write(f"{self._line_start} {read_t:.6f}\n")
                self._times.flush()
        self._line_start = self._fed
        with contextlib.suppress(Exception):  # a probe that fails must not stop the log
            self._on_line(raw, read_t)


class LocalTarget:
    """The system under test as a local process tree.

    Its processes are tracked by the run's own cgroup v2 group where this machine lets
    the harness make one (faults/_cgroup.py), and by ``AFTERSHOCK_RUN_ID`` in their
    environment always: the group catches a process that dropped its environment, the
    scan one that left the group.
    """

    def __init__(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline) -> None:
        self.launch = launch
        self.run_dir = run_dir
        self.run_id = run_id
        self.timeline = timeline
        self.proc: subprocess.Popen[bytes] | None = None
        self._pumps: list[_LogPump] = []
        self._logs = run_dir / "logs"
        self._reported: dict[int, tuple[int | None, str | None]] = {}
        self.coordinates: dict[int, tuple[int, int]] = {}  # rank -> (replica, shard)
        # Log lines' own times (LogProbe.clock): nothing the run prints can be older than
        # this, and Unix times convert with this one offset, fixed for the whole run.
        self._started = time.monotonic()
        self._clock_offset = time.time() - self._started
        self.cgroup, self.tracking_note = _cgroup.run_group_dir(run_id)

    def tracking(self) -> dict[str, Any]:
        """How the run's processes are found, as the heal journal records it: the run id
        in their environment, and the run's cgroup (None where none could be made)."""
        return {"env": probe.RUN_ID_ENV, "value": self.run_id,
                "cgroup": None if self.cgroup is None else str(self.cgroup)}

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.launch.env)
        env[probe.EVENTS_ENV] = str(self.timeline.path)
        env[probe.OUTPUT_ENV] = str(self.run_dir / "output")
        env[probe.RUN_ID_ENV] = self.run_id
        env[probe.COMMANDS_ENV] = str(self.run_dir / "commands.jsonl")
        # The simulated NVML (faults/nvml_sim.py) a rank opts into when it has no real GPU.
        env.setdefault("AFTERSHOCK_NVML_DIR", str(self.run_dir / "nvml"))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> None:
        self._logs.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "output").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "nvml").mkdir(parents=True, exist_ok=True)
        cwd = self.launch.cwd
        if not cwd.is_dir():
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: its working directory "
                              f"{str(cwd)!r} does not exist")
        if self.cgroup is not None:
            try:
                self.cgroup.mkdir()
            except OSError as exc:
                self.tracking_note = f"cannot create {self.cgroup}: {exc.strerror}"
                self.cgroup = None
        try:
            self.proc = subprocess.Popen(
                self.launch.argv,
                cwd=cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Own session: Ctrl-C in the harness's terminal reaches the harness,
                # which then tears the target down in order, not the target directly.
                start_new_session=True,
                # Into the run's group before exec, so not even the launcher's first
                # child can start outside it.
                preexec_fn=None if self.cgroup is None else _entering(self.cgroup),
            )
        except OSError as exc:
            self._drop_group()
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: {exc.strerror}") from exc
        except subprocess.SubprocessError as exc:  # the move into the group failed
            self._drop_group()
            raise TargetError(f"cannot launch {self.launch.argv[0]!r} inside its cgroup "
                              f"{self.cgroup}: {exc}") from exc
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            pump = _LogPump(name, stream, self._logs / f"launcher.{name}.log",
                            self._line_handler(name))
            pump.start()
            self._pumps.append(pump)

    def _drop_group(self) -> None:
        if self.cgroup is not None:
            _cgroup.remove_tree(self.cgroup)

    def _line_handler(self, name: str) -> Callable[[bytes, float], None]:
        compiled: CompiledProbes = compile_probes(self.launch.probes, name)

        def on_line(raw: bytes, read_t: float) -> None:
            if not compiled:
                return
            for event in line_events(raw.decode(errors="replace"), compiled, read_t=read_t,
                                     clock_offset=self._clock_offset, started=self._started):
                self.timeline.write(event)

        return on_line

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def processes(self) -> list[ProcessRef]:
        """Every live process of the run: its cgroup's members where it has one (exact and
        cheap), else every process that carries the run id in its environment."""
        if self.cgroup is None:
            return processes_with_env(probe.RUN_ID_ENV, self.run_id)
        refs = (ProcessRef.of(pid) for pid in _cgroup.subtree_members(self.cgroup))
        return [ref for ref in refs if ref is not None and ref.alive()]

    def note_hello(self, pid: int, rank: int | None, role: str | None,
                   replica: int | None = None, shard: int | None = None) -> None:
        """What a process said about itself through the probe outranks its environment."""
        self._reported[pid] = (rank, role)
        if rank is not None and replica is not None and shard is not None:
            self.coordinates[rank] = (replica, shard)

    def role_processes(self, role: str) -> list[ProcessRef]:
        if role == "launcher":
            root = ProcessRef.of(self.proc.pid) if self.proc is not None else None
            return [root] if root is not None and root.alive() else []
        return [
            ref for ref in self.processes()
            if self._reported.get(ref.pid, (None, None))[1] == role
        ]

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> process. Once any process of the run has said who it is through the
        probe's ``hello``, only those reports count: a supervisor or a re-forked spare
        inherits ``RANK`` from torchrun but is not that rank."""
        if not self._reported:
            return self._env_rank_processes()
        live = {ref.pid: ref for ref in self.processes()}
        ranks: dict[int, ProcessRef] = {}
        for pid, (rank, role) in self._reported.items():
            if pid in live and rank is not None and role in (None, "trainer", "worker"):
                ranks[rank] = live[pid]
        return ranks

    def _env_rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> the topmost live process whose environment says ``RANK=rank``.

        A rank's own children (data loader workers) inherit ``RANK`` too; the
        topmost one is the rank. A target without ``RANK`` anywhere is one
        process: its root is rank 0.
        """
        by_rank: dict[int, list[ProcessRef]] = {}
        for ref in self.processes():
            value = environ(ref.pid).get("RANK")
            if value is not None and value.isdigit():
                by_rank.setdefault(int(value), []).append(ref)
        result: dict[int, ProcessRef] = {}
        for rank, refs in by_rank.items():
            pids = {r.pid for r in refs}
            top = [r for r in refs if _parent(r.pid) not in pids]
            result[rank] = top[0] if top else refs[0]
        if not result and self.proc is not None and self.proc.poll() is None:
            root = ProcessRef.of(self.proc.pid)
            if root is not None:
                result[0] = root
        return result

    def stop(self, grace: float = 3.0) -> Teardown:
        """End every process of the run, within bounded time whatever they do.

        SIGTERM to the launcher's process group first (a job that shuts down cleanly
        may), then SIGKILL to the whole run: its cgroup, and every process with its run
        id. Stopped processes are thawed first so none is left behind in state T. No
        wait here is unbounded: what still lives after KILL_S, and a log pipe still held
        open after DRAIN_S, is reported in the result instead of waited for.
        """
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        survivors = self._end_all(KILL_S)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
        drain_until = time.monotonic() + DRAIN_S
        for pump in self._pumps:
            pump.finish(drain_until)
        for pump in self._pumps:
            # The pump polls every 0.1 s and checks its deadline between polls.
            pump.thread.join(timeout=max(0.0, drain_until - time.monotonic()) + 1.0)
        for pump in self._pumps:
            if not pump.thread.is_alive():
                # Our end of the pipe; under pytest's warnings-as-errors an unclosed pipe
                # is a ResourceWarning that fails the user's scenario item.
                with contextlib.suppress(OSError):
                    pump.stream.close()
        removed = None
        if self.cgroup is not None:
            removed = not survivors and _cgroup.remove_tree(self.cgroup)
        return Teardown(
            tracking="env" if self.cgroup is None else "cgroup",
            survivors=survivors,
            logs_open=tuple(p.name for p in self._pumps if not p.eof),
            cgroup_removed=removed,
        )

    def _end_all(self, timeout: float) -> tuple[int, ...]:
        """SIGKILL the run's cgroup and every process with its run id until none is
        left or ``timeout`` passes; the pids still alive then."""
        deadline = time.monotonic() + timeout
        while True:
            group_empty = (self.cgroup is None
                           or _cgroup.kill_tree(self.cgroup, max(0.0, deadline - time.monotonic())))
            refs = processes_with_env(probe.RUN_ID_ENV, self.run_id)
            for ref in refs:
                ref.signal(signal.SIGCONT)
            kill_all(refs)
            if group_empty and not refs:
                return ()
            if time.monotonic() >= deadline:
                left = {ref.pid for ref in refs if ref.alive()}
                if self.cgroup is not None:
                    left.update(_cgroup.subtree_members(self.cgroup))
                return tuple(sorted(left))
            time.sleep(0.05)


def _entering(group: Path) -> Callable[[], None]:
    """What the child runs between fork and exec: move itself into ``group``. Only
    system calls, nothing that could wait on a lock another harness thread held at fork."""
    procs = str(group / "cgroup.procs")

    def enter() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0\n")  # 0: the writing process itself
        finally:
            os.close(fd)

    return enter


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    return int(raw[raw.rfind(")") + 2 :].split()[1])
