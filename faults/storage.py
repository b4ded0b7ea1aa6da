"""Storage faults on real files: corrupt, truncate or delete a checkpoint; a full disk; a
power loss that takes every write not yet made durable (``storage.lose_unsynced``).

Files are named by ``path``, a glob relative to ``root`` (the harness passes the
run's folder as ``root``); when several match, the newest (by mtime) is hit,
which is what "the latest checkpoint" means to a resuming trainer.

Corrupt, truncate and delete are the damage a system must cope with, so by
default they are not undone; with ``restore: true`` the original is copied to
the state folder first and put back on revert. ``storage.full`` is a real
ENOSPC: a size-limited tmpfs mounted over the folder, always unmounted on revert.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from faults import lazyfs
from faults._errors import FaultUnavailable
from faults._proc import ProcessRef
from faults.journal import (
    NAME_PREFIX,
    Journal,
    UndoContext,
    UndoRefused,
    private_dir,
    state_dir,
    undone_on_error,
)
from faults.registry import Applied, KindInfo, register

_PICK = {
    "root": "folder the glob is relative to (the harness passes the run's folder)",
    "path": "glob relative to root, e.g. 'ckpt/*.pt' or '**/step_*'; the newest match is hit",
    "restore": "copy the original aside and put it back on revert; default false",
}


def _pick(params: Mapping[str, Any], *, dirs: bool) -> Path:
    root = Path(str(params["root"])).resolve()
    pattern = str(params["path"])
    matches = [
        p
        for p in root.glob(pattern)
        if (p.is_file() or (dirs and p.is_dir())) and p.resolve().is_relative_to(root)
    ]
    if not matches:
        raise FileNotFoundError(
            f"no {'file or folder' if dirs else 'file'} matches {pattern!r} under {root}"
        )
    return max(matches, key=lambda p: (p.stat().st_mtime_ns, str(p)))


def _backup(path: Path, journal: Journal, kind: str) -> tuple[str, dict[str, Any]]:
    """Copy ``path`` aside, journaled first, so revert can put it back."""
    backup = state_dir() / "backup" / uuid.uuid4().hex[:12] / path.name
    undo = {"path": str(path), "backup": str(backup)}
    entry = journal.intend(kind, undo)
    private_dir(backup.parent)
    if path.is_dir():
        shutil.copytree(path, backup, symlinks=True)
    else:
        shutil.copy2(path, backup)
    return entry, undo


def _maybe_backup(
    path: Path, params: Mapping[str, Any], journal: Journal, kind: str
) -> tuple[str | None, dict[str, Any]]:
    if params.get("restore", False):
        return _backup(path, journal, kind)
    return None, {}


def _restore(undo: Mapping[str, Any]) -> None:
    backup = Path(str(undo["backup"]))
    if not backup.exists():
        return  # restored already (or never copied: the fault was not applied)
    path = Path(str(undo["path"]))
    if backup.is_dir():
        if path.exists():
            shutil.rmtree(path)
        shutil.copytree(backup, path, symlinks=True)
    else:
        staged = path.with_name(f".{path.name}.aftershock-restore")
        shutil.copy2(backup, staged)
        os.replace(staged, path)  # atomic: a reader never sees half a restore
    shutil.rmtree(backup.parent)


def _validate_restore(undo: Mapping[str, Any], context: UndoContext) -> None:
    """A file of the run, and its copy in <state>/backup/<token>/ under the same name."""
    if not undo:
        return  # not restorable: nothing is done on revert
    path = context.path(undo.get("path"))
    parts = context.state_path(undo.get("backup"), "backup")
    if parts[1:] != (path.name,):
        raise UndoRefused(f"backup {undo.get('backup')} is not a copy of {path.name}")


def _keep_times(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_atime_ns, st.st_mtime_ns


class Corrupt:
    info = KindInfo(
        kind="storage.corrupt",
        summary="Overwrite bytes of a file in place: silent data corruption (bit rot, a bad DMA).",
        caused_by="pwrite(2) of XOR-ed bytes into the file, at `offset` or at seeded random "
        "positions; size and mtime are kept, so only a checksum can tell.",
        params={
            **_PICK,
            "offset": "first byte to corrupt; default: seeded random positions",
            "bytes": "how many bytes to corrupt; default 16",
            "seed": "seed for the random positions and values; default 0",
        },
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=False)
        entry, undo = _maybe_backup(path, params, journal, self.info.kind)
        size = path.stat().st_size
        count = int(params.get("bytes", 16))
        rng = random.Random(int(params.get("seed", 0)))
        if params.get("offset") is not None:
            start = int(params["offset"])
            positions = list(range(start, min(start + count, size)))
            masks = [0xFF] * len(positions)
        else:
            positions = sorted(rng.sample(range(size), min(count, size)))
            masks = [rng.randint(1, 255) for _ in positions]  # nonzero: every byte changes
        times = _keep_times(path)
        fd = os.open(path, os.O_RDWR)
        try:
            for pos, mask in zip(positions, masks, strict=True):
                old = os.pread(fd, 1, pos)
                os.pwrite(fd, bytes([old[0] ^ mask]), pos)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.utime(path, ns=times)
        detail = f"corrupted {len(positions)} bytes of {path}"
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        if undo:
            _restore(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate_restore(undo, context)


class Truncate:
    info = KindInfo(
        kind="storage.truncate",
        summary="Cut a file short: a torn write, as after a crash during save.",
        caused_by="truncate(2) of the file to `size` bytes; mtime is kept.",
        params={**_PICK, "size": "new length in bytes; default half the current length"},
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=False)
        entry, undo = _maybe_backup(path, params, journal, self.info.kind)
        old = path.stat().st_size
        new = int(params["size"]) if params.get("size") is not None else old // 2
        times = _keep_times(path)
        os.truncate(path, min(new, old))
        os.utime(path, ns=times)
        detail = f"truncated {path} from {old} to {min(new, old)} bytes"
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        if undo:
            _restore(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate_restore(undo, context)


class Delete:
    info = KindInfo(
        kind="storage.delete",
        summary="Delete a file or folder (a lost checkpoint).",
        caused_by="unlink(2), or a recursive delete for a folder (sharded checkpoints).",
        params=dict(_PICK),
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=True)
        entry, undo = _maybe_backup(path, params, journal, self.info.kind)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        return Applied(self.info.kind, entry, undo, f"deleted {path}")

    def revert(self, undo: Mapping[str, Any]) -> None:
        if undo:
            _restore(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate_restore(undo, context)


def _tool(name: str) -> str:
    candidates = (shutil.which(name), f"/usr/bin/{name}", f"/bin/{name}")
    found = next((p for p in candidates if p and os.access(p, os.X_OK)), None)
    if found is None:
        raise FaultUnavailable(f"{name} not installed: apt-get install mount")
    return found


def _top_mount(folder: Path) -> str | None:
    """The source name of the last (topmost) mount on ``folder``, if any."""
    top = None
    with open("/proc/self/mounts") as handle:
        for line in handle:
            cols = line.split()
            if len(cols) > 1 and cols[1].replace("\\040", " ") == str(folder):
                top = cols[0]
    return top


def _footprint(folder: Path, page: int) -> int:
    """Bytes the folder's files take on tmpfs (whole pages per file)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                total += -(-st.st_size // page) * page
    return total


