"""Hold a job's open of a file until the harness has injected its fault: fanotify(7)
permission events through libc.

An inotify event is a report: the job has already gone on when the harness reads it, so on
a starved machine a fault "triggered inside a save" can land after the save committed. A
permission event is a question: the job's open(2) of a watched file waits in the kernel
until the listener answers. A :class:`Gate` asks the trigger, for each open under its root
whose path (or a folder above it) matches the pattern, whether this is the trigger's moment;
if it is, the open stays blocked until the fault is in (:meth:`Gate.release`), so the fault
lands while the job is inside that file's open, whatever the load.

Every question is answered FAN_ALLOW (a gate never denies), on every path out: by the
harness's loop, by a thread that allows what does not match and anything held longer than
:data:`HOLD_MAX_S`, by :meth:`Gate.close`, and by the kernel when the descriptor closes
(a harness killed outright: the kernel allows what was pending). Opens by the harness's own
process are allowed at once, so it can never wait on itself.

Needs CAP_SYS_ADMIN (root): :func:`available` says why not otherwise, and the trigger then
falls back to inotify alone and says so on the fault's record (``file_held``). Marks are on
folders: the root and the folders under it that the trigger already watches, or the whole
mount when the root is a mount point (a filesystem the run mounted: every level is covered).
A folder made and filled before its mark is in place cannot hold the open inside it; the
open of the folder itself (a directory fsync) is held instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aftershock.faults._errors import FaultUnavailable

FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_CLASS_CONTENT = 0x4
FAN_MARK_ADD = 0x1
FAN_MARK_MOUNT = 0x10
FAN_OPEN_PERM = 0x10000
FAN_EVENT_ON_CHILD = 0x08000000
FAN_ONDIR = 0x40000000
FAN_ALLOW = 0x1
AT_FDCWD = -100
MASK = FAN_OPEN_PERM | FAN_EVENT_ON_CHILD | FAN_ONDIR
#: The longest a job's open stays blocked: the loop releases a held open as soon as its
#: fault is in (milliseconds); this only bounds a harness loop that stalled.
HOLD_MAX_S = 10.0

_METADATA = struct.Struct("IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_RESPONSE = struct.Struct("iI")  # fd, response


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                   ctypes.c_char_p]
    return libc


def _init() -> int:
    """A fanotify descriptor that asks permission, or FaultUnavailable saying why not."""
    try:
        libc = _libc()
    except (OSError, AttributeError) as exc:
        raise FaultUnavailable(f"fanotify is not available here ({exc})") from None
    fd = int(libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                                os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC | os.O_NONBLOCK))
    if fd < 0:
        code = ctypes.get_errno()
        raise FaultUnavailable(f"fanotify_init: {os.strerror(code)} (permission events need "
                               "CAP_SYS_ADMIN: run as root)")
    return fd


def available() -> str | None:
    """None if a gate can be made here; else why not."""
    try:
        os.close(_init())
    except FaultUnavailable as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class Held:
    """An open the gate is holding: ``match`` (the trigger's path), what was opened (``path``,
    relative to the root) and by whom."""

    match: str
    path: str
    pid: int
    since: float


#: ``decide(match, path, pid)``: True to hold this open (the trigger's moment), False to
#: allow it, None to ask again at the loop's next look (the trigger has not read its
#: inotify events yet).
Decide = Callable[[str, str, int], "bool | None"]


class Gate:
    """Permission events for opens under ``root`` whose relative path, or a folder above it,
    matches ``matches``. The trigger's loop answers what the thread could not (:meth:`take`,
    then :meth:`settle`), and calls :meth:`release` once the fault is in."""

    sees_renames = False  # a rename opens nothing: no question comes of it

    def __init__(self, root: Path, matches: Callable[[str], bool]) -> None:
        self.root = root
        self._matches = matches
        self._fd: int | None = _init()
        self._libc = _libc()
        self._lock = threading.Lock()
        self._asked: list[tuple[int, str, str, int, float]] = []  # fd, match, path, pid, t
        self._held: dict[int, Held] = {}  # event fd -> what it holds
        self._allowed: set[str] = set()  # matches known not to be the trigger's moment
        self._marked: set[str] = set()
        self.whole_mount = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="aftershock-fanotify",
                                        daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when an open waits for the trigger's answer (for select)."""
        return self._wake_r

    # ---------------------------------------------------------------- marks

    def mark(self, rel: str) -> bool:
        """Ask about opens in folder ``rel`` (relative to the root) and of what it holds;
        the root, if it is a mount point, covers its whole mount. False: not marked (gone)."""
        if self.whole_mount or rel in self._marked or self._fd is None:
            return self.whole_mount or rel in self._marked
        path = self.root if rel == "." else self.root / rel
        mount = rel == "." and os.path.ismount(path)
        flags = FAN_MARK_ADD | (FAN_MARK_MOUNT if mount else 0)
        if int(self._libc.fanotify_mark(self._fd, flags, MASK, AT_FDCWD,
                                        os.fsencode(path))) < 0:
            return False
        self._marked.add(rel)
        self.whole_mount = mount
        return True

    # ---------------------------------------------------------------- answers

    def _answer(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            if self._fd is not None:
                os.write(self._fd, _RESPONSE.pack(fd, FAN_ALLOW))
        with contextlib.suppress(OSError):
            os.close(fd)

    def take(self) -> list[tuple[int, str, str, int, float]]:
        """The opens waiting on the trigger's answer; hand them to :meth:`settle` after the
        trigger has read its inotify events (the creation it counts was queued before the
        open that asks)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._lock:
            asked, self._asked = self._asked, []
        return asked

    def settle(self, asked: list[tuple[int, str, str, int, float]], decide: Decide) -> None:
        """Hold, allow, or leave for the next look each open ``take`` gave."""
        later = []
        for fd, match, path, pid, t in asked:
            verdict = decide(match, path, pid)
            if verdict is None:
                later.append((fd, match, path, pid, t))
                continue
            with self._lock:
                if verdict:
                    self._held[fd] = Held(match, path, pid, t)
                else:
                    self._allowed.add(match)
            if not verdict:
                self._answer(fd)
        with self._lock:
            self._asked[:0] = later

    def held(self) -> Held | None:
        """The open being held now, if any (the first, when several)."""
        with self._lock:
            return next(iter(self._held.values()), None)

    def release(self) -> None:
        """Let every held open go on (the fault is in, or will not be sent)."""
        with self._lock:
            held, self._held = list(self._held), {}
        for fd in held:
            self._answer(fd)

    def close(self) -> None:
        """Allow everything still waiting and stop; the kernel allows what is left when the
        descriptor closes."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        self.release()
        with self._lock:
            asked, self._asked = self._asked, []
        for fd, *_ in asked:
            self._answer(fd)
        os.close(self._fd)
        self._fd = None
        for fd in (self._wake_r, self._wake_w, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---------------------------------------------------------------- the thread

    def _serve(self) -> None:
        """Answer at once what cannot be the trigger's moment; pass the rest to the loop;
        allow anything the loop left waiting past HOLD_MAX_S."""
        fd = self._fd
        assert fd is not None
        while True:
            try:
                ready, _, _ = select.select([fd, self._stop_r], [], [], 0.5)
                if self._stop_r in ready:
                    return
                if fd in ready:
                    with contextlib.suppress(BlockingIOError):
                        self._read(os.read(fd, 65536))
                self._expire()
            except Exception:  # never leave a job blocked: allow everything, go on
                self._expire(everything=True)
                time.sleep(0.01)

    def _read(self, data: bytes) -> None:
        offset = 0
        asked = False
        while offset + _METADATA.size <= len(data):
            length, _v, _r, _m, _mask, efd, pid = _METADATA.unpack_from(data, offset)
            offset += length or _METADATA.size
            if efd < 0:
                continue
            match, rel = self._which(efd)
            if match is None or pid == os.getpid():
                self._answer(efd)
                continue
            with self._lock:
                known = match in self._allowed
                if not known:
                    self._asked.append((efd, match, rel, pid, time.monotonic()))
            if known:
                self._answer(efd)
            else:
                asked = True
        if asked:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _which(self, efd: int) -> tuple[str | None, str]:
        """What the opened path is relative to the root, and the part of it that matches."""
        try:
            path = os.readlink(f"/proc/self/fd/{efd}")
            rel = PurePosixPath(path).relative_to(self.root.resolve())
        except (OSError, ValueError):
            return None, ""
        parts = rel.parts
        for n in range(1, len(parts) + 1):
            head = "/".join(parts[:n])
            if self._matches(head):
                return head, str(rel)
        return None, str(rel)

    def _expire(self, *, everything: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            late = [fd for fd, h in self._held.items()
                    if everything or now - h.since > HOLD_MAX_S]
            for fd in late:
                del self._held[fd]
            waiting = [a for a in self._asked if everything or now - a[4] > HOLD_MAX_S]
            self._asked = [a for a in self._asked if a not in waiting]
        for fd in [*late, *(a[0] for a in waiting)]:
            self._answer(fd)
