"""Targets: the system under test as the run loop drives it; and the local one.

:class:`Target` is what the run loop (harness/run/runner.py) and the injector
(harness/run/injector.py) need from a system under test, wherever it runs: start it, watch it,
find the processes a fault names, end it; and what faults can act through there
(``capabilities``: signals, memory, network, files), so a scenario whose faults need more
is refused when it is validated. A system kind (harness/systems/) builds its target; the
run loop never names a class. :class:`LocalTarget`, below, runs the system as local
processes.

Local target: launch the system under test as real processes, find its ranks, end it.

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
import fcntl
import glob
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Protocol

from aftershock.faults import ProcessRef, contract, kill_all, process_environ, processes_with_env
from aftershock.faults import cgroup as _cgroup
from aftershock.faults import parent_pid as _parent
from aftershock.harness import probe
from aftershock.harness.errors import TargetError
from aftershock.harness.run import _files, warm
from aftershock.harness.run._room import Room
from aftershock.harness.run.logprobe import (
    LOG_UNREAD,
    TAILED_TIMES,
    TIMES_SUFFIX,
    CompiledProbes,
    LogProbe,
    ProbeReader,
    StreamStamps,
    compile_probes,
    file_fields,
    stream_kinds,
)
from aftershock.harness.run.records import Event
from aftershock.harness.run.timeline import Timeline

LINE_LIMIT = 64 * 1024  # bytes of one log line the probes see; a longer line is only logged
LOG_LIMIT = 1 << 30  # bytes kept per launcher log file (1 GiB); the rest is read and dropped
KILL_S = 5.0  # how long teardown keeps killing the run's processes before it reports survivors
DRAIN_S = 1.0  # after the kill, how long the log pumps may still read what the job wrote
SCAN_S = 0.25  # how often the process tree is looked at for new workers (restarts)
TAIL_S = 0.01  # how often per-process log files are looked at for new lines


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    world: int | None
    probes: tuple[LogProbe, ...]
    #: Glob patterns (absolute) of per-process log files the target tails as they appear
    #: and grow: each file its own stream, so two ranks' lines never run together.
    tails: tuple[str, ...] = ()
    #: The run's values of the variables its system expands (``${port}``: the free port a
    #: `command:` got), for what else the scenario expands them in (a load's ``url``).
    variables: dict[str, str] = field(default_factory=dict)
    #: Modules a warm server imports once for every run of this launcher, which is then
    #: forked from it instead of started fresh (harness/run/warm.py); () for a fresh start.
    warm: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Teardown:
    """What ending a run's processes achieved, for its timeline and its heal journal."""

    tracking: str  # "cgroup": the run's own cgroup; "env": the AFTERSHOCK_RUN_ID scan alone
    survivors: tuple[int, ...]  # pids of the run still alive when the harness gave up
    logs_open: tuple[str, ...]  # launcher streams still held open by a process not ended
    cgroup_removed: bool | None  # None: the run had no cgroup
    #: The processes still running when SIGTERM's grace ran out, and why SIGTERM had not
    #: ended them (``why_alive``); empty when the run ended within it.
    overran: tuple[dict[str, Any], ...] = ()

    @property
    def complete(self) -> bool:
        return not self.survivors and self.cgroup_removed is not False


# How long the run's processes get to exit after SIGTERM at the end, before SIGKILL: a job
# stopped early (its timeout, Ctrl-C) gets STOP_GRACE_S; a server whose load was served gets
# SERVED_STOP_GRACE_S, since SIGTERM is how such a run always ends and `completes` judges how
# it shut down (a last journal fsync behind a busy disk can take seconds; Kubernetes gives
# 30 s by default).
STOP_GRACE_S = 3.0
SERVED_STOP_GRACE_S = 10.0


