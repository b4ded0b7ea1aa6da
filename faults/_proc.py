"""Process identity and discovery through /proc, without pid-reuse mistakes.

A pid alone can be reused by an unrelated process after the original dies, so
every process the engine touches is named by (pid, start time), and a signal
is only sent while both still match.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


def _read_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after it.
    tail = raw[raw.rfind(")") + 2 :].split()
    return tail


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot."""
    tail = _read_stat(pid)
    return int(tail[19]) if tail and len(tail) > 19 else None


def state(pid: int) -> str | None:
    """One-letter scheduler state: R, S, D, T (stopped), t, Z (zombie), ..."""
    tail = _read_stat(pid)
    return tail[0] if tail else None


def parent(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat: the parent's pid (None once the process is gone)."""
    tail = _read_stat(pid)
    return int(tail[1]) if tail and len(tail) > 1 else None


def command_line(pid: int) -> str:
    """A process's arguments joined by spaces ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def all_pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """A process named by pid and start time, so a reused pid is never hit."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        started = start_time(pid)
        return cls(pid, started) if started is not None else None

    def alive(self) -> bool:
        return start_time(self.pid) == self.start and state(self.pid) not in (None, "Z", "X")

    def stopped(self) -> bool:
        return self.alive() and state(self.pid) in ("T", "t")

    def signal(self, sig: int | signal.Signals) -> bool:
        """Send ``sig`` if this is still the same process. True if it was sent."""
        if start_time(self.pid) != self.start:
            return False
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> ProcessRef:
        return cls(int(data["pid"]), int(data["start"]))


def processes_with_env(name: str, value: str) -> list[ProcessRef]:
    """Every live process whose initial environment has ``name=value``.

    The harness marks everything it launches with a run id in the environment;
    children inherit it, including ones that start their own session (torchrun
    workers do), so this finds a run's whole tree even after its parent died.
    """
    found: list[ProcessRef] = []
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        if environ(pid).get(name) == value:
            ref = ProcessRef.of(pid)
            if ref is not None and state(pid) not in ("Z", "X"):
                found.append(ref)
    return found


def _fd_flags(pid: int, fd: str) -> int | None:
    """The open flags of descriptor ``fd`` of ``pid`` (/proc/PID/fdinfo/FD, octal)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as handle:
            for line in handle:
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True, slots=True)
class Holders:
    """Who holds a file open for writing, among the processes asked about."""

    writers: tuple[int, ...]  # pids with it open for writing (O_WRONLY or O_RDWR)
    unreadable: tuple[int, ...]  # pids whose descriptors could not be read (permissions)


def writers(pids: Iterable[int], path: str | os.PathLike[str]) -> Holders:
    """Which of ``pids`` hold the file at ``path`` open for writing.

    Matched by device and inode, not by name: a file renamed over or unlinked is another
    file. Only the descriptors of the given processes are read, so the cost is bounded by
    what the caller names. A process whose descriptors cannot be read is reported as such,
    not as holding nothing: that would be a guess."""
    try:
        wanted = os.stat(path)
    except OSError:
        return Holders((), ())
    found: list[int] = []
    unreadable: list[int] = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            unreadable.append(pid)
            continue
        except OSError:
            continue  # gone: it holds nothing
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != (wanted.st_dev, wanted.st_ino):
                continue
            flags = _fd_flags(pid, fd)
            if flags is not None and flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                found.append(pid)
                break
    return Holders(tuple(found), tuple(unreadable))


def kill_all(refs: list[ProcessRef]) -> None:
    """SIGKILL each process; SIGKILL also ends stopped processes, no SIGCONT needed."""
    for ref in refs:
        ref.signal(signal.SIGKILL)
    for ref in refs:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(ref.pid, os.WNOHANG)
