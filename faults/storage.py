"""Storage faults on real files: corrupt, truncate or delete a checkpoint; a full disk.

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
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from faults._errors import FaultUnavailable
from faults._proc import ProcessRef
from faults.journal import NAME_PREFIX, Journal, UndoContext, UndoRefused, private_dir, state_dir
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


CORRUPT = register(Corrupt())
TRUNCATE = register(Truncate())
DELETE = register(Delete())
FULL = register(Full())