class Target(Protocol):
    """A system under test as the run loop drives it. Every method returns in bounded time.

    Processes are named by :class:`faults.ProcessRef` (pid and start time, on this host's
    kernel): what the fault kinds act on.
    """

    #: What faults can act through on this target (faults.registry.CAPABILITIES): a fault
    #: kind that needs more is refused at validate time, with what is missing.
    capabilities: ClassVar[frozenset[str]]
    @property
    def coordinates(self) -> Mapping[int, tuple[int, int]]:
        """rank -> (replica, shard), as the ranks reported them."""
        ...

    def tracking(self) -> dict[str, Any]:
        """How the run's processes are found again after a crash: the heal journal's
        ``launch`` record (faults/heal.py ends what it names)."""
        ...

    def folders(self) -> list[Path]:
        """Folders outside the run folder that the run may write to (a heal refuses undo
        paths outside them and the run folder)."""
        ...

    def start(self) -> None:
        """Launch the system (raises TargetError if it cannot be)."""
        ...

    def launched(self) -> dict[str, Any]:
        """Fields of the timeline's ``launch`` event: how the run's processes are tracked."""
        ...

    def observe(self, event: Event) -> None:
        """An event of the run's timeline (a ``hello``: a process says which rank it is)."""
        ...

    def poll(self) -> int | None:
        """The launched command's exit code, or None while it runs."""
        ...

    def processes(self) -> list[ProcessRef]:
        """Every live process of the run."""
        ...

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> its process, for the ranks alive now."""
        ...

    def role_processes(self, role: str) -> list[ProcessRef]:
        """The live processes that play ``role`` (launcher, spare, router)."""
        ...

    def node_processes(self, node: int) -> list[ProcessRef]:
        """Node ``node`` of a multi-node target, as the process that stands for it (its
        init: node faults act on the container that holds it); [] while it is not running
        or where the target has no nodes."""
        ...

    def stop(self, grace: float = STOP_GRACE_S) -> Teardown:
        """End every process of the run, giving them ``grace`` seconds after SIGTERM where
        the target has such a step; what could not be ended is reported, not waited for."""
        ...




def read_file_line(reader: ProbeReader, compiled: CompiledProbes, path: str, raw: bytes, *,
                   read_t: float, stamps: dict[str, StreamStamps], clock_offset: float,
                   started: float) -> None:
    """Match one line the tailer read from the log file ``path`` (cut at LINE_LIMIT): the
    file names its stream and the fields its path implies; ``stamps`` keeps each file's
    newest own time."""
    reader.read(path, raw.decode(errors="replace"), compiled, read_t=read_t,
                clock_offset=clock_offset, started=started, defaults=file_fields(path),
                stamps=stamps.setdefault(path, StreamStamps()), cut=len(raw) >= LINE_LIMIT)


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
                 on_line: Callable[[bytes, float], None], room: Room | None = None) -> None:
        self.name = name
        self.stream = stream
        self.path = path
        self.eof = False
        self._on_line = on_line
        # A full disk is noted there (the run loop then stops the run), not raised here.
        self._room = room if room is not None else Room(path.parent)
        self._log_fd: int | None = None  # None: not written (not opened, or it failed)
        self._times_fd: int | None = None  # <log>.times: each line's offset and read time
        self._line = bytearray()
        self._line_start = 0  # offset in the stream where the current line began
        self._fed = 0  # bytes of the stream fed to the probes so far
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
        self._log_fd = self._open(str(self.path))
        self._times_fd = self._open(str(self.path) + TIMES_SUFFIX)
        try:
            while self._stop_at is None or time.monotonic() < self._stop_at:
                if not poller.poll(100):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.eof = True
                    break
                self._log(chunk)
                self._feed(chunk)
        finally:
            if self._line:  # the last line had no newline
                self._emit_line()
            if self._dropped:
                self._put(f"\n[aftershock: {self._dropped} more bytes were read and "
                          "dropped]\n".encode())
            for written in (self._log_fd, self._times_fd):
                if written is not None:
                    os.close(written)

    def _open(self, path: str) -> int | None:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            self._room.note(path, exc)
            return None

    def _put(self, data: bytes, *, times: bool = False) -> None:
        """Append to the log (or its ``.times``). A write that fails ends that file, never
        the pump: the pipe is still read, so the job never blocks on it; a full disk is
        noted for the run loop."""
        fd = self._times_fd if times else self._log_fd
        if fd is None:
            return
        path = str(self.path) + (TIMES_SUFFIX if times else "")
        try:
            if self._room.write(fd, data, path):
                return
        except OSError as exc:
            self._room.note(path, exc)
        os.close(fd)
        if times:
            self._times_fd = None
        else:
            self._log_fd = None

    def _log(self, chunk: bytes) -> None:
        left = max(0, LOG_LIMIT - self._written)
        if left:
            self._put(chunk[:left])
            self._written += min(left, len(chunk))
        if len(chunk) > left:
            if not self._dropped:
                self._put(f"\n[aftershock: log truncated at {LOG_LIMIT} bytes; the rest of "
                          "this stream is read and dropped]\n".encode())
            self._dropped += len(chunk) - left

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
        re-check (harness/verdict/recheck.py) can time a match the live probes never made."""
        raw = bytes(self._line)
        self._line.clear()
        read_t = time.monotonic()
        if self._line_start < LOG_LIMIT:
            self._put(f"{self._line_start} {read_t:.6f}\n".encode(), times=True)
        self._line_start = self._fed
        with contextlib.suppress(Exception):  # a probe that fails must not stop the log
            self._on_line(raw, read_t)


