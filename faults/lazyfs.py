"""A FUSE filesystem that forgets what was never made durable: the disk of a power loss.

``storage.lose_unsynced`` mounts it over a system's checkpoint folder before the system
starts, and at the fault tells it to lose every write that was not made durable. It is
Jepsen's lazyfs idea (a filesystem that drops un-fsynced data on command) in a few hundred
lines of Python over libfuse3 (``mfusepy``, the project's ``fuse`` extra), run as its own
process: ``python -m aftershock.faults.lazyfs FOLDER --name NAME``.

What "durable" means here is the weakest promise POSIX makes, so a writer that passes on
this filesystem is durable on any filesystem that keeps POSIX's promise:

- **File data** (``write``, ``truncate``) is durable once ``fsync`` or ``fdatasync`` of that
  file returns (through any descriptor; ``O_SYNC`` writes do it per write). Closing a file
  does not make it durable.
- **A directory entry** (a name created by ``open(O_CREAT)``, ``mkdir`` or ``symlink``,
  replaced or moved by ``rename``, removed by ``unlink`` or ``rmdir``) is durable once
  ``fsync`` of *that directory* returns. Each directory is on its own: a new folder's entry
  in its parent needs the parent's fsync, and the files in it need the folder's fsync. A
  ``rename`` between two folders needs both.
- A power loss puts every file back to its content as of its last fsync (empty if it never
  had one) and every directory back to its entries as of its last fsync. A file whose data
  was fsynced but whose name never was is gone; a name that was fsynced for a file whose
  data never was is an empty file (the "zero-length file after a crash" of real
  filesystems).

Real filesystems often keep more than this (ext4 commits a new file's entry with the file's
fsync, and writes dirty pages back on its own), never less; so this filesystem is the
adversary a checkpoint writer must survive. Not modeled: ``sync(2)``/``syncfs(2)`` (FUSE
does not pass them to the filesystem; only fsync counts), hard links (refused with EPERM),
special files, and attributes (mode, owner and times are kept as they are, never lost).

The durable state is kept where a disk would keep it: in the folder *under* the mount,
reached through a descriptor opened before mounting. After the fault, and after the mount is
gone, that folder holds exactly what survived. What was written and not yet made durable
lives in this process's memory: the filesystem is meant for a test run's checkpoint folder,
and holds its whole content in memory.

For a `created` file trigger the filesystem also holds the job (:class:`Hold`, the harness's
end of a ``hold`` command): the next operation of the process that made the count-th
matching name waits until the harness's fault is in, as fanotify's gate does on an ordinary
folder (faults/_fanotify.py).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import json
import logging
import os
import posixpath
import select
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from aftershock.faults._fanotify import Held as Held  # re-exported: what Hold.held() gives
from aftershock.faults._inotify import matches
from aftershock.faults._openat import mounts

#: Name prefix of every lazy filesystem's source (the first column of /proc/mounts).
SOURCE_PREFIX = "aftershock_lazyfs_"
_TMP_SUFFIX = ".aftershock-lazyfs"  # a file being written into the folder below
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
#: The longest a held operation waits for its harness (``hold``): the harness lets it go as
#: soon as its fault is in (milliseconds); this only bounds a harness that stalled or died.
HOLD_MAX_S = 10.0
#: fsyncs remembered per file (``syncs``): a test run's journal fsyncs thousands of times.
SYNCS_KEPT = 200_000


def _now() -> int:
    return time.time_ns()


@dataclass(eq=False)
class Node:
    """A file, folder or symbolic link: what it holds now and what a power loss leaves."""

    mode: int  # st_mode, type bits included
    uid: int = 0
    gid: int = 0
    mtime_ns: int = field(default_factory=_now)
    ctime_ns: int = field(default_factory=_now)
    # Files and links: the content as of the last fsync (a link's target is durable with its
    # entry), and what was written since (None while nothing was).
    synced: bytes = b""
    data: bytearray | None = None
    # Folders: the entries now, and as of the folder's last fsync.
    entries: dict[str, Node] = field(default_factory=dict)
    durable: dict[str, Node] = field(default_factory=dict)
    # Files: when each fsync that changed the content returned, and the size it made
    # durable (monotonic seconds): what a client was shown can be checked against it.
    syncs: list[tuple[float, int]] = field(default_factory=list)
    syncs_cut: bool = False  # the oldest were dropped (SYNCS_KEPT)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def content(self) -> bytes | bytearray:
        return self.synced if self.data is None else self.data


@dataclass(frozen=True, slots=True)
class Loss:
    """What a power loss took: ``files`` files gone or rolled back to their last fsync
    (``bytes`` bytes of theirs lost) and ``entries`` directory entries that differed from
    their folder's last fsync."""

    files: int
    bytes: int
    entries: int

    def describe(self) -> str:
        return (f"{self.files} file(s) gone or rolled back ({self.bytes} bytes) and "
                f"{self.entries} directory entr{'y' if self.entries == 1 else 'ies'}")


def _fail(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code), what or None)