def _mirror(source: Path, dest: Path) -> None:
    """Make ``dest`` hold exactly what ``source`` holds."""
    keep = set(os.listdir(source))
    for name in os.listdir(dest):
        if name not in keep:
            victim = dest / name
            if victim.is_dir() and not victim.is_symlink():
                shutil.rmtree(victim)
            else:
                victim.unlink()
    shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)


class Full:
    info = KindInfo(
        kind="storage.full",
        summary="The disk under a folder fills up: writes fail with ENOSPC.",
        caused_by="A tmpfs of just the right size (`mount -t tmpfs -o size=...`) mounted over "
        "the folder, holding a copy of its current files plus `free` bytes of room (rounded "
        "up to whole pages). Files opened before the mount keep writing to the disk below.",
        params={
            "root": "folder `dir` is relative to (the harness passes the run's folder)",
            "dir": "the folder that fills up, relative to root; default root itself",
            "free": "bytes of room left before ENOSPC; default 0",
            "write_back": "on revert, make the folder hold what was written to it during the "
            "fault (new, changed and deleted files); default true",
        },
        reverted_by="copy the tmpfs contents aside (write_back), unmount (lazily if busy), then "
        "mirror the copy into the folder; the mount never outlives the heal.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        mount, umount = _tool("mount"), _tool("umount")
        del umount  # checked now: a revert without it could not unmount
        root = Path(str(params["root"])).resolve()
        folder = (root / str(params.get("dir", "."))).resolve()
        if not folder.is_relative_to(root):
            raise ValueError(f"dir {params.get('dir')!r} is outside root {root}")
        folder.mkdir(parents=True, exist_ok=True)
        page = os.sysconf("SC_PAGE_SIZE")
        free = int(params.get("free", 0))
        # size=0 would mean "unlimited" to tmpfs, so at least one page.
        size = max(page, _footprint(folder, page) + -(-free // page) * page)
        token = uuid.uuid4().hex[:12]
        source = f"aftershock_{token}"
        st = folder.stat()
        undo = {
            "dir": str(folder),
            "source": source,
            "stash": str(state_dir() / "storage" / token),
            "write_back": bool(params.get("write_back", True)),
        }
        below = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # still sees the disk after
        entry = journal.intend(self.info.kind, undo)
        try:
            options = f"size={size},mode={st.st_mode & 0o7777:o},uid={st.st_uid},gid={st.st_gid}"
            result = subprocess.run(
                [mount, "-t", "tmpfs", "-o", options, source, str(folder)],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if result.returncode != 0:
                raise FaultUnavailable(f"mount tmpfs on {folder}: {result.stderr.strip()}")
            shutil.copytree(f"/proc/self/fd/{below}", folder, symlinks=True, dirs_exist_ok=True)
        except BaseException:
            try:
                self.revert({**undo, "write_back": False})
            except Exception:  # left pending in the journal: heal will try again
                pass
            else:
                journal.done(entry)
            raise
        finally:
            os.close(below)
        detail = f"{folder} is full: tmpfs of {size} bytes, {free} free"
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        folder = Path(str(undo["dir"]))
        stash = Path(str(undo["stash"]))
        if _top_mount(folder) == undo["source"]:
            if undo.get("write_back", True):
                staging = stash.with_name(stash.name + ".tmp")
                shutil.rmtree(staging, ignore_errors=True)
                private_dir(staging.parent)
                shutil.copytree(folder, staging, symlinks=True)
                shutil.rmtree(stash, ignore_errors=True)
                staging.rename(stash)  # whole, or not at all: a half copy is never mirrored
            umount = _tool("umount")
            done = subprocess.run([umount, str(folder)], capture_output=True, check=False)
            if done.returncode != 0:  # busy: detach now, the kernel frees it when unused
                subprocess.run([umount, "-l", str(folder)], capture_output=True, check=False)
            if _top_mount(folder) == undo["source"]:
                raise RuntimeError(f"could not unmount the tmpfs on {folder}")
        if stash.exists():
            _mirror(stash, folder)
            shutil.rmtree(stash)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        """The run's folder, a tmpfs named by the engine, its stash in the state folder."""
        context.path(undo.get("dir"))
        source = context.name(undo.get("source"))
        if context.state_path(undo.get("stash"), "storage") != (source.removeprefix(NAME_PREFIX),):
            raise UndoRefused(f"stash {undo.get('stash')} is not the stash of {source}")
        if not isinstance(undo.get("write_back", True), bool):
            raise UndoRefused("write_back is not true or false")


def _under(root: Path, rel: str) -> Path:
    folder = (root / rel).resolve()
    if not folder.is_relative_to(root):
        raise ValueError(f"dir {rel!r} is outside root {root}")
    return folder


def _wait_gone(refs: Sequence[ProcessRef], timeout: float) -> list[ProcessRef]:
    """Wait until none of ``refs`` is alive (a zombie is dead); those still alive."""
    deadline = time.monotonic() + timeout
    alive = [r for r in refs if r.alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [r for r in alive if r.alive()]
    return alive


def _is_server(ref: ProcessRef, name: str) -> bool:
    """Is ``ref`` still the lazy filesystem server called ``name`` (pid and start time, and
    its command line)?"""
    try:
        cmdline = Path(f"/proc/{ref.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return ref.alive() and b"faults.lazyfs" in cmdline and name.encode() in cmdline


class LoseUnsynced:
    """``storage.lose_unsynced``: a power loss under a folder.

    In two parts, because the filesystem must be under the folder before the system writes
    to it. ``prepare`` (before launch) mounts the lazy filesystem (faults/lazyfs.py) over the
    folder: journaled before the server is told to mount, with what undoes it (the folder,
    the mount's source name, the server's pid and start time). The fault itself
    (``inject_group``) takes every target down with the power: the filesystem loses all
    that was not durable and fails every request while the targets are SIGKILLed (so not one
    more write lands in a world that has lost its power), then serves what survived to the
    system's restart. The loss is the point and stays; the mount goes when the run ends.
    """

    info = KindInfo(
        kind="storage.lose_unsynced",
        summary="A power loss under a folder: every write not yet made durable there is lost "
        "and the target processes die (default: every rank; the launcher restarts them).",
        caused_by="From launch on, the folder is a FUSE filesystem (faults/lazyfs.py, Python "
        "over libfuse3) that keeps the durable state in the folder below it and the rest in "
        "memory: file data until fsync/fdatasync of the file, directory entries (create, "
        "rename, unlink, mkdir) until fsync of their directory. At the fault it drops all of "
        "that at once and answers EIO until the targets are dead (SIGKILL), then serves what "
        "survived.",
        params={
            "root": "folder `dir` is relative to (the harness passes the trainer's checkpoint "
            "folder, or the run folder for a command)",
            "dir": "the folder the system keeps its checkpoints in, relative to root; the lazy "
            "filesystem is mounted on it at launch; default root itself",
        },
        reverted_by="the loss stays (it is the point); when the run ends the filesystem is "
        "unmounted (fusermount3 -u, lazily if busy) and its server stopped, and the folder "
        "holds what survived.",
    )

    def __init__(self) -> None:
        self._servers: dict[str, subprocess.Popen[bytes]] = {}  # source -> our child

    def prepare(self, params: Mapping[str, Any], journal: Journal) -> Applied:
        root = Path(str(params["root"])).resolve()
        folder = _under(root, str(params.get("dir", ".")))
        folder.mkdir(parents=True, exist_ok=True)
        name = lazyfs.SOURCE_PREFIX + uuid.uuid4().hex[:12]
        log = Path(str(params["log"])) if params.get("log") else None
        try:
            proc = lazyfs.launch(folder, name, log)
        except lazyfs.Unavailable as exc:
            raise FaultUnavailable(f"lazy filesystem on {folder}: {exc}") from None
        server = ProcessRef.of(proc.pid)
        if server is None:
            lazyfs.close(proc)
            raise FaultUnavailable(f"the lazy filesystem server for {folder} died at start")
        self._servers[name] = proc
        undo = {"mount": str(folder), "source": name, "server": server.to_json()}
        try:
            entry = journal.intend(self.info.kind, undo)
        except BaseException:
            lazyfs.close(self._servers.pop(name))  # not mounted yet: closing ends it
            raise
        with undone_on_error(journal, entry, self.revert, undo):
            try:
                lazyfs.mount_now(proc, folder, name, log)
            except lazyfs.Unavailable as exc:
                raise FaultUnavailable(f"lazy filesystem on {folder}: {exc}") from None
        return Applied(self.info.kind, entry, undo, f"{folder} is on a lazy filesystem ({name})")

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        return self.inject_group([target], params, journal)

    def inject_group(
        self, targets: Sequence[ProcessRef], params: Mapping[str, Any], journal: Journal
    ) -> Applied:
        prepared = params.get("prepared")
        if not isinstance(prepared, Mapping) or "source" not in prepared:
            raise FaultUnavailable("storage.lose_unsynced needs its filesystem, mounted before "
                                   "launch by the harness (prepare); it was not")
        name, folder = str(prepared["source"]), str(prepared["mount"])
        lost = lazyfs.command(name, "lose")  # from here on the filesystem is powered off
        try:
            killed = [ref for ref in targets if ref.signal(signal.SIGKILL)]
            # Dead before the power comes back: a write still in flight must not land.
            survivors = _wait_gone(killed, timeout=10.0)
        finally:
            lazyfs.command(name, "on")
        loss = lazyfs.Loss(int(lost["files"]), int(lost["bytes"]), int(lost["entries"]))
        pids = ", ".join(str(r.pid) for r in killed) or "none"
        detail = f"power loss on {folder}: lost {loss.describe()}; killed pid {pids}"
        if survivors:
            detail += f" (still alive after 10s: {', '.join(str(r.pid) for r in survivors)})"
        return Applied(self.info.kind, None, {}, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        folder, name = Path(str(undo["mount"])), str(undo["source"])
        if not name.startswith(lazyfs.SOURCE_PREFIX):
            raise ValueError(f"not a lazy filesystem: {name!r}")
        try:
            lazyfs.unmount(folder, name)  # the server ends by itself once unmounted
        finally:
            proc = self._servers.pop(name, None)
            if proc is not None:
                lazyfs.close(proc)
            server = ProcessRef.from_json(dict(undo["server"]))
            if _wait_gone([server], timeout=5.0) and _is_server(server, name):
                server.signal(signal.SIGKILL)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        """A mount on one of the run's folders, a source name the engine made, and a server
        named by pid and start time. The server carries no run id (the run's teardown would
        kill it before its mount is gone), so revert signals it only while its command line
        still names that source (`_is_server`)."""
        context.path(undo.get("mount"))
        source = context.name(undo.get("source"))
        if not source.startswith(lazyfs.SOURCE_PREFIX):
            raise UndoRefused(f"{source!r} is not a lazy filesystem's source name")
        server = undo.get("server")
        if not (isinstance(server, Mapping) and isinstance(server.get("pid"), int)
                and isinstance(server.get("start"), int) and server["pid"] > 1):
            raise UndoRefused(f"server {server!r} does not name a process (pid and start time)")


CORRUPT = register(Corrupt())
TRUNCATE = register(Truncate())
DELETE = register(Delete())
FULL = register(Full())
LOSE_UNSYNCED = register(LoseUnsynced())