def files_before(patterns: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """The regular files ``patterns`` match now, before a launch: each one's device, inode
    and size (:class:`_Tailer` reads none of what they hold now)."""
    found: dict[str, tuple[int, int, int]] = {}
    for pattern in patterns:
        for path in glob.glob(pattern, recursive=True):
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode):
                    found[path] = (info.st_dev, info.st_ino, info.st_size)
    return found


class _Tailer:
    """Follows per-process log files (torchrun's ``--log-dir``/``--redirects`` files) as
    they appear and grow, and feeds each whole line to the log probes, stamped when it is
    read: within TAIL_S of its writing, without the 0.1 s batching of torchrun's ``--tee``.
    Each file is its own stream, so no two processes' lines can run together.
    ``times``: where each line's ``<offset> <read time> <path>`` is kept, so a re-check
    (harness/verdict/recheck.py) can time a match the live probes never made, as ``<log>.times``
    does for the launcher's pipes."""

    def __init__(self, patterns: tuple[str, ...],
                 on_line: Callable[[str, bytes, float], None],
                 times: Path | None = None,
                 on_appear: Callable[[str, float | None], None] | None = None,
                 room: Room | None = None,
                 before: Mapping[str, tuple[int, int, int]] | None = None) -> None:
        self.patterns = patterns
        self._on_line = on_line
        # The files the patterns matched before the launch (:func:`files_before`): what they
        # held then is an earlier run's (a reused run folder, a log that persists), so each
        # is read from where it ended then, unless it was replaced or cut short since.
        self._before = dict(before or {})
        # Each new file, with when it was last seen absent: the start of the previous pass,
        # whose look would have found it had it existed (None at the first pass). Every line
        # in it was written later, by a writer that had not yet opened it.
        self._on_appear = on_appear
        self._last_pass: float | None = None
        # path -> (offset read, the partial last line, the offset where that line began)
        self._files: dict[str, tuple[int, bytearray, int]] = {}
        self._times_path = times
        self._times: IO[str] | None = None
        self._room = room  # where a full disk is noted (the run loop then stops the run)
        self._stop_at: float | None = None
        self.thread = threading.Thread(target=self._run, name="log-tail", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self, deadline: float) -> None:
        self._stop_at = deadline

    def _run(self) -> None:
        try:
            if self._times_path is not None:
                with contextlib.suppress(OSError):
                    self._times = open(self._times_path, "w")  # noqa: SIM115 (closed below)
            while True:
                last = self._stop_at is not None
                self._pass()
                if last:  # one whole pass after the job ended: what it wrote last
                    for path, (_, partial, start) in self._files.items():
                        if partial:
                            self._emit(path, bytes(partial), start)
                    return
                time.sleep(TAIL_S)
        finally:
            self._close_times()

    def _close_times(self) -> None:
        if self._times is not None:
            with contextlib.suppress(OSError):  # what a full disk left buffered is lost
                self._times.close()
            self._times = None

    def _pass(self) -> None:
        began = time.monotonic()
        for pattern in self.patterns:
            for path in sorted(glob.glob(pattern, recursive=True)):
                if path not in self._files and self._on_appear is not None and (
                        path not in self._before):
                    with contextlib.suppress(Exception):
                        self._on_appear(path, self._last_pass)
                offset, partial, start = self._files.setdefault(path, (0, bytearray(), 0))
                try:
                    # The job's own files: a FIFO among them is not waited on (it would
                    # stall every probe), nor a link followed out of the run folder.
                    with _files.open_regular(Path(path)) as handle:
                        if handle is None:
                            continue
                        now = os.fstat(handle.fileno())
                        then = self._before.pop(path, None)
                        if then is not None and then[:2] == (now.st_dev, now.st_ino):
                            offset = start = then[2]  # the earlier run's lines: not read
                        if now.st_size < offset:  # rewritten from its start (or cut short)
                            offset = start = 0
                            partial.clear()
                        handle.seek(offset)
                        chunk = handle.read(1 << 20)
                except OSError:
                    continue
                self._files[path] = (offset, partial, start)
                if not chunk:
                    continue
                # Where each whole line began: the partial one's start, then past each newline
                # (the partial line kept is cut at LINE_LIMIT, its offset is not).
                cut = chunk.split(b"\n")
                lines = (bytes(partial) + chunk).split(b"\n")
                partial[:] = lines.pop()[:LINE_LIMIT]
                starts = [start]
                position = offset
                for piece in cut[:-1]:
                    position += len(piece) + 1
                    starts.append(position)
                self._files[path] = (offset + len(chunk), partial, starts[-1])
                for line, line_start in zip(lines, starts, strict=False):
                    self._emit(path, line[:LINE_LIMIT], line_start)
        self._last_pass = began

    def _emit(self, path: str, raw: bytes, start: int) -> None:
        read_t = time.monotonic()
        if self._times is not None:
            try:
                self._times.write(f"{start} {read_t:.6f} {path}\n")
                self._times.flush()
            except OSError as exc:  # no more capture times; the tail goes on
                if self._room is not None:
                    self._room.note(str(self._times_path), exc)
                self._close_times()
        with contextlib.suppress(Exception):  # a probe that fails must not stop the tail
            self._on_line(path, raw, read_t)


