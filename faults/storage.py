"""Storage faults on real files: corrupt, truncate or delete a checkpoint; a full disk; a
power loss that takes every write not yet made durable (``storage.lose_unsynced``).

Files are named by ``path``, a glob relative to ``root`` (the harness passes the folder
the system works in: a command's working folder, the trainer's checkpoint folder); when
several match, the newest (by mtime) is hit, which is what "the latest checkpoint" means
to a resuming trainer. The harness also passes ``guarded``: its own records (timeline,
logs, result, heal journal, cache). A fault whose file or folder is one of them, lies
under one or holds one, links followed, is refused (:class:`HarnessRecord`); a fault that
finds nothing to change fails (:class:`NothingToActOn`): neither counts as injected.

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
import stat
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import Field, field_validator

from aftershock.faults import _openat, lazyfs
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import (
    NAME_PREFIX,
    Journal,
    UndoContext,
    UndoRefused,
    private_dir,
    state_dir,
    undone_on_error,
)
from aftershock.faults.params import MAX_INDEX, MAX_SEED, Duration, FaultParams, relative_glob
from aftershock.faults.registry import Acts, Applied, KindInfo, Setting, register

_ROOT = ("folder the path is relative to; default: a command's working folder (its `cwd`, "
         "else ${run_dir}/work), the reference trainer's checkpoint folder, else the run "
         "folder; ${run_dir} is expanded; never the harness's own records")


class NothingToActOn(FileNotFoundError):
    """The fault found nothing to act on (no file matched its glob, or the file it matched
    leaves nothing to change): it was not applied, and says what it looked for."""


class HarnessRecord(PermissionError):
    """The fault would touch one of the harness's own records: refused, nothing changed."""


class _OnFiles(FaultParams):
    root: str | None = Field(None, description=_ROOT)
    restore: bool = Field(False, description="copy the original aside and put it back on "
                          "revert")


class DamageParams(_OnFiles):
    path: str = Field(description="glob under root, e.g. 'ckpt/*.pt' or '**/step_*'; the "
                      "newest match is hit")
    offset: int | None = Field(None, ge=0, le=MAX_INDEX,
                               description="corrupt: first byte; default: seeded positions")
    bytes: int = Field(16, ge=1, le=2**30, description="corrupt: how many bytes")
    size: int | None = Field(None, ge=0, le=MAX_INDEX,
                             description="truncate: new length in bytes; default: half")
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="corrupt: seed for the positions and values")


class FullParams(_OnFiles):
    dir: str = Field(".", description="the folder that fills up, under root")
    free: int = Field(0, ge=0, le=MAX_INDEX, description="bytes of room left before ENOSPC")
    write_back: bool = Field(True, description="on revert, make the folder hold what was "
                             "written to it during the fault (new, changed, deleted files)")
    duration: Duration | None = Field(None, description="heal after this long; default: at "
                                      "the end of the run")


class LoseUnsyncedParams(FaultParams):
    root: str | None = Field(None, description=_ROOT.replace("the path is", "`dir` is"))
    dir: str = Field(".", description="the folder the system writes its checkpoints to, "
                     "under root; the lazy filesystem is mounted on it before the system "
                     "starts")

    @field_validator("dir")
    @classmethod
    def _under_root(cls, value: str) -> str:
        return relative_glob(value, "dir")


class _Storage:
    """What the storage kinds share: they act on files, from outside, and hit no rank."""

    acts: Acts = "outside"
    needs = frozenset({"files"})
    default_target: Mapping[str, Any] = {"role": "launcher"}
    target_help = "storage faults act on files, not a rank"


def _records(params: Mapping[str, Any]) -> list[tuple[Path, tuple[int, int] | None]]:
    """The harness's records the fault must not touch (``guarded``), resolved, with the
    inode of each that is a file (a hard link to it is it)."""
    found: list[tuple[Path, tuple[int, int] | None]] = []
    for given in params.get("guarded") or ():
        record = Path(str(given)).resolve()
        try:
            st = record.stat()
        except OSError:
            found.append((record, None))
            continue
        found.append((record, None if stat.S_ISDIR(st.st_mode) else (st.st_dev, st.st_ino)))
    return found


