"""The heal journal: what the engine applied and has not yet undone, on disk.

Every fault is written here *before* it is applied (with all that is needed to
undo it), and marked reverted after it is undone. Processes the harness
launched are written here too. If the harness dies, `aftershock heal`, the next
run, or the run's reaper process reads the journal and undoes what is left.

One file per harness run under the state folder, named after the run id; its
first record names the owning harness process (so a second run never heals a
run that is still alive) and the folders the run may touch.

A heal often runs as root, so it trusts nothing it did not write (docs/security.md):
the state folders are private (0700, whatever the umask), a journal file is read
only if it is a regular file of ours in a folder no one else can write, and each
undo record is checked against what the run can be proven to have made
(:class:`UndoContext`) before anything is done with it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftershock.faults import _jsonl, contract
from aftershock.faults._proc import ProcessRef, environ, start_time

STATE_ENV = contract.STATE_ENV
# Everything a run launches carries this with the run id (the journal's file name).
RUN_ID_ENV = contract.RUN_ID_ENV
# Names the engine gives what it creates: nftables tables, cgroups, tmpfs sources.
NAME_PREFIX = "aftershock_"
# A journal is a few records per fault; anything near this is not one of ours.
MAX_JOURNAL_BYTES = 16 << 20

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_TOKEN = re.compile(r"[0-9a-f]{12}")  # uuid4().hex[:12], as the kinds name their state
_NAME = re.compile(re.escape(NAME_PREFIX) + r"[A-Za-z0-9_]{1,64}")


def state_dir() -> Path:
    """Where heal journals live: $AFTERSHOCK_STATE_DIR, else $XDG_STATE_HOME/aftershock."""
    explicit = os.environ.get(STATE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "aftershock"


def journal_dir() -> Path:
    return state_dir() / "journal"


# ------------------------------------------------------------------- trusted folders and files


class UnsafeFolder(RuntimeError):
    """A state folder someone else could write to: journals there cannot be trusted."""


class UntrustedJournal(Exception):
    """A journal file that is not a regular file of ours; ``reason`` says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class UndoRefused(Exception):
    """An undo record names something its run cannot be proven to have made."""


def others_can_write(st: os.stat_result) -> bool:
    """Whether anyone but the owner can write what ``st`` describes: everyone can, or a
    group that is not the owner's own. Group write is harmless, as Debian's OpenSSH holds
    (its user-group-modes), where the group has exactly one member, the owner: a user
    private group, which the umask 002 of most distributions relies on."""
    if st.st_mode & 0o002:
        return True
    return bool(st.st_mode & 0o020) and not _private_group(st.st_gid, st.st_uid)


