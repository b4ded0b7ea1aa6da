"""Watch a folder for files appearing, opened for writing, written, closed or going away:
inotify(7) through libc.

This is what lets a fault land *inside* a checkpoint save of a job that knows nothing about
Aftershock (``at: {file: 'step_*/COMMIT', when: created}``): the job's own file operations are
the trigger. The kernel queues an event the moment the operation happens; the harness reads
it within milliseconds (it waits on the descriptor, not on a timer), but the job runs on
meanwhile, so a trigger names the moment a fault is *sent*, not the instruction it lands on.

Patterns are globs relative to the watched root, one component per folder level (``*`` never
crosses ``/``; ``**`` matches any number of levels). Only the levels a pattern can reach are
watched, and folders are followed as they appear. The root itself may appear later too.

inotify watches one folder at a time, so a folder that appears is watched only once the
harness has read that it did: the job may already have written into it. A scan of the new
folder makes up for ``created`` (what is in it was created since), but a close or a delete
that happened in that moment is never reported: ``closed`` and ``deleted`` are reliable in
folders that exist when the file is closed or deleted (the checkpoint folder, ``latest.pt``
rewritten in place), not in a ``step_N/`` the job makes and fills at once. For those, use
``created`` on the final name.

``opened`` and ``modified`` hit a save that overwrites a file that already exists (its name
is never created again): ``modified`` on its first write (a truncating open is one),
``opened`` on its open, once the open is known to be for writing (inotify's IN_OPEN does not
say the mode: a process seen holding it for writing, or a write or a close after writing,
tells). Each counts once per open, so ``count: k`` is the k-th save.

No new dependency: ``inotify_init1`` and ``inotify_add_watch`` are called through ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fnmatch
import os
import struct
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Literal

from aftershock.faults._errors import FaultUnavailable

When = Literal["created", "opened", "modified", "closed", "deleted"]

IN_MODIFY = 0x2
IN_CLOSE_WRITE = 0x8
IN_CLOSE_NOWRITE = 0x10
IN_OPEN = 0x20
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: Which kernel events count for each `when:` value.
MASKS: dict[str, int] = {
    # A name comes into existence: open(O_CREAT), mkdir, or a rename onto it (how atomic
    # writers publish a file: the final name is never opened for writing).
    "created": IN_CREATE | IN_MOVED_TO,
    # A file is opened for writing. IN_OPEN does not say the mode: an open counts once a
    # process of the run is seen holding it for writing, or once it is written or closed
    # after writing (IN_MODIFY, IN_CLOSE_WRITE) before it is closed unwritten.
    "opened": IN_OPEN | IN_MODIFY | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE,
    # The first write since the file was opened (a truncating open counts): one per save,
    # so `count: k` is the k-th save, not the k-th write(2) of one.
    "modified": IN_MODIFY | IN_CLOSE_WRITE,
    # A file that was open for writing is closed (its writer says it is done with it).
    "closed": IN_CLOSE_WRITE,
    # A name goes away: unlink, rmdir, or a rename away from it.
    "deleted": IN_DELETE | IN_MOVED_FROM,
}
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


def _libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError) as exc:
        raise FaultUnavailable(f"inotify is not available here ({exc}): file triggers need "
                               "Linux's inotify(7)") from None
    return libc


def _hint(code: int) -> str:
    if code == errno.ENOSPC:
        return " (raise fs.inotify.max_user_watches)"
    if code == errno.EMFILE:
        return " (raise fs.inotify.max_user_instances)"
    if code == errno.ENOSYS:
        return " (the kernel was built without CONFIG_INOTIFY_USER)"
    return ""


def matches(pattern: str, rel: str) -> bool:
    """Does the relative path ``rel`` match ``pattern``, one component per level?"""

    def walk(pat: tuple[str, ...], parts: tuple[str, ...]) -> bool:
        if not pat:
            return not parts
        if pat[0] == "**":
            return any(walk(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and walk(pat[1:], parts[1:])

    return walk(PurePosixPath(pattern).parts, PurePosixPath(rel).parts)


class FileWatch:
    """Counts events of kind ``when`` on paths under ``root`` that match ``pattern``.

    Call ``poll`` (non-blocking) to take in what the kernel queued; wait on ``fileno`` with
    select(2) to be woken the moment there is something. Close it when done. What existed
    before the watch began never counts.

    ``writing(path)``: is ``path`` open for writing now (by a process that matters, e.g. one
    of the run's)? With ``opened`` it tells a writer's open from a reader's before the
    writer has written a byte; without it an open counts once it is written to.
    """

    def __init__(self, root: Path, pattern: str, when: When,
                 writing: Callable[[Path], bool] | None = None) -> None:
        self.root = root
        self.pattern = pattern
        self.when = when
        self.hits: list[str] = []  # matching relative paths, in the order they happened
        # How each hit came to be: "created" (open(O_CREAT)), "folder" (mkdir), "renamed"
        # (a rename onto it), "scanned" (a file already in a folder that just appeared),
        # or the `when:` for the other triggers: whether an open of it is still to come.
        self.how: list[str] = []
        self._writing_now = writing
        self._opens: dict[str, int] = {}  # path -> opens not yet known to be for writing
        self._writing: set[str] = set()  # paths counted (opened, modified) until closed
        parts = PurePosixPath(pattern).parts
        # Folder levels below the root that a match can lie in (unlimited with `**`).
        self._depth = None if "**" in parts else len(parts) - 1
        self._libc = _libc()
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise FaultUnavailable(f"inotify_init1: {os.strerror(code)}{_hint(code)}")
        self._fd: int | None = fd
        self._dirs: dict[int, str] = {}  # watch descriptor -> folder, relative to root
        self._ancestor: int | None = None  # watched while the root does not exist yet
        # (folder, name) -> inode, of what a scan took in: its own event may still be queued.
        self._scanned: dict[tuple[str, str], int] = {}
        self._attach(fresh=False)

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("the watch is closed")
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def folders(self) -> list[str]:
        """The folders watched now, relative to the root ("." for the root itself)."""
        return list(self._dirs.values())

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- watches

    def _add(self, path: Path, mask: int) -> int | None:
        wd = int(self._libc.inotify_add_watch(self.fileno(), os.fsencode(path),
                                              mask | IN_ONLYDIR))
        if wd < 0:
            code = ctypes.get_errno()
            if code in (errno.ENOENT, errno.ENOTDIR):
                return None  # gone again before we got to it
            raise FaultUnavailable(f"inotify_add_watch {path}: {os.strerror(code)}{_hint(code)}")
        return wd

    def _attach(self, *, fresh: bool) -> None:
        """Watch the root if it exists, else its nearest existing ancestor until it does."""
        if self._ancestor is not None:
            self._libc.inotify_rm_watch(self.fileno(), self._ancestor)
            self._ancestor = None
        if self.root.is_dir():
            self._watch_tree(".", fresh=fresh)
            return
        probe = self.root.parent
        while not probe.is_dir() and probe != probe.parent:
            probe = probe.parent
        self._ancestor = self._add(probe, IN_CREATE | IN_MOVED_TO)
        if self.root.is_dir():  # it appeared while we were adding the watch
            self._attach(fresh=True)

    def _watch_tree(self, rel: str, *, fresh: bool) -> None:
        """Watch folder ``rel`` and the levels under it that a match can reach. A ``fresh``
        folder appeared after the watch began: what is already in it was created since (it
        may have been made before its own watch was in place), so it counts as created."""
        # Folders are followed as they appear whatever the trigger: IN_CREATE and IN_MOVED_TO.
        wd = self._add(self.root / rel, MASKS[self.when] | IN_CREATE | IN_MOVED_TO)
        if wd is None:
            return
        self._dirs[wd] = rel
        try:
            found = sorted(os.scandir(self.root / rel), key=lambda e: e.name)
        except OSError:
            return
        for entry in found:
            child = entry.name if rel == "." else f"{rel}/{entry.name}"
            if fresh:
                # lstat's inode, as the event's check reads it: readdir's d_ino may differ
                # (FUSE reports none).
                # -1: unknown (a file a FUSE server is still creating can fail lstat).
                ino = -1
                with contextlib.suppress(OSError):
                    ino = entry.stat(follow_symlinks=False).st_ino
                self._scanned[(rel, entry.name)] = ino
                if self.when == "created":
                    self._count(child, "folder" if entry.is_dir(follow_symlinks=False)
                                else "scanned")
            if entry.is_dir(follow_symlinks=False) and self._deeper(rel):
                self._watch_tree(child, fresh=fresh)

    def _deeper(self, rel: str) -> bool:
        level = 0 if rel == "." else len(PurePosixPath(rel).parts)
        return self._depth is None or level < self._depth

    # ---------------------------------------------------------------- events

    def _count(self, rel: str, how: str) -> None:
        if matches(self.pattern, rel):
            self.hits.append(rel)
            self.how.append(how)

    def _opened(self, rel: str, mask: int) -> None:
        """``opened``: an open counts once something shows it was for writing."""
        if mask & IN_OPEN:
            self._opens[rel] = self._opens.get(rel, 0) + 1
            return
        if mask & (IN_MODIFY | IN_CLOSE_WRITE) and rel not in self._writing \
                and self._opens.get(rel):
            self._confirm(rel)
        if mask & IN_CLOSE_WRITE:
            self._writing.discard(rel)
        elif mask & IN_CLOSE_NOWRITE and self._opens.get(rel):
            self._opens[rel] -= 1  # a reader came and went

    def _modified(self, rel: str, mask: int) -> None:
        """``modified``: the first write of each open, so a save counts once."""
        if mask & IN_MODIFY and rel not in self._writing:
            self._writing.add(rel)
            self.hits.append(rel)
            self.how.append(self.when)
        if mask & IN_CLOSE_WRITE:
            self._writing.discard(rel)

    def _confirm(self, rel: str) -> None:
        self._opens[rel] -= 1
        self._writing.add(rel)
        self.hits.append(rel)
        self.how.append(self.when)

    def poll(self) -> list[str]:
        """Take in every queued event; the matching paths that are new since the last call."""
        before = len(self.hits)
        while True:
            try:
                data = os.read(self.fileno(), 65536)
            except BlockingIOError:
                break
            self._parse(data)
        if self._writing_now is not None:
            # An open not yet written to: is its file held for writing now? (A writer that
            # already closed it was counted by its IN_MODIFY or IN_CLOSE_WRITE.)
            for rel, pending in list(self._opens.items()):
                if pending and rel not in self._writing and self._writing_now(self.root / rel):
                    self._confirm(rel)
        return self.hits[before:]

    def _parse(self, data: bytes) -> None:
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
            offset += _EVENT.size + length
            self._event(wd, mask, os.fsdecode(raw.rstrip(b"\0")))

    def _event(self, wd: int, mask: int, name: str) -> None:
        """One inotify event: watch bookkeeping first, then what it means for the trigger."""
        if mask & IN_Q_OVERFLOW:
            raise FaultUnavailable(
                "the inotify queue overflowed (fs.inotify.max_queued_events): events were "
                "lost, so the trigger's count can no longer be trusted")
        if self._ancestor is not None and wd == self._ancestor:
            self._attach(fresh=True)  # something appeared on the way to the root
            return
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)  # the folder is gone (or was moved away)
            return
        rel = self._dirs.get(wd)
        if rel is None or not name:
            return
        child = name if rel == "." else f"{rel}/{name}"
        if self._already_scanned(rel, name, child, mask):
            return  # the scan took this very file in (and followed it)
        self._observe(rel, child, mask)

    def _observe(self, rel: str, child: str, mask: int) -> None:
        """What an event on ``child`` (in folder ``rel``) means for the trigger."""
        if self.when in ("opened", "modified"):
            if not mask & IN_ISDIR and matches(self.pattern, child):
                (self._opened if self.when == "opened" else self._modified)(child, mask)
        elif mask & MASKS[self.when]:
            how = ("renamed" if mask & IN_MOVED_TO else "folder" if mask & IN_ISDIR
                   else "created" if mask & IN_CREATE else self.when)
            self._count(child, how)
        if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO) and self._deeper(rel):
            self._watch_tree(child, fresh=True)

    def _already_scanned(self, rel: str, name: str, child: str, mask: int) -> bool:
        """Whether a created or moved-in ``child`` is the very file the scan counted."""
        scanned = self._scanned.pop((rel, name), None)
        if scanned is None:
            return False
        if mask & IN_CREATE:
            # Its own creation, queued before the scan read it: a short-lived file is often
            # renamed away by now, and a FUSE filesystem may give it another inode number
            # once it is synced. Counted twice, it would move every later count.
            return True
        if mask & IN_MOVED_TO:
            try:
                return os.lstat(self.root / child).st_ino == scanned
            except OSError:
                return True  # gone again: nothing shows a second file of that name
        return False