def _guard(path: Path, records: Sequence[tuple[Path, tuple[int, int] | None]], *,
           whole: bool) -> None:
    """Refuse ``path`` if it is one of ``records``, lies under one, or (``whole``: a folder
    the fault acts on as a whole) holds one: as named, as its links resolve, and by inode."""
    if not records:
        return
    seen = {path.absolute(), path.resolve()}
    try:
        st = path.stat()
        inode: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        inode = None
    for record, record_inode in records:
        if inode is not None and inode == record_inode:
            raise HarnessRecord(f"{path} is a link to {record}, one of the harness's own "
                                "records (timeline, logs, result, heal journal, cache): refused")
        for candidate in seen:
            if candidate == record:
                how = "is"
            elif candidate.is_relative_to(record):
                how = "lies under"
            elif whole and record.is_relative_to(candidate):
                how = "holds"
            else:
                continue
            raise HarnessRecord(f"{path} {how} {record}, one of the harness's own records "
                                "(timeline, logs, result, heal journal, cache): refused")


def _pick(params: Mapping[str, Any], *, dirs: bool) -> Path:
    root = Path(str(params["root"])).resolve()
    pattern = str(params["path"])
    found = [p for p in root.glob(pattern) if p.is_file() or (dirs and p.is_dir())]
    # Every match, not only the one hit: a glob that reaches a record is aimed wrong.
    records = _records(params)
    for p in found:
        _guard(p, records, whole=p.is_dir() and not p.is_symlink())
    matches = [p for p in found if p.resolve().is_relative_to(root)]
    if not matches:
        raise NothingToActOn(
            f"no {'file or folder' if dirs else 'file'} matches {pattern!r} under {root}"
            + (f" (only links out of it: {', '.join(str(p) for p in found[:3])}"
               f"{', ...' if len(found) > 3 else ''})" if found else "")
        )
    return max(matches, key=lambda p: (p.stat().st_mtime_ns, str(p)))