class LocalTarget:
    """The system under test as a local process tree (a :class:`Target`).

    Its processes are tracked by the run's own cgroup v2 group where this machine lets
    the harness make one (faults/_cgroup.py), and by ``AFTERSHOCK_RUN_ID`` in their
    environment always: the group catches a process that dropped its environment, the
    scan one that left the group.
    """

    #: Everything: its processes are this host's, in this network namespace, and its files
    #: are where the harness sees them.
    capabilities: ClassVar[frozenset[str]] = frozenset({"signals", "memory", "network", "files"})

    def __init__(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline) -> None:
        self.launch = launch
        self.run_dir = run_dir
        self.run_id = run_id
        self.timeline = timeline
        self.proc: subprocess.Popen[bytes] | warm.WarmProcess | None = None
        self._pumps: list[_LogPump] = []
        self._tailer: _Tailer | None = None
        self._workers_seen: set[int] = set()
        self._workers_live: dict[int, ProcessRef] = {}  # seen and not yet found gone
        #: Worker pid -> when a scan first found it gone: an upper bound on its end
        #: (harness/run/attempts.py explains the ends after the run).
        self.workers_gone: dict[int, float] = {}
        self._next_scan = 0.0
        self._logs = run_dir / "logs"
        self._reported: dict[int, tuple[int | None, str | None]] = {}
        self._ranks_in_env = False  # some process of the run has said RANK (rank_processes)
        self.coordinates: dict[int, tuple[int, int]] = {}  # rank -> (replica, shard)
        # Log lines' own times (LogProbe.clock): nothing the run prints can be older than
        # this, and Unix times convert with this one offset, fixed for the whole run.
        self._started = time.monotonic()
        self._clock_offset = time.time() - self._started
        # Numbers each stream's lines for the probes, and knows which line is being matched:
        # what a reader still behind when the run ends is said with (_note_unread).
        self._reader = ProbeReader(timeline.write)
        self.cgroup, self.tracking_note = _cgroup.run_group_dir(run_id)

    def tracking(self) -> dict[str, Any]:
        """How the run's processes are found, as the heal journal records it: the run id
        in their environment, and the run's cgroup (None where none could be made)."""
        return {"env": probe.RUN_ID_ENV, "value": self.run_id,
                "cgroup": None if self.cgroup is None else str(self.cgroup)}

    def folders(self) -> list[Path]:
        return [Path(self.env()[contract.NVML_DIR_ENV])]

    def launched(self) -> dict[str, Any]:
        if self.cgroup is not None:
            return {"tracking": "cgroup", "cgroup": str(self.cgroup)}
        return {"tracking": "env", "tracking_note": self.tracking_note}

    def observe(self, event: Event) -> None:
        fields = event.fields
        if event.event != contract.HELLO or not isinstance(fields.get("pid"), int):
            return
        role, replica, shard = fields.get("role"), fields.get("replica"), fields.get("shard")
        self.note_hello(
            fields["pid"], event.rank, role if isinstance(role, str) else None,
            replica if isinstance(replica, int) else None,
            shard if isinstance(shard, int) else None,
        )

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.launch.env)
        env[probe.EVENTS_ENV] = str(self.timeline.path)
        env[probe.OUTPUT_ENV] = str(self.run_dir / "output")
        env[probe.RUN_ID_ENV] = self.run_id
        env[probe.COMMANDS_ENV] = str(self.run_dir / "commands.jsonl")
        # The simulated NVML (faults/nvml_sim.py) a rank opts into when it has no real GPU.
        env.setdefault(contract.NVML_DIR_ENV, str(self.run_dir / "nvml"))
        env["PYTHONUNBUFFERED"] = "1"
        # What the job writes to the system's temporary folder (torchelastic's
        # /tmp/torchelastic_*, profiler traces) stays in the run folder, not behind it.
        env.setdefault("TMPDIR", str(self.run_dir / "tmp"))
        # As an activated environment would: this interpreter's own bin folder first, so
        # `torchrun` is the torchrun installed beside the harness.
        own = interpreter_bin()
        path = env.get("PATH", os.defpath)
        if path.split(os.pathsep)[0] != own:
            env["PATH"] = os.pathsep.join([own, path])
        return env

    def _program(self, env: Mapping[str, str]) -> str:
        """The program to run, found as a shell of an activated environment finds it."""
        program = self.launch.argv[0]
        if os.sep in program:
            return program
        found = shutil.which(program, path=env["PATH"])
        if found is None:
            raise TargetError(f"cannot launch {program!r}: not found in {interpreter_bin()} "
                              "(this interpreter's bin folder, searched first as an activated "
                              f"environment would) nor on PATH ({env['PATH']})")
        return found

    def start(self) -> None:
        self._logs.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "output").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "nvml").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "tmp").mkdir(parents=True, exist_ok=True)
        cwd = self.launch.cwd
        if not cwd.is_dir():
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: its working directory "
                              f"{str(cwd)!r} does not exist")
        env = self.env()
        program = self._program(env)
        before = files_before(self.launch.tails)
        if self.cgroup is not None:
            try:
                self.cgroup.mkdir()
            except OSError as exc:
                self.tracking_note = f"cannot create {self.cgroup}: {exc.strerror}"
                self.cgroup = None
        proc = self._warm(program, cwd, env) or self._popen(program, cwd, env)
        self.proc = proc
        assert proc.stdout is not None
        assert proc.stderr is not None
        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            pump = _LogPump(name, stream, self._logs / f"launcher.{name}.log",
                            self._line_handler(name), self.timeline.room)
            pump.start()
            self._pumps.append(pump)
        if self.launch.tails:
            self._tailer = _Tailer(self.launch.tails, self._file_line_handler(),
                                   self._logs / TAILED_TIMES, self._file_appeared,
                                   self.timeline.room, before)
            self._tailer.start()

    def _warm(self, program: str, cwd: Path, env: dict[str, str]) -> warm.WarmProcess | None:
        """The launcher forked from a warm server where its launch names one and this run
        may have one (harness/run/warm.py); else None."""
        if not self.launch.warm:
            return None
        try:
            return warm.start(self.launch.warm, [program, *self.launch.argv[1:]], env=env,
                              cwd=cwd, cgroup=self.cgroup)
        except warm.WarmError as exc:
            self._drop_group()
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: {exc}") from exc

    def _popen(self, program: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The launcher as a fresh process."""
        try:
            return subprocess.Popen(
                self.launch.argv,
                executable=program,
                cwd=cwd,
                env=env,
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

    def _file_appeared(self, path: str, absent_at: float | None) -> None:
        """A per-process log file the tailer found: ``log_appeared``, with when it was last
        seen absent (what proves its lines were written after a fault: docs/metrics.md)."""
        self.timeline.write(Event(t=time.monotonic(), event="log_appeared", source="harness",
                                  fields={"path": path, "absent_at": absent_at}))

    def _file_line_handler(self) -> Callable[[str, bytes, float], None]:
        compiled: CompiledProbes = compile_probes(self.launch.probes, "logs")
        stamps: dict[str, StreamStamps] = {}  # each file's newest own time (written_after)

        def on_line(path: str, raw: bytes, read_t: float) -> None:
            if not compiled:
                return
            read_file_line(self._reader, compiled, path, raw, read_t=read_t, stamps=stamps,
                           clock_offset=self._clock_offset, started=self._started)

        return on_line

    def _drop_group(self) -> None:
        if self.cgroup is not None:
            _cgroup.remove_tree(self.cgroup)

    def _line_handler(self, name: str) -> Callable[[bytes, float], None]:
        compiled: CompiledProbes = compile_probes(self.launch.probes, name)

        shown = f"logs/launcher.{name}.log"  # as the run folder holds it: file:line

        def on_line(raw: bytes, read_t: float) -> None:
            self._reader.read(shown, raw.decode(errors="replace"), compiled, read_t=read_t,
                              clock_offset=self._clock_offset, started=self._started,
                              cut=len(raw) >= LINE_LIMIT)

        return on_line

    def poll(self) -> int | None:
        if self.proc is None:
            return None
        code = self.proc.poll()
        now = time.monotonic()
        if code is None and now >= self._next_scan:
            self._next_scan = now + SCAN_S
            self._scan_workers()
        return code

    def _scan_workers(self) -> None:
        """Restarts seen from the launcher's side: each worker a launcher starts (a process
        with LOCAL_RANK, the topmost) is a ``process_started`` event with its pid, its
        RANK and torchrun's restart count (TORCHELASTIC_RESTART_COUNT) as its
        generation, so a job that reports no generation of its own still shows its
        restarts, and the live view its pids."""
        for pid, seen in list(self._workers_live.items()):
            if not seen.alive():
                self.workers_gone[pid] = time.monotonic()
                del self._workers_live[pid]
        for ref in self.role_processes("worker"):
            if ref.pid in self._workers_seen:
                continue
            self._workers_seen.add(ref.pid)
            self._workers_live[ref.pid] = ref
            environ = process_environ(ref.pid)
            # Its launcher (the torchrun agent that started it, the same over its restarts):
            # how many launchers the job has tells whether a restart count is a world
            # (harness/verdict/metrics.py).
            fields: dict[str, Any] = {"pid": ref.pid, "role": "worker",
                                      "agent": _parent(ref.pid)}
            for key, name in (("rank", "RANK"), ("generation", "TORCHELASTIC_RESTART_COUNT"),
                              ("local_rank", "LOCAL_RANK")):
                value = environ.get(name, "")
                if value.isdigit():
                    fields[key] = int(value)
            # Where torchrun's @record writes what killed it (harness/run/attempts.py reads it).
            if environ.get("TORCHELASTIC_ERROR_FILE"):
                fields["error_file"] = environ["TORCHELASTIC_ERROR_FILE"]
            # Which files it writes (torchrun's --redirects: its own attempt_N/<rank>/ files),
            # so a log file's lines can be tied to the process that wrote them.
            for fd, key in ((1, "stdout"), (2, "stderr")):
                with contextlib.suppress(OSError):
                    written = os.readlink(f"/proc/{ref.pid}/fd/{fd}")
                    if written.startswith("/") and os.path.isfile(written):
                        fields[key] = written
            self.timeline.write(Event(t=time.monotonic(), event="process_started",
                                      source="launcher", fields=fields))

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
        if rank is not None and replica is not None:
            self.coordinates[rank] = (replica, shard or 0)

    def role_processes(self, role: str) -> list[ProcessRef]:
        if role == "launcher":
            root = ProcessRef.of(self.proc.pid) if self.proc is not None else None
            return [root] if root is not None and root.alive() else []
        reported = [
            ref for ref in self.processes()
            if self._reported.get(ref.pid, (None, None))[1] == role
        ]
        if reported or role not in ("worker", "agent"):
            return reported
        return self._tree_role(role)

    def _tree_role(self, role: str) -> list[ProcessRef]:
        """The workers or agents by the process tree: a worker is a process its launcher
        started as a rank (torchrun gives each LOCAL_RANK; its own children inherit it: the
        topmost is the worker), an agent the process that started one."""
        live = self.processes()
        ranked = {ref.pid: ref for ref in live if "LOCAL_RANK" in process_environ(ref.pid)}
        workers = [ref for pid, ref in ranked.items() if _parent(pid) not in ranked]
        if role == "worker":
            return workers
        parents = {_parent(ref.pid) for ref in workers}
        return [ref for ref in live if ref.pid in parents]

    def ambiguous_ranks(self) -> dict[int, list[int]]:
        """Ranks that more than one unrelated process claims through ``RANK`` (each replica
        group of a torchft job has its own RANK=0), with their pids; none once the job
        reports its ranks itself (``hello``)."""
        if names_ranks(self._reported):
            return {}
        return {rank: pids for rank, pids in self._rank_claims().items() if len(pids) > 1}

    def _env_ranks(self) -> dict[int, list[ProcessRef]]:
        """RANK -> every live process whose environment says so."""
        by_rank: dict[int, list[ProcessRef]] = {}
        for ref in self.processes():
            value = process_environ(ref.pid).get("RANK")
            if value is not None and value.isdigit():
                by_rank.setdefault(int(value), []).append(ref)
        return by_rank

    def _rank_claims(self) -> dict[int, list[int]]:
        """RANK -> the topmost live processes whose environment says so."""
        by_rank = self._env_ranks()
        claims: dict[int, list[int]] = {}
        for rank, refs in by_rank.items():
            pids = {r.pid for r in refs}
            claims[rank] = sorted(r.pid for r in refs if _parent(r.pid) not in pids)
        return claims

    def node_processes(self, node: int) -> list[ProcessRef]:
        return []  # one host: no nodes (validate refuses `target: {node: N}` here)

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> process. Once any process of the run has said who it is through the
        probe's ``hello``, only those reports count: a supervisor or a re-forked spare
        inherits ``RANK`` from torchrun but is not that rank. A hello that names no rank
        (a one-process job without ``RANK``) says nothing about ranks."""
        if not names_ranks(self._reported):
            return self._env_rank_processes()
        return reported_ranks(self._reported, self.processes())

    def _env_rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> the topmost live process whose environment says ``RANK=rank``.

        A rank's own children (data loader workers) inherit ``RANK`` too; the
        topmost one is the rank. A job of one rank (its ``world`` not said to be more)
        that has never shown ``RANK`` in any process is one process: its root is rank 0.
        Once a process said ``RANK``, the ranks are those processes: while they are all
        down (a restart), there is no rank to hit, and the launcher is never taken for one.
        """
        by_rank = self._env_ranks()
        if by_rank:
            self._ranks_in_env = True
        result: dict[int, ProcessRef] = {}
        for rank, refs in by_rank.items():
            pids = {r.pid for r in refs}
            top = [r for r in refs if _parent(r.pid) not in pids]
            result[rank] = top[0] if top else refs[0]
        one_rank = self.launch.world is None or self.launch.world == 1
        if (not result and not self._ranks_in_env and one_rank and self.proc is not None
                and self.proc.poll() is None):
            root = ProcessRef.of(self.proc.pid)
            if root is not None:
                result[0] = root
        return result

    def stop(self, grace: float = STOP_GRACE_S) -> Teardown:
        """End every process of the run, within bounded time whatever they do.

        SIGTERM to the launcher's process group first (a job that shuts down cleanly
        may), then SIGKILL to the whole run: its cgroup, and every process with its run
        id. Stopped processes are thawed first so none is left behind in state T. No
        wait here is unbounded: what still lives after KILL_S, and a log pipe still held
        open after DRAIN_S, is reported in the result instead of waited for.
        """
        overran = self._terminate(grace)
        survivors = self._end_all(KILL_S)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
        self._drain()
        self._note_unread()  # before the pipes close: what is still in them is unread
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
            overran=overran,
            logs_open=tuple(p.name for p in self._pumps if not p.eof),
            cgroup_removed=removed,
        )

    def _terminate(self, grace: float) -> tuple[dict[str, Any], ...]:
        """SIGTERM to the launcher's process group, then up to ``grace`` for it to exit;
        the processes that outlived it, each with what it did with the signal."""
        if self.proc is None or self.proc.poll() is not None:
            return ()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            # Said before SIGKILL removes the evidence: which processes outlived SIGTERM,
            # and what each did with it.
            found = (why_alive(ref.pid) for ref in self.processes()[:OVERRAN_LIMIT])
            return tuple(entry for entry in found if entry is not None)
        return ()

    def _drain(self) -> None:
        """Up to DRAIN_S for the log pumps and the tailer to read what is left."""
        drain_until = time.monotonic() + DRAIN_S
        for pump in self._pumps:
            pump.finish(drain_until)
        for pump in self._pumps:
            # The pump polls every 0.1 s and checks its deadline between polls.
            pump.thread.join(timeout=max(0.0, drain_until - time.monotonic()) + 1.0)
        if self._tailer is not None:
            self._tailer.finish(drain_until)
            self._tailer.thread.join(timeout=DRAIN_S + 1.0)

    def _note_unread(self) -> None:
        """A ``log_unread`` event for each stream the readers were still behind on when the
        drain ended (a probe still matching one of its lines, lines read from the pipe and
        never given to the probes, or lines left in the pipe by a reader that reached the
        drain's end still busy): its checks are then not observed (logprobe.unread),
        rather than judged on a timeline the harness did not read in time. From here on a
        reader that is still matching writes nothing."""
        matching = self._reader.close()
        for pump in self._pumps:
            shown = f"logs/launcher.{pump.name}.log"
            unfed = pump._written + pump._dropped - pump._fed
            left = _pending(pump.stream)
            if shown in matching or unfed > 0 or left > 0:
                why = "; ".join(part for part in (
                    f"its probes were still on line {matching[shown]}" if shown in matching
                    else "",
                    f"{unfed} bytes read were never matched" if unfed > 0 else "",
                    f"{left} bytes were never read from the pipe" if left > 0 else "") if part)
                self.timeline.emit(LOG_UNREAD, "log-reader", stream=shown, why=why,
                                   unread_bytes=unfed + left,
                                   kinds=stream_kinds(self.launch.probes, pump.name))
        files = [where for stream, where in matching.items() if not stream.startswith("logs/")]
        if files:
            self.timeline.emit(LOG_UNREAD, "log-reader", stream="the files of `logs:`",
                               why=f"its probes were still on line {files[0]}",
                               kinds=stream_kinds(self.launch.probes, "logs"))

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


def _pending(stream: IO[bytes]) -> int:
    """Bytes written into a pipe and not read from it yet (FIONREAD); 0 where that cannot
    be told (the pipe closed)."""
    try:
        answer = fcntl.ioctl(stream.fileno(), termios.FIONREAD, bytes(4))
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", answer)[0])


OVERRAN_LIMIT = 16  # processes, and threads per process, described when SIGTERM's grace ran out
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def why_alive(pid: int) -> dict[str, Any] | None:
    """Why process ``pid`` is still running after SIGTERM, from /proc: its state, what it
    does with SIGTERM (``ignored``, ``caught by a handler``, ``blocked in every thread``,
    ``default``), whether one is pending, and each thread's state and kernel wait channel
    (where a thread that never ran its handler is stuck). None if it is gone."""
    base = Path(f"/proc/{pid}")
    try:
        status = _status(base / "status")
        cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        tids = sorted(int(t) for t in os.listdir(base / "task"))
    except (OSError, ValueError):
        return None
    threads: list[dict[str, Any]] = []
    blocked_everywhere = True
    pending = bool(_mask(status, "ShdPnd") & _SIGTERM_BIT)
    for tid in tids[:OVERRAN_LIMIT]:
        task = base / "task" / str(tid)
        try:
            tstatus = _status(task / "status")
            wchan = (task / "wchan").read_text().strip()
        except (OSError, ValueError):
            continue
        blocked = bool(_mask(tstatus, "SigBlk") & _SIGTERM_BIT)
        blocked_everywhere = blocked_everywhere and blocked
        pending = pending or bool(_mask(tstatus, "SigPnd") & _SIGTERM_BIT)
        threads.append({"tid": tid, "name": tstatus.get("Name", ""),
                        "state": tstatus.get("State", ""), "wchan": wchan or "-",
                        "sigterm_blocked": blocked})
    if _mask(status, "SigIgn") & _SIGTERM_BIT:
        sigterm = "ignored"
    elif threads and blocked_everywhere:
        sigterm = "blocked in every thread"
    elif _mask(status, "SigCgt") & _SIGTERM_BIT:
        sigterm = "caught by a handler"
    else:
        sigterm = "default"
    return {"pid": pid, "name": status.get("Name", ""), "cmd": cmd.strip()[:200],
            "state": status.get("State", ""), "sigterm": sigterm, "sigterm_pending": pending,
            "threads": threads, "threads_total": len(tids)}


def _status(path: Path) -> dict[str, str]:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _mask(status: dict[str, str], key: str) -> int:
    return int(status.get(key, "0") or "0", 16)


def interpreter_bin() -> str:
    """The bin folder of the interpreter running the harness (a virtual environment's
    ``.venv/bin``; not resolved: a venv's python is a link to the base interpreter)."""
    return os.path.dirname(os.path.abspath(sys.executable))


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


def names_ranks(reported: dict[int, tuple[int | None, str | None]]) -> bool:
    """Whether any hello named a rank: one that names none (a one-process job without
    ``RANK``) says nothing about ranks, and the environment still tells them."""
    return any(rank is not None for rank, _ in reported.values())


def reported_ranks(reported: dict[int, tuple[int | None, str | None]],
                   processes: list[ProcessRef]) -> dict[int, ProcessRef]:
    """Rank -> live process, from what each process said it is (its probe ``hello``): only a
    trainer or worker names a rank (a supervisor or spare inherits ``RANK`` but is not it)."""
    live = {ref.pid: ref for ref in processes}
    ranks: dict[int, ProcessRef] = {}
    for pid, (rank, role) in reported.items():
        if pid in live and rank is not None and role in (None, "trainer", "worker"):
            ranks[rank] = live[pid]
    return ranks