def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` has one member, user ``uid``: as its primary group or its one
    listed member (a group with no member at all is a setgid program's, not a user's)."""
    import grp
    import pwd

    try:
        group = grp.getgrgid(gid)
        owner = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    primary = {user.pw_uid for user in pwd.getpwall() if user.pw_gid == gid}
    listed = set(group.gr_mem)
    if primary - {uid} or listed - {owner}:
        return False
    return bool(primary or listed)


def unsafe_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot hold trusted state, or None if it can.

    The folder must be ours and writable by no one else; each folder above it must
    belong to us or root and, if others can write it, carry the sticky bit (as /tmp
    does), so no one can rename our folder away and put theirs in its place.
    """
    me = os.geteuid()
    real = Path(os.path.realpath(folder))
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{folder}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a folder"
    if st.st_uid != me:
        return f"{real} is owned by uid {st.st_uid}, not {me}"
    if others_can_write(st):
        return (f"{real} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chmod 700 {real}, or set {STATE_ENV} to a private folder")
    for parent in real.parents:
        try:
            st = os.stat(parent)
        except OSError as exc:
            return f"{parent}: {exc.strerror}"
        if st.st_uid not in (me, 0):
            return f"{parent}, above {real}, is owned by uid {st.st_uid}"
        if others_can_write(st) and not st.st_mode & stat.S_ISVTX:
            return (f"{parent}, above {real}, is writable by others without the sticky bit "
                    f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def private_dir(folder: Path) -> Path:
    """Make ``folder`` and any missing parents with mode 0700, whatever the umask, and
    check that the result is safe to keep state in (raises :class:`UnsafeFolder`)."""
    missing: list[Path] = []
    probe = folder
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: checked below like any other
        os.chmod(path, 0o700)  # the umask may have taken bits off; never adds any
    problem = unsafe_folder(folder)
    if problem is not None:
        raise UnsafeFolder(problem)
    return folder


def open_trusted(path: Path) -> int:
    """Open a journal for reading if it is a regular file of ours that no one else can
    write; returns the descriptor. Raises :class:`UntrustedJournal` otherwise.

    O_NOFOLLOW: a link is never followed; O_NONBLOCK: a FIFO does not block the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedJournal(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            reason = "not a regular file"
        elif st.st_uid != me:
            reason = f"owned by uid {st.st_uid}, not {me}"
        elif others_can_write(st):
            reason = f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        elif st.st_nlink != 1:
            reason = f"has {st.st_nlink} hard links"
        elif st.st_size > MAX_JOURNAL_BYTES:
            reason = f"{st.st_size} bytes: too large for a journal"
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise UntrustedJournal(path, reason)


def read_fd(fd: int) -> str:
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_JOURNAL_BYTES:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:MAX_JOURNAL_BYTES].decode(errors="replace")


# ------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class Pending:
    """An applied fault (or a launched process tree) that was not undone yet."""

    id: str
    op: str  # "fault" or "launch"
    kind: str
    undo: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Contents:
    """A journal, parsed without trusting any record to be well formed."""

    owner: ProcessRef | None
    folders: tuple[Path, ...]  # what the run may touch, from the owner record
    pending: tuple[Pending, ...]
    malformed: tuple[str, ...]  # "line N: why": valid JSON that is not a journal record
    torn: tuple[int, ...]  # lines that are not JSON: a write cut short by a crash


def _owner(record: dict[str, Any]) -> tuple[ProcessRef | None, tuple[Path, ...]] | str:
    data = record.get("owner")
    owner = None
    if data is not None:
        if not (isinstance(data, dict) and _is_int(data.get("pid")) and _is_int(data.get("start"))):
            return "owner is not {pid, start}"
        owner = ProcessRef(data["pid"], data["start"])
    folders = record.get("folders", [])
    if not (isinstance(folders, list)
            and all(isinstance(f, str) and os.path.isabs(f) for f in folders)):
        return "folders is not a list of absolute paths"
    return owner, tuple(Path(f) for f in folders)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pending(op: str, record: dict[str, Any]) -> Pending | str:
    """The entry a ``fault`` or ``launch`` record opens, or what is wrong with it."""
    entry_id, kind, undo = record.get("id"), record.get("kind"), record.get("undo")
    if isinstance(entry_id, str) and entry_id and isinstance(kind, str) and kind \
            and isinstance(undo, dict):
        return Pending(entry_id, op, kind, undo)
    problems = [
        what for what, bad in (
            ("no id", not isinstance(entry_id, str) or not entry_id),
            ("no kind", not isinstance(kind, str) or not kind),
            ("undo is not an object", not isinstance(undo, dict)),
        ) if bad
    ]
    return f"{op} record with {', '.join(problems)}"


def parse(text: str) -> Contents:
    owner: ProcessRef | None = None
    folders: tuple[Path, ...] = ()
    seen_owner = False
    applied: dict[str, Pending] = {}
    malformed: list[str] = []
    torn: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn.append(number)  # a record's start is always `{`: no half record parses
            continue
        if not isinstance(record, dict):
            malformed.append(f"line {number}: not a JSON object")
            continue
        op = record.get("op")
        if op == "owner":
            found = _owner(record)
            if isinstance(found, str):
                malformed.append(f"line {number}: {found}")
            elif seen_owner:
                malformed.append(f"line {number}: a second owner record")
            else:
                owner, folders = found
                seen_owner = True
        elif op in ("fault", "launch"):
            pending = _pending(op, record)
            if isinstance(pending, str):
                malformed.append(f"line {number}: {pending}")
            else:
                applied[pending.id] = pending
        elif op == "reverted":
            entry_id = record.get("id")
            if not isinstance(entry_id, str):
                malformed.append(f"line {number}: reverted record with no id")
                continue
            applied.pop(entry_id, None)
        else:
            malformed.append(f"line {number}: unknown op {op!r}")
    return Contents(owner, folders, tuple(applied.values()), tuple(malformed), tuple(torn))


def read(path: Path) -> Contents:
    """A journal's contents; a missing file is an empty journal."""
    try:
        return parse(path.read_text(errors="replace"))
    except FileNotFoundError:
        return parse("")


def owner_of(path: Path) -> ProcessRef | None:
    return read(path).owner


def pending(path: Path) -> list[Pending]:
    return list(read(path).pending)


# ------------------------------------------------------------------------------ writing


@dataclass
class Journal:
    path: Path
    owner: ProcessRef | None = None
    _records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def create(
        cls, run_id: str, folder: Path | None = None, *, folders: Iterable[Path] = ()
    ) -> Journal:
        """A new journal for ``run_id`` (its file name; must be a plain name).

        ``folders`` are what the run may touch (its run folder, storage roots, the NVML
        simulation's folder): a heal refuses any undo path outside them.
        """
        if not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"run id {run_id!r} is not a plain name ([A-Za-z0-9_.-])")
        folder = private_dir(folder or journal_dir())
        owner = ProcessRef.of(os.getpid())
        journal = cls(path=folder / f"{run_id}.jsonl", owner=owner)
        journal._append({
            "op": "owner",
            "owner": owner.to_json() if owner else None,
            "folders": [os.path.realpath(f) for f in folders],
        })
        return journal

    @property
    def run_id(self) -> str:
        """The run this journal belongs to: a helper process a kind starts itself (not
        launched by the harness) carries ``AFTERSHOCK_RUN_ID=<run_id>`` so that a heal
        can prove it is the run's (``UndoContext.process``)."""
        return self.path.stem

    def _append(self, record: dict[str, Any]) -> None:
        record = {"t": time.time(), **record}
        line = _jsonl.encode(record)
        fd = os.open(self.path,
                     os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # A harness killed mid-write leaves half a line: end it first, or this record
            # would be glued onto it and lost (an entry pending for ever).
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
            # fsync: the point of this file is to survive the harness being killed.
            os.fsync(fd)
        finally:
            os.close(fd)

    def intend(self, kind: str, undo: dict[str, Any], op: str = "fault") -> str:
        """Record a fault about to be applied; returns its id for `done`."""
        entry_id = uuid.uuid4().hex[:12]
        self._append({"op": op, "id": entry_id, "kind": kind, "undo": undo})
        return entry_id

    def done(self, entry_id: str) -> None:
        self._append({"op": "reverted", "id": entry_id})

    def close(self) -> None:
        """Remove the journal once nothing in it is pending."""
        contents = read(self.path)
        if not contents.pending and not contents.malformed:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@contextlib.contextmanager
def undone_on_error(
    journal: Journal, entry_id: str, revert: Callable[[Mapping[str, Any]], None],
    undo: Mapping[str, Any],
) -> Iterator[None]:
    """Apply a fault in steps inside this block: if a step fails, what was done is
    reverted at once, and the entry stays pending only if that revert fails too."""
    try:
        yield
    except BaseException:
        try:
            revert(undo)
        except Exception:  # left pending in the journal: heal will try again
            pass
        else:
            journal.done(entry_id)
        raise


# ------------------------------------------------------------- what a run can prove it made


@dataclass(frozen=True, slots=True)
class UndoContext:
    """What a trusted journal proves about its run, for checking its undo records.

    Each check returns what it accepted, or raises :class:`UndoRefused` saying why
    not. A fault kind's ``validate(undo, context)`` is made of these checks.
    """

    run_id: str
    folders: tuple[Path, ...]  # real paths the run may touch
    state: Path  # real path of the state folder that holds the journal

    @classmethod
    def of(cls, journal: Path, contents: Contents) -> UndoContext:
        real = Path(os.path.realpath(journal))
        return cls(
            run_id=real.stem,
            # As recorded (real paths then), never resolved again: a folder swapped for a
            # link since would make the link's target count as the run's.
            folders=tuple(Path(os.path.normpath(f)) for f in contents.folders),
            state=real.parent.parent,
        )

    def process(self, data: object) -> ProcessRef | None:
        """A process of this run, by pid and start time: its environment carries
        ``AFTERSHOCK_RUN_ID=<run id>``. None if it is gone (nothing to undo on it)."""
        if not isinstance(data, Mapping) or not (_is_int(data.get("pid"))
                                                 and _is_int(data.get("start"))):
            raise UndoRefused(f"{data!r} does not name a process (pid and start time)")
        ref = ProcessRef(int(data["pid"]), int(data["start"]))
        if ref.pid <= 1:
            raise UndoRefused(f"pid {ref.pid} is never a process of a run")
        if not ref.alive():
            return None  # gone, or its pid reused: a signal checks the start time anyway
        value = environ(ref.pid).get(RUN_ID_ENV)
        if start_time(ref.pid) != ref.start:
            return None  # ended while we read: that environment was another process's
        if value != self.run_id:
            found = "no AFTERSHOCK_RUN_ID" if value is None else f"{RUN_ID_ENV}={value!r}"
            raise UndoRefused(
                f"pid {ref.pid} is not a process of run {self.run_id}: its environment has "
                f"{found}"
            )
        return ref

    def path(self, value: object) -> Path:
        """A path inside one of the run's folders (after resolving links)."""
        candidate = self._normal(value)
        real = Path(os.path.realpath(candidate))
        if any(real == f or real.is_relative_to(f) for f in self.folders):
            return candidate
        where = ", ".join(map(str, self.folders)) or "none recorded"
        raise UndoRefused(f"{candidate} is outside this run's folders ({where})")

    def inside(self, value: object) -> Path:
        """A path inside one of the run's folders as written, nothing resolved: for an undo
        that reaches it again through descriptors and checks what it finds there
        (faults/_openat.py), so that a run folder moved or swapped since is named as such."""
        candidate = self._normal(value)
        if any(candidate == f or candidate.is_relative_to(f) for f in self.folders):
            return candidate
        where = ", ".join(map(str, self.folders)) or "none recorded"
        raise UndoRefused(f"{candidate} is outside this run's folders ({where})")

    def state_path(self, value: object, area: str) -> tuple[str, ...]:
        """A path under ``<state>/<area>/<token>/``; returns its parts below ``area``
        (the token first)."""
        candidate = self._normal(value)
        base = self.state / area
        real = Path(os.path.realpath(candidate))
        if not real.is_relative_to(base):
            raise UndoRefused(f"{candidate} is not in the state folder's {base}")
        parts = real.relative_to(base).parts
        if not parts or not _TOKEN.fullmatch(parts[0]):
            raise UndoRefused(f"{candidate} is not under {base}/<token>")
        return parts

    def name(self, value: object) -> str:
        """A name the engine made (``aftershock_...``): an nftables table, a cgroup."""
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise UndoRefused(f"{value!r} is not Aftershock's (no {NAME_PREFIX} prefix)")
        return value

    def cgroup(self, undo: Mapping[str, Any], mount: Path | None) -> Path:
        """A fault's own cgroup ``{cgroup, home, root}``: named ``aftershock_...``, made
        right inside ``home``, under ``root``, which is where ``mount`` is mounted now."""
        if mount is None:
            raise UndoRefused("no such cgroup hierarchy is mounted here")
        group = self._normal(undo.get("cgroup"))
        home, root = self._normal(undo.get("home")), self._normal(undo.get("root"))
        if root != mount:
            raise UndoRefused(f"cgroup root {root} is not the cgroup mount {mount}")
        if group.parent != home or not home.is_relative_to(root):
            raise UndoRefused(f"cgroup {group} is not a group made in {home} under {root}")
        try:
            self.name(group.name)
        except UndoRefused as exc:
            raise UndoRefused(f"cgroup {group}: {exc}") from None
        return group

    @staticmethod
    def _normal(value: object) -> Path:
        if not isinstance(value, str) or not os.path.isabs(value):
            raise UndoRefused(f"{value!r} is not an absolute path")
        if os.path.normpath(value) != value:
            raise UndoRefused(f"{value!r} is not a normal path (.., //, trailing /)")
        return Path(value)