def _listing(folder: Path, limit: int = 20) -> str:
    """The files under ``folder``, by their names relative to it (the first ``limit``)."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more"
                                       if len(names) > limit else "")
    return f"{len(names)} file{'s' if len(names) != 1 else ''}" + (f": {shown}" if names else "")


def _backup(path: Path, root: Path, journal: Journal, kind: str, *, stays: bool
            ) -> tuple[str, dict[str, Any]]:
    """Copy ``path`` aside, journaled first, so revert can put it back.

    The record also holds what a heal checks before it writes (faults/_openat.py): ``root``
    and the identity (device, inode) of each folder from it down to the file's
    (``chain``), and of the file as the fault leaves it (``file``; None when the fault
    removes it, ``stays`` false)."""
    where = Path(os.path.realpath(path.parent))
    if not where.is_relative_to(root):
        raise NothingToActOn(f"{path} is in {where}, outside {root}: it could not be "
                             "restored safely")
    below = where.relative_to(root).parts
    folders = [root.joinpath(*below[:depth]) for depth in range(len(below) + 1)]
    real = where / path.name
    backup = state_dir() / "backup" / uuid.uuid4().hex[:12] / path.name
    undo = {
        "path": str(real),
        "backup": str(backup),
        "root": str(root),
        "chain": [list(_openat.identity(os.lstat(f))) for f in folders],
        "file": _leaf(os.lstat(real)) if stays else None,
    }
    entry = journal.intend(kind, undo)
    private_dir(backup.parent)
    if path.is_dir():
        shutil.copytree(path, backup, symlinks=True)
    else:
        shutil.copy2(path, backup)
    return entry, undo


def _maybe_backup(
    path: Path, params: Mapping[str, Any], journal: Journal, kind: str, *, stays: bool = True
) -> tuple[str | None, dict[str, Any]]:
    if params.get("restore", _OnFiles.default("restore")):
        root = Path(str(params["root"])).resolve()
        return _backup(path, root, journal, kind, stays=stays)
    return None, {}


def _restore(undo: Mapping[str, Any]) -> None:
    """Put the original back, through the very folders the fault acted in: reached from
    ``/`` with no link followed and checked by identity (faults/_openat.py). Anything
    changed since (the run folder moved, deleted or swapped for a link, a folder on the way
    replaced, the file replaced) is refused, named, and the backup kept for the user."""
    backup = Path(str(undo["backup"]))
    if not backup.exists():
        return  # restored already (or never copied, or put back by hand)
    path = Path(str(undo["path"]))
    chain = [_openat.identity_of(i) for i in undo["chain"]]
    try:
        with _openat.folder(path.parent, chain) as parent:
            _check_leaf(parent, path, undo.get("file"))
            _put_back(backup, parent, path.name)
    except UndoRefused as exc:
        raise UndoRefused(
            f"{exc}: nothing was restored. The original is kept in {backup}; copy it back "
            f"by hand if you still want it, then delete {backup.parent} and run "
            "`aftershock heal` again to close this entry") from None
    shutil.rmtree(backup.parent)


def _leaf(st: os.stat_result) -> list[int]:
    """A file's device, inode and type: a link made where a file was deleted often gets
    the freed inode number, so the number alone does not tell them apart."""
    return [st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)]


def _check_leaf(parent: int, path: Path, left: object) -> None:
    """The name is free, or holds what the fault left there (``left``, from ``_leaf``)."""
    try:
        st = os.lstat(path.name, dir_fd=parent)
    except FileNotFoundError:
        return  # nothing there to overwrite
    if left is not None and _leaf(st) == left:
        return
    now = _openat.describe(parent, path.name)
    if left is None:
        raise UndoRefused(f"{path}, deleted by the fault, is {now} again, made after it")
    raise UndoRefused(f"{path} is now {now}, not the file the fault changed (replaced "
                      "after it)")


def _put_back(backup: Path, parent: int, name: str) -> None:
    """Copy ``backup`` to a staged name in ``parent``, then rename it over ``name``: atomic,
    a reader never sees half a restore, and nothing is opened through a link there."""
    staged = f".{name}.aftershock-restore"
    with contextlib.suppress(FileNotFoundError):  # left by a heal that was killed
        if stat.S_ISDIR(os.lstat(staged, dir_fd=parent).st_mode):
            shutil.rmtree(staged, dir_fd=parent)
        else:
            os.unlink(staged, dir_fd=parent)
    if backup.is_dir():
        shutil.copytree(backup, _openat.proc_path(parent, staged), symlinks=True)
    else:
        st = os.stat(backup)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            with open(backup, "rb") as source, os.fdopen(fd, "wb", closefd=False) as out:
                shutil.copyfileobj(source, out)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.fsync(fd)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)
    os.replace(staged, name, src_dir_fd=parent, dst_dir_fd=parent)


def _validate_restore(undo: Mapping[str, Any], context: UndoContext) -> None:
    """A file of the run, its copy in <state>/backup/<token>/ under the same name, and the
    identities a heal checks before it writes (``_restore``)."""
    if not undo:
        return  # not restorable: nothing is done on revert
    path = context.inside(undo.get("path"))
    parts = context.state_path(undo.get("backup"), "backup")
    if parts[1:] != (path.name,):
        raise UndoRefused(f"backup {undo.get('backup')} is not a copy of {path.name}")
    root, chain = undo.get("root"), undo.get("chain")
    if root is None or chain is None:
        raise UndoRefused(f"{path}: recorded without the identity of its folders (by an "
                          f"older Aftershock), so it cannot be restored safely; the original "
                          f"is kept in {undo.get('backup')}")
    root = context.inside(root)
    if path.parent != root and not path.parent.is_relative_to(root):
        raise UndoRefused(f"{path} is not under the fault's root {root}")
    depth = len(path.parent.relative_to(root).parts) + 1
    if not (isinstance(chain, list) and len(chain) == depth
            and all(_openat.identity_of(i) is not None for i in chain)):
        raise UndoRefused(f"chain {chain!r} is not the identities of the {depth} folder(s) "
                          f"from {root} down to {path.parent}")
    left = undo.get("file")
    if left is not None and not _is_identity(left):
        raise UndoRefused(f"file {left!r} is not a device, inode and type")


def _is_identity(value: Any) -> bool:
    """Whether ``value`` is a recorded file identity: device, inode and type, as ints."""
    return isinstance(value, list) and len(value) == 3 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _keep_times(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_atime_ns, st.st_mtime_ns


class Corrupt(_Storage):
    params = DamageParams
    info = KindInfo(
        kind="storage.corrupt",
        summary="Overwrite bytes of a file in place: silent data corruption (bit rot, a bad DMA).",
        caused_by="pwrite(2) of XOR-ed bytes into the file, at `offset` or at seeded random "
        "positions; size and mtime are kept, so only a checksum can tell.",
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def aim(self) -> tuple[str, bool]:
        return "path", False

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=False)
        size = path.stat().st_size
        p = DamageParams.bind(params)
        if size == 0:
            raise NothingToActOn(f"{path} is empty: no byte to corrupt")
        if p.offset is not None and p.offset >= size:
            raise NothingToActOn(f"offset {p.offset} is past the end of {path} ({size} bytes)")
        entry, undo = _maybe_backup(path, params, journal, self.info.kind)
        count = p.bytes
        rng = random.Random(p.seed)
        if p.offset is not None:
            start = p.offset
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


class Truncate(_Storage):
    params = DamageParams
    info = KindInfo(
        kind="storage.truncate",
        summary="Cut a file short: a torn write, as after a crash during save.",
        caused_by="truncate(2) of the file to `size` bytes; mtime is kept.",
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def aim(self) -> tuple[str, bool]:
        return "path", False

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=False)
        old = path.stat().st_size
        wanted = DamageParams.bind(params).size
        new = old // 2 if wanted is None else wanted
        if new >= old:
            raise NothingToActOn(f"{path} is already {old} bytes: truncating it to "
                                 f"{'half' if wanted is None else new} cuts nothing")
        entry, undo = _maybe_backup(path, params, journal, self.info.kind)
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


class Delete(_Storage):
    params = DamageParams
    info = KindInfo(
        kind="storage.delete",
        summary="Delete a file or folder (a lost checkpoint).",
        caused_by="unlink(2), or a recursive delete for a folder (sharded checkpoints).",
        reverted_by="not reverted (the system must cope), unless restore: true",
    )

    def aim(self) -> tuple[str, bool]:
        return "path", True

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        path = _pick(params, dirs=True)
        folder = path.is_dir() and not path.is_symlink()
        # What went with it: a sharded checkpoint's folder is many files.
        detail = f"deleted {path}" + (f" ({_listing(path)})" if folder else "")
        entry, undo = _maybe_backup(path, params, journal, self.info.kind, stays=False)
        if folder:
            shutil.rmtree(path)
        else:
            path.unlink()
        return Applied(self.info.kind, entry, undo, detail)

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


def _ours(source: str) -> list[_openat.Mount]:
    """The tmpfs mounts named ``source``, wherever they are now (a run folder moved since
    the fault takes its mount with it), the topmost first."""
    return [m for m in reversed(_openat.mounts()) if m.source == source and m.fstype == "tmpfs"]


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
    """Make ``dest`` hold exactly what ``source`` holds. Whatever in ``dest`` is not a
    folder in both goes first, so no file is written through a link left in ``dest``."""
    keep = set(os.listdir(source))
    for name in os.listdir(dest):
        victim, origin = dest / name, source / name
        if name in keep and _real_dir(origin) and _real_dir(victim):
            _mirror(origin, victim)
        elif _real_dir(victim):
            shutil.rmtree(victim)
        else:
            victim.unlink()
    for name in keep:
        origin, copy = source / name, dest / name
        if os.path.lexists(copy):
            continue  # a folder in both: mirrored above
        if _real_dir(origin):
            shutil.copytree(origin, copy, symlinks=True)
        else:
            shutil.copy2(origin, copy, follow_symlinks=False)


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


class Full(_Storage):
    params = FullParams
    info = KindInfo(
        kind="storage.full",
        summary="The disk under a folder fills up: writes fail with ENOSPC.",
        caused_by="A tmpfs of just the right size (`mount -t tmpfs -o size=...`) mounted over "
        "the folder, holding a copy of its current files plus `free` bytes of room (rounded "
        "up to whole pages). Files opened before the mount keep writing to the disk below.",
        reverted_by="copy the tmpfs contents aside (write_back), unmount (lazily if busy), then "
        "mirror the copy into the folder; the mount never outlives the heal.",
    )

    def aim(self) -> tuple[str, bool]:
        return "dir", True

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        mount = _tool("mount")
        p = FullParams.bind(params)
        root = Path(str(params["root"])).resolve()
        folder = (root / p.dir).resolve()
        if not folder.is_relative_to(root):
            raise ValueError(f"dir {p.dir!r} is outside root {root}")
        # A mount over a record would hide it, and its stale copy come back on revert.
        _guard(folder, _records(params), whole=True)
        folder.mkdir(parents=True, exist_ok=True)
        page = os.sysconf("SC_PAGE_SIZE")
        free = p.free
        # size=0 would mean "unlimited" to tmpfs, so at least one page.
        size = max(page, _footprint(folder, page) + -(-free // page) * page)
        token = uuid.uuid4().hex[:12]
        source = f"aftershock_{token}"
        below = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # still sees the disk after
        st = os.fstat(below)
        undo = {
            "dir": str(folder),
            "source": source,
            "stash": str(state_dir() / "storage" / token),
            "write_back": p.write_back,
            # The folder under the mount: a heal mirrors the stash only into this very
            # folder, wherever it has moved (the mount itself is found by its source).
            "below": list(_openat.identity(st)),
        }
        try:
            entry = journal.intend(self.info.kind, undo)
        except BaseException:
            os.close(below)
            raise
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
        """Unmount the tmpfs where it is now, found by its source name in mountinfo, not by
        the recorded path (the run folder may have moved), reached without following a link
        and checked to be that mount (its device); then mirror what was written on it into
        the folder below, if that is still the folder the fault mounted over."""
        source, stash = str(undo["source"]), Path(str(undo["stash"]))
        folder = Path(str(undo["dir"]))
        for _ in range(16):  # a mount propagated to peers may need one detach each
            found = _ours(source)
            if not found:
                break
            folder = found[0].point
            self._detach(found[0], stash, bool(undo.get("write_back", True)))
        else:
            raise RuntimeError(f"the tmpfs {source} is still mounted on {folder} after 16 "
                               f"unmounts: unmount it yourself (umount -l {folder})")
        if not stash.exists():
            return
        below = _openat.identity_of(undo.get("below"))
        try:
            with _openat.folder(folder, [below]) as fd:
                _mirror(stash, _openat.proc_path(fd))
        except UndoRefused as exc:
            raise UndoRefused(
                f"{exc}: the tmpfs is unmounted, but what was written on it during the fault "
                f"is kept in {stash} and was not copied back; copy what you want of it by "
                f"hand, then delete {stash} and run `aftershock heal` again to close this "
                "entry") from None
        shutil.rmtree(stash)

    @staticmethod
    def _detach(mount: _openat.Mount, stash: Path, write_back: bool) -> None:
        point = mount.point
        try:
            with _openat.folder(point) as fd:
                if os.fstat(fd).st_dev != mount.dev:
                    raise UndoRefused(f"{point} is not the root of the tmpfs {mount.source} "
                                      "(changed while it was looked at)")
                if write_back:
                    staging = stash.with_name(stash.name + ".tmp")
                    shutil.rmtree(staging, ignore_errors=True)
                    private_dir(staging.parent)
                    shutil.copytree(_openat.proc_path(fd), staging, symlinks=True)
                    shutil.rmtree(stash, ignore_errors=True)
                    staging.rename(stash)  # whole, or not at all: a half copy is never mirrored
                # Detached through the descriptor (it would keep a plain unmount busy
                # anyway): the kernel frees the tmpfs once the last file on it is closed.
                _openat.detach(fd)
        except (UndoRefused, OSError) as exc:
            raise RuntimeError(
                f"the tmpfs {mount.source} is still mounted on {point} (mount id {mount.id}) "
                f"and was left there: {exc}. Unmount it yourself (umount -l {point}), then "
                "run `aftershock heal` again") from None
        if any(m.id == mount.id for m in _openat.mounts()):
            raise RuntimeError(f"could not unmount the tmpfs {mount.source} on {point} "
                               f"(mount id {mount.id}): unmount it yourself (umount -l "
                               f"{point}), then run `aftershock heal` again")

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        """The run's folder, a tmpfs named by the engine, its stash in the state folder."""
        context.inside(undo.get("dir"))
        if undo.get("below") is not None and _openat.identity_of(undo["below"]) is None:
            raise UndoRefused(f"below {undo['below']!r} is not a device and inode")
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
    return ref.alive() and b"aftershock.faults.lazyfs" in cmdline and name.encode() in cmdline