def _may_replace(node: Node, replaced: Node, new: str, flags: int) -> None:
    """Raise what rename(2) raises where moving ``node`` over ``replaced`` is not allowed."""
    if flags & _RENAME_NOREPLACE:
        raise _fail(errno.EEXIST, new)
    if replaced.is_dir and not node.is_dir:
        raise _fail(errno.EISDIR, new)
    if node.is_dir and not replaced.is_dir:
        raise _fail(errno.ENOTDIR, new)
    if replaced.is_dir and replaced.entries:
        raise _fail(errno.ENOTEMPTY, new)


class LazyTree:
    """The filesystem's state, without FUSE: every operation the mount serves, the loss,
    and the durable image kept in the folder ``below``.

    Not thread-safe by itself: the FUSE adapter holds one lock around every call.
    """

    def __init__(self, below: Path) -> None:
        self.below = below
        # `below` itself may be /proc/self/fd/N, a link to the folder: follow it there only.
        self.root = self._load(below, os.stat(below))
        self.root.durable = dict(self.root.entries)

    # ------------------------------------------------------------------ loading

    def _load(self, path: Path, st: os.stat_result) -> Node:
        node = Node(st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns)
        if stat.S_ISDIR(st.st_mode):
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                if entry.name.endswith(_TMP_SUFFIX):
                    continue  # our own half-written copy, from a server that was killed
                found = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(found.st_mode) or stat.S_ISREG(found.st_mode) \
                        or stat.S_ISLNK(found.st_mode):
                    node.entries[entry.name] = self._load(Path(entry.path), found)
            node.durable = dict(node.entries)
        elif stat.S_ISLNK(st.st_mode):
            node.synced = os.fsencode(os.readlink(path))
        else:
            node.synced = path.read_bytes()
        return node

    # ------------------------------------------------------------------ lookup

    def lookup(self, path: str) -> Node:
        node = self.root
        for part in PurePosixPath(path).parts[1:]:
            if not node.is_dir:
                raise _fail(errno.ENOTDIR, path)
            child = node.entries.get(part)
            if child is None:
                raise _fail(errno.ENOENT, path)
            node = child
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        pure = PurePosixPath(path)
        if pure.name in ("", ".", ".."):
            raise _fail(errno.EINVAL, path)
        parent = self.lookup(str(pure.parent))
        if not parent.is_dir:
            raise _fail(errno.ENOTDIR, path)
        return parent, pure.name

    @staticmethod
    def attributes(node: Node) -> dict[str, int]:
        size = len(node.content) if not node.is_dir else 4096
        links = 2 + sum(c.is_dir for c in node.entries.values()) if node.is_dir else 1
        return {
            "st_mode": node.mode, "st_nlink": links, "st_size": size,
            "st_uid": node.uid, "st_gid": node.gid, "st_blocks": -(-size // 512),
            "st_atime": node.mtime_ns, "st_mtime": node.mtime_ns, "st_ctime": node.ctime_ns,
        }

    def paths(self) -> Iterator[str]:
        """Every path in the tree now, relative to its root."""
        def visit(node: Node, rel: str) -> Iterator[str]:
            for name, child in node.entries.items():
                path = f"{rel}{name}"
                yield path
                if child.is_dir:
                    yield from visit(child, path + "/")
        return visit(self.root, "")

    # ------------------------------------------------------------------ namespace

    def _add(self, path: str, node: Node) -> Node:
        parent, name = self._parent(path)
        if name in parent.entries:
            raise _fail(errno.EEXIST, path)
        parent.entries[name] = node
        parent.mtime_ns = parent.ctime_ns = _now()
        return node

    def create(self, path: str, mode: int, uid: int = 0, gid: int = 0) -> Node:
        return self._add(path, Node(stat.S_IFREG | stat.S_IMODE(mode), uid, gid))

    def mkdir(self, path: str, mode: int, uid: int = 0, gid: int = 0) -> Node:
        return self._add(path, Node(stat.S_IFDIR | stat.S_IMODE(mode), uid, gid))

    def symlink(self, path: str, target: str, uid: int = 0, gid: int = 0) -> Node:
        return self._add(path, Node(stat.S_IFLNK | 0o777, uid, gid, synced=os.fsencode(target)))

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise _fail(errno.ENOENT, path)
        if node.is_dir:
            raise _fail(errno.EISDIR, path)
        del parent.entries[name]
        parent.mtime_ns = parent.ctime_ns = _now()

    def rmdir(self, path: str) -> None:
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise _fail(errno.ENOENT, path)
        if not node.is_dir:
            raise _fail(errno.ENOTDIR, path)
        if node.entries:
            raise _fail(errno.ENOTEMPTY, path)
        del parent.entries[name]
        parent.mtime_ns = parent.ctime_ns = _now()

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        src_dir, src_name = self._parent(old)
        dst_dir, dst_name = self._parent(new)
        node = src_dir.entries.get(src_name)
        if node is None:
            raise _fail(errno.ENOENT, old)
        if node.is_dir and (new + "/").startswith(old.rstrip("/") + "/") and new != old:
            raise _fail(errno.EINVAL, new)  # a folder into itself
        replaced = dst_dir.entries.get(dst_name)
        if flags & _RENAME_EXCHANGE:
            if replaced is None:
                raise _fail(errno.ENOENT, new)
            src_dir.entries[src_name], dst_dir.entries[dst_name] = replaced, node
        else:
            if replaced is not None and replaced is not node:
                _may_replace(node, replaced, new, flags)
            del src_dir.entries[src_name]
            dst_dir.entries[dst_name] = node
        now = _now()
        src_dir.mtime_ns = src_dir.ctime_ns = dst_dir.mtime_ns = dst_dir.ctime_ns = now
        node.ctime_ns = now

    # ------------------------------------------------------------------ data

    @staticmethod
    def read(node: Node, size: int, offset: int) -> bytes:
        if node.is_dir:
            raise _fail(errno.EISDIR)
        return bytes(node.content[offset : offset + size])

    @staticmethod
    def write(node: Node, data: bytes, offset: int) -> int:
        if node.is_dir:
            raise _fail(errno.EISDIR)
        if node.data is None:
            node.data = bytearray(node.synced)
        if offset > len(node.data):
            node.data.extend(bytes(offset - len(node.data)))  # a hole reads as zeros
        node.data[offset : offset + len(data)] = data
        node.mtime_ns = node.ctime_ns = _now()
        return len(data)

    @staticmethod
    def truncate(node: Node, length: int) -> None:
        if node.is_dir:
            raise _fail(errno.EISDIR)
        if node.data is None:
            node.data = bytearray(node.synced)
        if length < len(node.data):
            del node.data[length:]
        else:
            node.data.extend(bytes(length - len(node.data)))
        node.mtime_ns = node.ctime_ns = _now()

    # ------------------------------------------------------------------ durability

    def fsync(self, node: Node) -> None:
        """The file's content becomes durable (where its name is durable, also below)."""
        if node.is_dir:
            self.fsyncdir(node)
            return
        if node.data is None:
            return
        node.synced, node.data = bytes(node.data), None
        for rel in self._durable_paths(node):
            self._write_below(rel, node)
        if len(node.syncs) >= SYNCS_KEPT:  # the oldest half goes, and `syncs` says so
            del node.syncs[:SYNCS_KEPT // 2]
            node.syncs_cut = True
        node.syncs.append((time.monotonic(), len(node.synced)))  # durable from here on

    def fsyncdir(self, node: Node) -> None:
        """The folder's entries become durable: below, names removed or replaced since its
        last fsync go, and new ones are written with their own durable content."""
        old, node.durable = node.durable, dict(node.entries)
        for rel in self._durable_paths(node):
            for name, child in old.items():
                if node.durable.get(name) is not child:
                    self._remove_below(rel / name)
            for name, child in node.durable.items():
                if old.get(name) is not child:
                    self._materialize(child, rel / name)

    def lose(self) -> Loss:
        """The power loss: every file back to its last fsync, every folder to its entries as
        of its last fsync. What was reachable only through lost entries is gone."""
        loss = self.unsynced()
        for node in self._walk(self.root, "durable"):
            if node.is_dir:
                node.entries = dict(node.durable)
            else:
                node.data = None
        return loss

    def unsynced(self) -> Loss:
        """What a power loss would take now, without taking it: the files it would remove
        or roll back (and the bytes of theirs that would go), and the directory entries
        that differ from their last fsync."""
        kept = {id(n) for n in self._walk(self.root, "durable")}
        files = lost_bytes = entries = 0
        for node in self._walk(self.root, "entries"):
            if node.is_dir:
                names = set(node.entries) | set(node.durable)
                entries += sum(node.entries.get(n) is not node.durable.get(n) for n in names)
            elif id(node) not in kept:
                files, lost_bytes = files + 1, lost_bytes + len(node.content)
            elif node.data is not None:
                files, lost_bytes = files + 1, lost_bytes + len(node.data)
        return Loss(files, lost_bytes, entries)

    @staticmethod
    def _walk(node: Node, view: str) -> Iterator[Node]:
        yield node
        for child in getattr(node, view).values():
            if child.is_dir:
                yield from LazyTree._walk(child, view)
            else:
                yield child

    def _durable_paths(self, target: Node) -> list[PurePosixPath]:
        """Where ``target`` is in the durable tree (usually once, possibly nowhere)."""
        found: list[PurePosixPath] = []

        def visit(node: Node, rel: PurePosixPath) -> None:
            if node is target:
                found.append(rel)
            if node.is_dir:
                for name, child in node.durable.items():
                    visit(child, rel / name)

        visit(self.root, PurePosixPath("."))
        return found

    # ------------------------------------------------------------------ the folder below

    def _path_below(self, rel: PurePosixPath) -> Path:
        return self.below / rel

    def _remove_below(self, rel: PurePosixPath) -> None:
        path = self._path_below(rel)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _write_below(self, rel: PurePosixPath, node: Node) -> None:
        path = self._path_below(rel)
        staged = path.with_name(path.name + _TMP_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        if stat.S_ISLNK(node.mode):
            os.symlink(os.fsdecode(node.synced), staged)
        else:
            staged.write_bytes(node.synced)
            os.chmod(staged, stat.S_IMODE(node.mode))
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(staged, path)  # whole or not at all, should this process be killed

    def _materialize(self, node: Node, rel: PurePosixPath) -> None:
        """Make ``below/rel`` hold ``node``'s durable content, recursively."""
        if not node.is_dir:
            self._write_below(rel, node)
            return
        self._remove_below(rel)
        path = self._path_below(rel)
        path.mkdir()
        os.chmod(path, stat.S_IMODE(node.mode))
        for name, child in node.durable.items():
            self._materialize(child, rel / name)


# ---------------------------------------------------------------------- holding the job


def _tgid(tid: int) -> int:
    """The process a thread belongs to (FUSE names the calling thread)."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{tid}/status") as status:
        for line in status:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    return tid


def _being_killed(tid: int) -> bool:
    """Is thread ``tid`` gone, or has it a SIGKILL pending (a fatal signal sets it)?"""
    try:
        with open(f"/proc/{tid}/status") as status:
            for line in status:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (
                        1 << (9 - 1)):
                    return True
    except (OSError, ValueError):
        return True
    return False


def _head(pattern: str, rel: str) -> str | None:
    """The part of ``rel`` (itself or a folder above it) that matches ``pattern``."""
    parts = PurePosixPath(rel).parts
    for n in range(1, len(parts) + 1):
        head = "/".join(parts[:n])
        if matches(pattern, head):
            return head
    return None


class _Hold:
    """One harness's ``hold``: the ``count``-th new name matching ``pattern`` (created,
    made, or renamed into place) arms it, and the next operation of the process that made
    that name waits until :meth:`release`, at most ``max_s`` seconds.

    Not the name's own creation: while a create, mkdir or rename waits, the kernel holds the
    folder's lock, and the harness's own look at the new file would wait behind it. The ops
    held (open, opendir, read, write, flush, fsync of a file) hold no folder's lock, so the
    fault lands after the name appeared and before the job's next step of the save (its
    data, or the folder fsync that makes the name durable)."""

    def __init__(self, pattern: str, count: int, max_s: float, existing: set[str],
                 tell: Callable[[dict[str, Any]], None]) -> None:
        self.pattern, self.count, self.max_s = pattern, count, max_s
        self._existing = existing
        self._seen: list[str] = []
        self._tell = tell
        self._armed: tuple[str, int] | None = None  # the k-th match and the process to hold
        self._done = threading.Event()  # released (or over): nothing more is held
        self._lock = threading.Lock()

    def appeared(self, rel: str, pid: int) -> None:
        """A name came into existence (under the tree's lock: bookkeeping only)."""
        head = _head(self.pattern, rel)
        if head is None or head in self._seen or head in self._existing or self._done.is_set():
            return
        self._seen.append(head)
        if len(self._seen) == self.count:
            with self._lock:
                self._armed = (head, _tgid(pid))

    def wait(self, rel: str, pid: int) -> None:
        """Called before an operation that holds no folder's lock (outside the tree's lock,
        so the loss can still run): hold it if it is the armed process's next one."""
        with self._lock:
            if self._armed is None or self._done.is_set() or _tgid(pid) != self._armed[1]:
                return
            match, tgid = self._armed
            self._armed = None
        began = time.monotonic()
        self._tell({"held": {"match": match, "path": rel, "pid": tgid}})
        # A process waiting on a FUSE answer cannot die before it has one: once it is being
        # killed (the power loss kills the job), it is let go, and dies without running
        # another line of its own. Else the release, or the bound.
        while not self._done.wait(0.02):
            if _being_killed(pid):
                break
            if time.monotonic() - began > self.max_s:
                self._tell({"expired": {"match": match,
                                        "after_s": round(time.monotonic() - began, 3)}})
                break
        self._done.set()

    def release(self) -> None:
        """The fault is in, or the harness is gone: what is held goes on, nothing more is."""
        self._done.set()


# ---------------------------------------------------------------------- the FUSE adapter

_T = TypeVar("_T")


class LazyOperations:
    """mfusepy's operations over a LazyTree: one lock around every call, file handles
    mapped to nodes (a renamed or unlinked open file keeps its node), and a powered-off
    state in which every request fails with EIO (between the loss and the writers' death).

    mfusepy registers every attribute named like a FUSE operation as that operation (a
    ``lock`` attribute would become fcntl locking): the rest is named otherwise.
    """

    use_ns = True  # times in nanoseconds (mfusepy's modern interface)
    # Requests on open files are served by handle; with both flags libfuse passes no path for
    # them, so a file unlinked while open (hard_remove) keeps working.
    flag_nullpath_ok = True
    flag_nopath = True

    def __init__(self, tree: LazyTree, on_mounted: Callable[[], None]) -> None:
        self._tree = tree
        self._lock = threading.Lock()
        self._powered = True
        self._on_mounted = on_mounted
        self._handles: dict[int, Node] = {}
        self._paths: dict[int, str] = {}  # handle -> the path it was opened by
        self._next = 1
        self._holds: tuple[_Hold, ...] = ()  # the harness's `hold`s (replaced, never changed)

    def _call(self, fn: Callable[[], _T]) -> _T:
        with self._lock:
            if not self._powered:
                raise _fail(errno.EIO)
            return fn()

    def _handle(self, node: Node, path: str = "") -> int:
        fh, self._next = self._next, self._next + 1
        self._handles[fh] = node
        self._paths[fh] = path
        return fh

    def _appeared(self, path: str) -> None:
        """A name came into existence at ``path`` (under the lock): the holds count it."""
        if self._holds:
            pid = self._caller()
            for hold in self._holds:
                hold.appeared(path.lstrip("/"), pid)

    def _wait(self, path: str | None, fh: int | None = None) -> None:
        """Before an operation that holds no folder's lock in the kernel: wait here if a
        hold is for it (never under the lock, so `lose` and other requests go on)."""
        if self._holds:
            rel = path if path is not None else self._paths.get(fh or 0, "")
            pid = self._caller()
            for hold in self._holds:
                hold.wait(rel.lstrip("/"), pid)

    @staticmethod
    def _caller() -> int:
        import mfusepy

        return int(mfusepy.fuse_get_context()[2])

    def _node(self, path: str | None, fh: int | None) -> Node:
        if fh is not None and fh in self._handles:
            return self._handles[fh]
        if path is None:
            raise _fail(errno.EBADF)
        return self._tree.lookup(path)

    @staticmethod
    def _owner() -> tuple[int, int]:
        import mfusepy

        uid, gid, _ = mfusepy.fuse_get_context()
        return uid, gid

    # -- lifecycle
    def init(self, path: str) -> None:
        self._on_mounted()

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._tree.below)
        return {k: getattr(st, k) for k in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_namemax")}

    # -- attributes
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, int]:
        return self._call(lambda: self._tree.attributes(self._node(path, fh)))

    def access(self, path: str, amode: int) -> int:
        self._call(lambda: self._tree.lookup(path))
        return 0

    def chmod(self, path: str | None, mode: int) -> int:
        def run() -> None:
            node = self._node(path, None)
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        self._call(run)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        def run() -> None:
            node = self._node(path, None)
            node.uid = node.uid if uid == -1 else uid
            node.gid = node.gid if gid == -1 else gid
        self._call(run)
        return 0

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        def run() -> None:
            node = self._node(path, None)
            node.mtime_ns = times[1] if times else _now()
        self._call(run)
        return 0

    # -- namespace
    def create(self, path: str, mode: int, flags: int = 0) -> int:
        uid, gid = self._owner()

        def run() -> int:
            fh = self._handle(self._tree.create(path, mode, uid, gid), path)
            self._appeared(path)
            return fh
        return self._call(run)

    def mknod(self, path: str, mode: int, dev: int) -> int:
        if not stat.S_ISREG(mode):
            raise _fail(errno.EPERM, path)  # only regular files, folders and links
        uid, gid = self._owner()

        def run() -> None:
            self._tree.create(path, mode, uid, gid)
            self._appeared(path)
        self._call(run)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        uid, gid = self._owner()

        def run() -> None:
            self._tree.mkdir(path, mode, uid, gid)
            self._appeared(path)
        self._call(run)
        return 0

    def symlink(self, target: str, source: str) -> int:
        # mfusepy's order: `target` is the new link's path, `source` what it points to.
        uid, gid = self._owner()

        def run() -> None:
            self._tree.symlink(target, source, uid, gid)
            self._appeared(target)
        self._call(run)
        return 0

    def readlink(self, path: str) -> str:
        return self._call(lambda: os.fsdecode(bytes(self._tree.lookup(path).content)))

    def link(self, target: str, source: str) -> int:
        raise _fail(errno.EPERM, target)  # hard links are not modeled

    def unlink(self, path: str) -> int:
        self._call(lambda: self._tree.unlink(path))
        return 0

    def rmdir(self, path: str) -> int:
        self._call(lambda: self._tree.rmdir(path))
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        def run() -> None:
            self._tree.rename(old, new, flags)
            self._appeared(new)  # a name renamed into place appears too
        self._call(run)
        return 0

    # -- files
    def open(self, path: str, flags: int) -> int:
        self._wait(path)
        return self._call(lambda: self._handle(self._tree.lookup(path), path))

    def release(self, path: str | None, fh: int) -> int:
        with self._lock:  # also while powered off: the kernel must be able to let go
            self._handles.pop(fh, None)
            self._paths.pop(fh, None)
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        self._wait(path, fh)
        return 0  # close(2) makes nothing durable

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        self._wait(path, fh)
        return self._call(lambda: self._tree.read(self._node(path, fh), size, offset))

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        self._wait(path, fh)
        return self._call(lambda: self._tree.write(self._node(path, fh), data, offset))

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        self._call(lambda: self._tree.truncate(self._node(path, fh), length))
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self._wait(path, fh)
        self._call(lambda: self._tree.fsync(self._node(path, fh)))
        return 0

    # -- folders
    def opendir(self, path: str) -> int:
        self._wait(path)
        return self._call(lambda: self._handle(self._tree.lookup(path), path))

    def releasedir(self, path: str | None, fh: int) -> int:
        return self.release(path, fh)

    def readdir(self, path: str | None, fh: int) -> list[tuple[str, dict[str, int], int]]:
        def run() -> list[tuple[str, dict[str, int], int]]:
            node = self._node(path, fh)
            listing = [(".", {"st_mode": node.mode}, 0), ("..", {"st_mode": stat.S_IFDIR}, 0)]
            return listing + [(n, {"st_mode": c.mode}, 0) for n, c in node.entries.items()]
        return self._call(run)

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self._call(lambda: self._tree.fsyncdir(self._node(path, fh)))
        return 0

    # -- the harness's commands
    def hold(self, conn: socket.socket, args: dict[str, Any]) -> None:
        """Serve one ``hold`` on its connection until the harness says ``release`` or goes
        away (its end closed): then what is held goes on and nothing more is held."""
        sending = threading.Lock()

        def tell(message: dict[str, Any]) -> None:
            with sending, contextlib.suppress(OSError):
                conn.sendall(json.dumps(message).encode() + b"\n")

        try:
            pattern, count = str(args["pattern"]), int(args["count"])
            max_s = min(float(args.get("max_s", HOLD_MAX_S)), HOLD_MAX_S)
        except (KeyError, TypeError, ValueError) as exc:
            tell({"ok": False, "error": f"hold needs pattern and count: {exc}"})
            return
        with self._lock:  # what already matches never counts, as for the inotify watch
            existing = {h for rel in self._tree.paths() if (h := _head(pattern, rel))}
            hold = _Hold(pattern, count, max_s, existing, tell)
            self._holds = (*self._holds, hold)
            tell({"ok": True})  # under the lock: before anything the hold could say
        try:
            with conn.makefile("rb") as lines:
                for line in lines:
                    if line.strip() == b"release":
                        break
        except OSError:
            pass
        finally:
            hold.release()
            with self._lock:
                self._holds = tuple(h for h in self._holds if h is not hold)

    def control(self, name: str) -> dict[str, Any]:
        with self._lock:
            if name == "lose":
                loss = self._tree.lose()
                self._powered = False  # until `on`: the writers are being killed meanwhile
                return {"ok": True, "files": loss.files, "bytes": loss.bytes,
                        "entries": loss.entries}
            if name == "on":
                self._powered = True
                return {"ok": True}
            if name == "unsynced":
                loss = self._tree.unsynced()
                return {"ok": True, "files": loss.files, "bytes": loss.bytes,
                        "entries": loss.entries}
            if name == "ping":
                return {"ok": True}
            if name.startswith("syncs "):
                return self._syncs(name[len("syncs "):])
        return {"ok": False, "error": f"unknown command {name!r}"}

    def _syncs(self, path: str) -> dict[str, Any]:
        """The fsyncs of the file at ``path`` (from the mount's root): ``[[monotonic time
        it returned, size made durable], ...]`` oldest first. Only those that changed the
        content; an fsync with nothing new to make durable changes nothing."""
        try:
            node = self._tree.lookup("/" + path.lstrip("/"))
        except OSError as exc:
            return {"ok": False, "error": f"syncs {path}: {os.strerror(exc.errno or 0)}"}
        if node.is_dir:
            return {"ok": False, "error": f"syncs {path}: a folder"}
        return {"ok": True, "syncs": [[t, size] for t, size in node.syncs],
                "complete": not node.syncs_cut}


# ---------------------------------------------------------------------- control channel


def _address(name: str) -> str:
    # Linux's abstract socket namespace: no file to leave behind, no path length limit.
    return "\0" + name


def command(name: str, what: str, timeout: float = 10.0) -> dict[str, Any]:
    """Send one command to the lazy filesystem called ``name``; its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(_address(name))
        except OSError as exc:
            raise ConnectionError(f"lazy filesystem {name} is not answering: {exc}") from exc
        sock.sendall(what.encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    answer = json.loads(reply or b"{}")
    if not answer.get("ok"):
        raise RuntimeError(f"lazy filesystem {name}: {answer.get('error', 'no answer')}")
    return dict(answer)


class Hold:
    """The harness's end of a ``hold`` on the lazy filesystem ``name``: the job's next
    operation after the ``count``-th new name matching ``pattern`` (relative to the mount's
    root) waits until :meth:`close`, at most ``max_s`` seconds. It has the interface the
    file triggers use for a fanotify gate (faults/_fanotify.py): the filesystem decides
    itself, so :meth:`mark` and :meth:`settle` have nothing to do. Closing it, or the
    harness dying (the connection closes), lets the held operation go on."""

    whole_mount = True  # the filesystem sees every level of itself
    sees_renames = True  # a name renamed into place arms it as a created one does

    def __init__(self, name: str, pattern: str, count: int, max_s: float = HOLD_MAX_S,
                 timeout: float = 10.0, within: str = "") -> None:
        # ``within``: the trigger's root is this folder of the mount; ``pattern`` and the
        # paths :meth:`held` gives are relative to it.
        self._within = within.strip("/")
        if self._within:
            pattern = f"{glob.escape(self._within)}/{pattern}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buffer = b""
        self._held: Held | None = None
        self.expired: dict[str, Any] | None = None  # the bound ended the hold, not we
        # Readable never: stands in for the connection once the server is gone, so the
        # trigger loop's select does not spin on an end of file.
        self._idle_r, self._idle_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(_address(name))
            self._sock.sendall(b"hold " + json.dumps(
                {"pattern": pattern, "count": count, "max_s": max_s}).encode() + b"\n")
            while b"\n" not in self._buffer:
                chunk = self._sock.recv(4096)
                if not chunk:
                    break
                self._buffer += chunk
            line, _, self._buffer = self._buffer.partition(b"\n")
            answer = json.loads(line or b"{}")
            if not answer.get("ok"):
                raise RuntimeError(f"lazy filesystem {name}: "
                                   f"{answer.get('error', 'no answer to hold')}")
            self._sock.setblocking(False)
        except BaseException:
            self.close()
            raise
        self._open = True

    def fileno(self) -> int:
        """Readable when the filesystem has something to say (for select)."""
        return self._sock.fileno() if self._open else self._idle_r

    def mark(self, rel: str) -> bool:
        return True

    def take(self) -> list[tuple[int, str, str, int, float]]:
        """Read what the filesystem said (an operation held, or the bound let it go)."""
        while self._open:
            try:
                chunk = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._open = False  # the server is gone: whatever it held went with it
                self._held = None
                break
            self._buffer += chunk
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            with contextlib.suppress(ValueError):
                self._heard(json.loads(line))
        return []

    def _heard(self, message: dict[str, Any]) -> None:
        if isinstance(held := message.get("held"), dict):
            self._held = Held(self._rel(str(held["match"])), self._rel(str(held["path"])),
                              int(held["pid"]), time.monotonic())
        elif isinstance(message.get("expired"), dict):
            self._held = None
            self.expired = dict(message["expired"])
            self.expired["match"] = self._rel(str(self.expired.get("match", "")))

    def _rel(self, path: str) -> str:
        """``path`` (relative to the mount) relative to the trigger's root."""
        return posixpath.relpath(path, self._within) if self._within else path

    def settle(self, asked: list[tuple[int, str, str, int, float]], decide: Any) -> None:
        """Nothing to decide: the filesystem holds its count-th match itself."""

    def held(self) -> Held | None:
        """The operation being held now, as of the last :meth:`take`."""
        return self._held

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        """Let what is held go on, and hold nothing more."""
        if getattr(self, "_open", False):
            with contextlib.suppress(OSError):
                self._sock.setblocking(True)
                self._sock.settimeout(2.0)
                self._sock.sendall(b"release\n")
        self._open = False
        self._held = None
        self._sock.close()
        if self._idle_r >= 0:
            os.close(self._idle_r)
            os.close(self._idle_w)
            self._idle_r = self._idle_w = -1


def _serve_commands(ops: LazyOperations, name: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(_address(name))
    server.listen(4)

    def serve_hold(conn: socket.socket, args: str) -> None:
        with conn:
            try:
                ops.hold(conn, json.loads(args))
            except ValueError as exc:
                conn.sendall(json.dumps({"ok": False, "error": f"hold: {exc}"}).encode() + b"\n")

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            line = conn.makefile("rb").readline().decode().strip()
            if line.startswith("hold "):  # stays open: a thread of its own
                threading.Thread(target=serve_hold, args=(conn, line[5:]), name="lazyfs-hold",
                                 daemon=True).start()
                continue
            with conn:
                conn.sendall(json.dumps(ops.control(line)).encode() + b"\n")

    threading.Thread(target=loop, name="lazyfs-control", daemon=True).start()
    return server


def mounted_source(folder: Path) -> str | None:
    """The source name of the topmost mount on ``folder``, if any."""
    on = [m.source for m in mounts() if m.point == Path(folder)]
    return on[-1] if on else None


def unmount(folder: Path, source: str) -> None:
    """Unmount ``source`` from ``folder`` if it is the top mount there; lazily if busy."""
    if mounted_source(folder) != source:
        return
    tool = shutil.which("fusermount3") or "/usr/bin/fusermount3"
    subprocess.run([tool, "-u", "-q", str(folder)], capture_output=True, check=False,
                   timeout=30)
    if mounted_source(folder) == source:  # busy: detach now, the kernel frees it when unused
        subprocess.run([tool, "-u", "-z", "-q", str(folder)], capture_output=True,
                       check=False, timeout=30)
    if mounted_source(folder) == source:
        raise RuntimeError(f"could not unmount {source} from {folder}")


# ---------------------------------------------------------------------- starting and stopping


class Unavailable(RuntimeError):
    """The lazy filesystem cannot run here (no /dev/fuse, no libfuse3, no mfusepy)."""


def _expect(proc: subprocess.Popen[bytes], word: str, timeout: float, log: Path | None) -> None:
    """Wait for the server to print ``word`` on its stdout."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line == word:
            return
        if line.startswith("unavailable:"):
            raise Unavailable(line.removeprefix("unavailable:").strip())
        if not ready or not line:
            tail = ""
            if log is not None and log.exists():
                tail = log.read_text(errors="replace").strip()[-800:]
            state = "exited" if proc.poll() is not None else f"said nothing for {timeout:g}s"
            raise Unavailable(f"the lazy filesystem server {state} before {word!r}"
                              + (f": {tail}" if tail else ""))


def launch(folder: Path, name: str, log: Path | None = None,
           timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """Start a server for ``folder``; it has read the folder but not mounted yet. The
    returned process must be given ``mount_now`` or closed: it mounts only when told."""
    if not os.path.exists("/dev/fuse"):
        raise Unavailable("no /dev/fuse: load the fuse module (modprobe fuse) or run the "
                          "container with --device /dev/fuse")
    stderr: Any = subprocess.DEVNULL
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        stderr = open(log, "ab")  # noqa: SIM115 (the child owns it from here on)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aftershock.faults.lazyfs", str(folder), "--name", name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            start_new_session=True,  # Ctrl-C in the harness's terminal must not reach it
            close_fds=True,
        )
    finally:
        if log is not None:
            stderr.close()
    try:
        _expect(proc, "ready", timeout, log)
    except BaseException:
        close(proc)
        raise
    return proc


def mount_now(proc: subprocess.Popen[bytes], folder: Path, name: str,
              log: Path | None = None, timeout: float = 30.0) -> None:
    """Tell a launched server to mount; returns once the kernel has the mount."""
    assert proc.stdin is not None
    proc.stdin.write(b"mount\n")
    proc.stdin.flush()
    _expect(proc, "mounted", timeout, log)
    if mounted_source(folder) != name:
        raise Unavailable(f"{name} said it mounted, but {folder} shows no such mount")


def close(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Close our ends of the pipes (a mounted server then unmounts itself) and reap it."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def mounted(folder: Path, log: Path | None = None) -> Iterator[str]:
    """A lazy filesystem over ``folder`` for the block; yields its name (for ``command``)."""
    name = SOURCE_PREFIX + os.urandom(6).hex()
    proc = launch(folder, name, log)
    try:
        mount_now(proc, folder, name, log)
        yield name
    finally:
        try:
            unmount(folder, name)
        finally:
            close(proc)


# ---------------------------------------------------------------------- the server


def main(argv: list[str] | None = None) -> int:
    """The server. Handshake on stdin/stdout: it says ``ready`` once it has read the folder,
    mounts only when told ``mount``, says ``mounted`` when the kernel has the mount, and
    unmounts itself when its stdin closes (the harness that started it is gone)."""
    parser = argparse.ArgumentParser(prog="python -m aftershock.faults.lazyfs")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", required=True, help=f"mount source, {SOURCE_PREFIX}...")
    args = parser.parse_args(argv)
    folder = args.folder.resolve()
    if not args.name.startswith(SOURCE_PREFIX):
        parser.error(f"--name must start with {SOURCE_PREFIX}")
    # mfusepy reports an operation's unexpected exception through logging: into our log.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s lazyfs %(levelname)s %(message)s")
    try:
        import mfusepy
    except (ImportError, OSError) as exc:  # OSError: libfuse3 itself is missing
        print(f"unavailable: {exc}; pip install mfusepy and apt-get install fuse3", flush=True)
        return 2

    below = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # the folder under the mount
    tree = LazyTree(Path(f"/proc/self/fd/{below}"))

    def announce() -> None:
        print("mounted", flush=True)

    ops = LazyOperations(tree, announce)
    _serve_commands(ops, args.name)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "mount":
        return 0  # the harness went away before it needed us

    def unmount_when_orphaned() -> None:
        sys.stdin.read()  # returns at EOF: the harness closed the pipe or died
        with contextlib.suppress(Exception):
            unmount(folder, args.name)

    threading.Thread(target=unmount_when_orphaned, name="lazyfs-stdin", daemon=True).start()

    class Fuse(mfusepy.FUSE):  # type: ignore[misc]
        """mfusepy drops the flags of rename(2) and the handle of ftruncate(2)."""

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            return int(ops.rename(os.fsdecode(old), os.fsdecode(new), flags))

        def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
            fh = fip.contents.fh if fip else None
            return int(ops.truncate(None if path is None else os.fsdecode(path), length, fh))

    # Several threads, so that an operation held for the harness (`hold`) does not stop the
    # others; the one lock still serves them one at a time. No kernel caching of names or
    # attributes (every lookup asks us): after a loss, a lost name must be gone at once,
    # not after a timeout.
    Fuse(ops, str(folder), foreground=True, nothreads=False, fsname=args.name,
         subtype="aftershock-lazyfs", entry_timeout=0, attr_timeout=0, negative_timeout=0,
         hard_remove=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
