"""A full filesystem under the run folder: found at the first write that fails, and room
kept for the run's record.

Every writer of the harness (the timeline, the log pumps, the records) writes through
:meth:`Room.write`: a write that fails for want of space is noted once, here, instead of
ending the writer with a traceback, and the run loop, which calls :meth:`Room.check` on
every turn, stops the run at once (harness/run/runner.py). A job that fills the disk with files
of its own while the harness writes little is found by looking: :meth:`Room.check` also
reads the filesystem's free space (statvfs), every ``LOOK_S``, and less than ``FULL_BELOW``
left is full: the harness's next record may not fit. The :class:`Reserve`, a file of
``RESERVE_BYTES`` taken when the run starts and given back just before the record is
written, is what lets ``result.json`` be written whole on the disk the job filled.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path

from aftershock.harness.errors import HarnessError

#: What a write that found no room fails with: no space, or the user's quota reached.
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Where the reserve is kept in the run folder, and how much it holds: many times a run's
#: record (a few KiB; tens with every process's end).
RESERVE_NAME = ".aftershock-reserve"
RESERVE_BYTES = 256 * 1024
#: Less room than this left is a full disk: a few of the harness's writes (a log chunk is
#: up to 64 KiB), and on a real disk as good as none.
FULL_BELOW = 64 * 1024
LOOK_S = 0.25  # how often the run loop's check reads the free space


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found its filesystem full."""
    return isinstance(exc, OSError) and exc.errno in FULL


class RunDirFull(HarnessError):
    """The filesystem under a run folder is full (exit 3): the run was stopped when a
    writer of the harness first found no room, since what it then records is not whole."""

    def __init__(self, folder: Path, what: str) -> None:
        self.folder = folder
        self.what = what  # how it was found: the write that failed first, or the room left
        self.stopped_s: float | None = None  # when the job was stopped, from its launch
        super().__init__(self.describe())

    def __str__(self) -> str:
        return self.describe()  # with when the job was stopped, once it was

    def describe(self, record: str | None = None) -> str:
        """One line: the folder, what failed, when the job was stopped, where the record is."""
        stopped = ("no job of the run was running" if self.stopped_s is None
                   else f"stopped the job {self.stopped_s:.1f}s after its launch")
        line = (f"run folder's filesystem is full: {self.folder} ({self.what}); {stopped}, "
                "every fault undone")
        return line if record is None else f"{line}; {record}"


class Room:
    """The first full-disk failure any writer of one run met. Writers are threads (the log
    pumps, the load monitor) as well as the run loop: each notes it here and goes on
    without writing, so none dies with a traceback and no pipe is left unread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.full: RunDirFull | None = None
        self._lock = threading.Lock()
        self._next_look = 0.0

    def note(self, file: str | os.PathLike[str], exc: BaseException) -> bool:
        """Whether ``exc`` is a full disk; the first one is kept."""
        if not is_full(exc):
            return False
        assert isinstance(exc, OSError)
        self._found(f"writing {os.fspath(file)}: {exc.strerror or exc}")
        return True

    def _found(self, what: str) -> None:
        with self._lock:
            if self.full is None:
                self.full = RunDirFull(self.folder, what)

    def write(self, fd: int, data: bytes, file: str | os.PathLike[str]) -> bool:
        """Write all of ``data`` to ``fd`` (a short write goes on where it stopped); False,
        once noted, when the disk is full. Any other failure is raised."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except OSError as exc:
                if self.note(file, exc):
                    return False
                raise
        return True

    def check(self) -> None:
        """Raise the full disk a writer found, or a look at the free space finds."""
        now = time.monotonic()
        if self.full is None and now >= self._next_look:
            self._next_look = now + LOOK_S
            self._look()
        if self.full is not None:
            raise self.full

    def _look(self) -> None:
        try:
            fs = os.statvfs(self.folder)
        except OSError:
            return  # nothing to go by: a write that fails still finds it
        if not fs.f_blocks:
            return  # a filesystem that says nothing of its size (some FUSE ones)
        # Root may write into the blocks a filesystem keeps back from users (ext4's 5%).
        free = fs.f_frsize * (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail)
        if free < FULL_BELOW:
            self._found(f"{_size(free)} left of {_size(fs.f_frsize * fs.f_blocks)}, "
                        f"below the {_size(FULL_BELOW)} a run needs for its records")
        elif fs.f_files and not (fs.f_ffree if os.geteuid() == 0 else fs.f_favail):
            self._found(f"no inode left of {fs.f_files}: no file can be created")


def _size(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


class Reserve:
    """``RESERVE_BYTES`` of the run folder's filesystem, held from the run's start until
    its record is written, so a job that fills the disk leaves room for the record."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / RESERVE_NAME

    def take(self) -> None:
        """Hold the room (a reserve left by an earlier run is reused); raises RunDirFull
        when even that much is not free."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                # A filesystem without fallocate: real blocks, written.
                if not Room(self.path.parent).write(fd, bytes(RESERVE_BYTES), self.path):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
        except OSError as exc:
            os.close(fd)
            self.release()
            if is_full(exc):
                raise RunDirFull(self.path.parent,
                                 f"writing {self.path}: {exc.strerror or exc}") from None
            raise
        os.close(fd)

    def release(self) -> None:
        """Give the room back (for the record about to be written)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