#: docs/faults.md, under the kind (Markdown).
_POWER_LOSS = """\
A filesystem the harness controls sits under the system's checkpoint folder
from launch on (`faults/lazyfs.py`, after Jepsen's lazyfs: Python over
libfuse3, the project's `fuse` extra). At the fault every write that was not
made durable is lost and the targets (default `pick: all`, every rank) are
SIGKILLed at the same instant; the launcher lives on and restarts them, as a
job's supervisor would after a node lost power. "Durable" is the weakest
promise POSIX makes, so a writer that passes here is durable on any POSIX
filesystem:

- file data (`write`, `truncate`) once `fsync`/`fdatasync` of that file
  returns (`O_SYNC` writes included); `close` makes nothing durable;
- a name (create, `mkdir`, `symlink`, `rename`, `unlink`, `rmdir`) once
  `fsync` of *its folder* returns; a new folder's own name needs its parent's
  fsync, and a rename between folders both;
- after the loss every file is as of its last fsync (empty if it never had
  one) and every folder holds its entries as of its last fsync: a file whose
  data was fsynced but whose name was not is gone; a name fsynced over data
  that was not is an empty file.

Real filesystems often keep more (ext4 commits a new file's name with the
file's fsync), never less. Not modeled: `sync(2)`/`syncfs(2)` (FUSE does not
pass them on), hard links (EPERM), special files, and attributes (mode,
owner and times are never lost). Between the loss and the targets' death the
filesystem answers every request with EIO, so no write still in flight lands
after the power went. The durable state is kept in the folder under the mount
(opened before mounting): once the run ends and the mount is gone, the folder
holds what survived. The rest is held in memory: meant for a test run's
checkpoints, not terabytes.

The mount and its server are journaled before they are made (mount point,
the mount's source name `aftershock_lazyfs_<id>`, the server's pid and start
time) and undone when the run ends, by the reaper, or by `aftershock heal`
(`fusermount3 -u`, lazily if busy); the server also unmounts itself if the
harness that started it dies. Only one `storage.lose_unsynced` per scenario
(one filesystem); repeat it with `every`. On a command `dir` is under the
job's working folder (`${run_dir}/work` unless `cwd` says otherwise); a
command that works in the run folder itself must name its checkpoint folder
with `dir`: the run folder holds the timeline.
Pair it with `expect.checkpoint_durable`
([metrics.md](metrics.md#checks)): `params_match` cannot see a lost
checkpoint, since a deterministic trainer that starts over ends bitwise equal.
"""


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

    params = LoseUnsyncedParams
    acts: Acts = "outside"
    needs = frozenset({"files", "signals"})
    default_target: Mapping[str, Any] = {"pick": "all"}
    target_help = ("the processes that die with the power; default every rank (the "
                   "launcher lives on to restart them, as a job's supervisor would)")
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
        reverted_by="the loss stays (it is the point); when the run ends the filesystem is "
        "unmounted (fusermount3 -u, lazily if busy) and its server stopped, and the folder "
        "holds what survived.",
        details=_POWER_LOSS,
    )

    def aim(self) -> tuple[str, bool]:
        return "dir", True

    def check(self, faults: Sequence[Any], setting: Setting) -> list[str]:
        if len(faults) > 1:
            return ["at most one storage.lose_unsynced fault per scenario (one lazy "
                    "filesystem); repeat it with `every`"]
        fault = faults[0]
        if setting.root_is_run_folder and fault.root is None \
                and PurePosixPath(fault.dir).parts in ((), (".",)):
            return [f"storage.lose_unsynced on a {setting.system} needs `dir` (or `root`): the "
                    "folder the job writes its checkpoints to, not the whole run folder "
                    "(which holds the timeline)"]
        return []

    def __init__(self) -> None:
        self._servers: dict[str, subprocess.Popen[bytes]] = {}  # source -> our child

    def prepare(self, params: Mapping[str, Any], journal: Journal) -> Applied:
        root = Path(str(params["root"])).resolve()
        # The engine's own bound first: a folder outside root is refused as such.
        folder = _under(root, str(params.get("dir", LoseUnsyncedParams.default("dir"))))
        _guard(folder, _records(params), whole=True)
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


def sync_history(applied: Applied, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The fsyncs of the file at ``path`` where ``applied`` (a prepared
    ``storage.lose_unsynced``) has it on its lazy filesystem: ``{"syncs": [[monotonic time
    the fsync returned, size it made durable], ...], "complete": bool}`` (``complete``
    false: the oldest were dropped); None where ``path`` is not under it or the filesystem
    no longer answers."""
    if applied.kind != LoseUnsynced.info.kind or "source" not in applied.undo:
        return None
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(str(applied.undo["mount"])))
    if rel == os.curdir or rel.startswith(os.pardir):
        return None
    try:
        answer = lazyfs.command(str(applied.undo["source"]), f"syncs {rel}")
    except (ConnectionError, RuntimeError, OSError, ValueError):
        return None
    syncs = answer.get("syncs")
    if not isinstance(syncs, list):
        return None
    return {"syncs": syncs, "complete": bool(answer.get("complete"))}


CORRUPT = register(Corrupt())
TRUNCATE = register(Truncate())
DELETE = register(Delete())
FULL = register(Full())
LOSE_UNSYNCED = register(LoseUnsynced())
