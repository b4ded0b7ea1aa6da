"""The file triggers of a run (`at: {file}`): one inotify watch per fault, from launch on,
and for `created` a gate that holds the job's open until the fault is in.

The schedule (harness/run/schedule.py) only counts; this is the I/O behind the count. The run
loop waits on the watches' descriptors, so it wakes the moment a watched file changes
instead of at its next tick.

inotify only reports: on a starved machine the job commits its save before the harness
reads that the file appeared, and a fault "inside the save" lands after it. So a `created`
trigger also holds the job: on an ordinary folder through fanotify permission events
(faults/_fanotify.py): the k-th match fires at the first open of it, or of anything in it
(a folder), and that open waits in the kernel until the fault is in. On the run's own lazy
filesystem (storage.lose_unsynced), for a root at its mount or in a folder of it, the
filesystem holds it (``lazyfs.Hold``): the job's next
operation after the k-th name appeared, created or renamed into place, waits there. The
fault's record says whether the job was held (``file_held``); where it could not be (no
CAP_SYS_ADMIN, another `when:`, another filesystem the run mounted, a name renamed into place
and not opened within :data:`OPEN_WAIT_S`), it fires on inotify alone and the record says why.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from aftershock.faults import FaultUnavailable, FileWatch, lazyfs
from aftershock.faults import FileGate as Gate
from aftershock.faults import file_matches as matches
from aftershock.harness.scenario.spec import FileWhen

#: How long a held trigger waits for its match to be opened before it fires unheld: a name
#: renamed into place (an atomic writer's final name) is never opened by the save that made
#: it, and a folder made and filled before its mark was in place shows no open inside it.
OPEN_WAIT_S = 10.0


def describe_file_state(file: str, state: Mapping[str, Any]) -> str:
    """What a file-triggered fault's record says about its file at the fault's moment
    (``file_size``, ``file_open``, ``file_writers`` of its `fault_injected` event)."""
    size = state.get("file_size")
    what = f"{file} was gone" if size is None else f"{file} was {size} bytes"
    if state.get("file_held"):
        what += (f", the job (pid {state.get('held_pid')}) held in its open of "
                 f"{state.get('held_open')} until the fault was in")
    if state.get("file_open"):
        pids = ", ".join(map(str, state.get("file_writers") or []))
        return f"{what}, still open for writing (pid {pids})"
    if state.get("file_held"):
        return what  # the held open has not returned: no descriptor to see yet
    if state.get("file_open") is None and "file_writers" not in state:
        return what  # not read: the scenario does not expect faults_landed
    if state.get("file_open") is None:
        pids = ", ".join(map(str, state.get("file_unreadable") or []))
        return f"{what}; whether it was open is unknown (cannot read the descriptors of {pids})"
    return f"{what}, open for writing by no process of the run"


_NO_OPEN = {
    "renamed": "it was renamed into place, so no open of it came to hold: fired on inotify "
               "alone (trigger on the file the save opens, e.g. its temporary name)",
    "scanned": "it was made in a folder before the folder could be marked: fired on "
               "inotify alone (watch a root that is its own mount to cover every level)",
}


class _Gate(Protocol):
    """What holds a `created` trigger's job: a fanotify Gate, or the lazy filesystem's
    own Hold (faults/lazyfs.py)."""

    whole_mount: bool  # it sees every level under the root
    sees_renames: bool  # a name renamed into place can still be held

    def fileno(self) -> int: ...
    def mark(self, rel: str) -> bool: ...
    def take(self) -> list[tuple[int, str, str, int, float]]: ...
    def settle(self, asked: list[tuple[int, str, str, int, float]],
               decide: Callable[[str, str, int], bool | None]) -> None: ...
    def held(self) -> lazyfs.Held | None: ...
    def close(self) -> None: ...


def _lazy_source(root: Path) -> str | None:
    """The name of the run's lazy filesystem (storage.lose_unsynced) mounted on ``root``."""
    source = lazyfs.mounted_source(root)
    return source if source is not None and source.startswith(lazyfs.SOURCE_PREFIX) else None


def _lazy_mount_above(root: Path) -> tuple[Path | None, str | None]:
    """The run's lazy filesystem that ``root`` lies on (its mount point and name): the
    nearest mount at or above ``root``, if it is one."""
    for folder in (root, *root.parents):
        if os.path.ismount(folder):
            source = _lazy_source(folder)
            return (folder, source) if source is not None else (None, None)
    return None, None


class FileTriggers:
    def __init__(self) -> None:
        self._watches: dict[int, FileWatch] = {}
        self._gates: dict[int, _Gate] = {}
        self._counts: dict[int, int] = {}
        self._unheld: dict[int, str] = {}  # fault -> why its job cannot be held
        self._reached: dict[int, float] = {}  # fault -> when its count was first read
        self._done: set[int] = set()  # faults whose held open was released
        self._seen: dict[int, list[str]] = {}  # fault -> new matches its gate saw opened
        self._existing: dict[int, set[str]] = {}  # fault -> matches there before the watch

    def watch(self, index: int, root: Path, pattern: str, when: FileWhen,
              writing: Callable[[Path], bool] | None = None, *, count: int = 1) -> None:
        """Watch for fault ``index`` (raises FaultUnavailable or OSError if it cannot);
        ``writing(path)``: is a process of the run holding ``path`` open for writing?
        ``count``: the match the fault fires on, whose open a `created` trigger holds."""
        watch = FileWatch(root, pattern, when, writing)
        self._watches[index] = watch
        self._counts[index] = count
        if when != "created":
            self._unheld[index] = (f"`when: {when}` has no open to hold: watched with "
                                   "inotify only")
            return
        # Never fanotify on a filesystem the run mounted: on FUSE a create's open asks while
        # the kernel holds its folder's lock, and the harness's own look into that folder
        # waits behind it (a job stalled there beside three CPU hogs). The lazy one holds the
        # job itself, for a root at its mount or in a folder of it.
        mount, source = _lazy_mount_above(root)
        if mount is None and os.path.ismount(root):
            self._unheld[index] = ("its root is a filesystem the run mounted, whose "
                                   "opens are not held: watched with inotify only")
            return
        if mount is not None and source is not None:
            try:
                self._gates[index] = lazyfs.Hold(source, pattern, count, lazyfs.HOLD_MAX_S,
                                                 within=root.relative_to(mount).as_posix())
            except (ConnectionError, RuntimeError, OSError, ValueError) as exc:
                self._unheld[index] = f"{exc}; watched with inotify only"
            return
        try:
            gate = Gate(root, lambda rel: matches(pattern, rel))
        except FaultUnavailable as exc:
            self._unheld[index] = f"{exc}; watched with inotify only"
            return
        self._gates[index] = gate
        self._seen[index] = []
        try:
            self._existing[index] = ({str(p.relative_to(root)) for p in root.glob(pattern)}
                                     if root.is_dir() else set())
        except (OSError, ValueError):
            self._existing[index] = set()
        for rel in watch.folders():
            gate.mark(rel)

    def poll(self) -> list[tuple[int, FaultUnavailable]]:
        """Read what happened; the watches that broke (events were lost, so their count is no
        longer true), which are dropped."""
        broken: list[tuple[int, FaultUnavailable]] = []
        for index, watch in list(self._watches.items()):
            gate = self._gates.get(index)
            # The opens that ask are taken before the watch is read: the creation a trigger
            # counts was queued before the open that asks about it, so it is read by then.
            asked = gate.take() if gate is not None else []
            try:
                watch.poll()
            except FaultUnavailable as exc:
                self._watches.pop(index).close()
                broken.append((index, exc))
                if gate is not None:
                    self._gates.pop(index).close()
                continue
            if gate is not None:
                for rel in watch.folders():
                    gate.mark(rel)
                gate.settle(asked, partial(self._holds, index))
        return broken

    def _holds(self, index: int, match: str, _path: str, _pid: int) -> bool:
        """Is an open of (or in) ``match`` fault ``index``'s moment: its count-th match?"""
        if index in self._done:
            return False
        # A new name the gate sees opened counts even before inotify reports it: on a
        # filesystem that creates in its open (FUSE, NFS: atomic_open) the open asks first,
        # and a short-lived file in a folder inotify began watching late is never reported.
        if match not in self._seen[index] and match not in self._existing[index]:
            self._seen[index].append(match)
        so_far, count = self._so_far(index), self._counts[index]
        return len(so_far) >= count and so_far[count - 1] == match

    def _so_far(self, index: int) -> list[str]:
        """The matches of fault ``index``'s trigger so far: inotify's, then the gate's own."""
        hits = self._watches[index].hits
        return hits + [m for m in self._seen.get(index, []) if m not in hits]

    def hits(self) -> dict[int, int]:
        """Matches so far, by fault, for the watches still open."""
        found = {index: len(watch.hits) for index, watch in self._watches.items()}
        now = time.monotonic()
        for index, gate in self._gates.items():
            count = self._counts[index]
            if index in self._done:
                continue
            found[index] = len(self._so_far(index))
            if gate.held() is not None:
                found[index] = max(found[index], count)  # its creation may be reported later
                continue
            if found[index] < count:
                continue
            kinds = self._watches[index].how
            how = kinds[count - 1] if len(kinds) >= count else "created"
            if (how == "renamed" and not gate.sees_renames) or (
                    how == "scanned" and not gate.whole_mount):
                # No open of it is to come that the gate could see: the rename published
                # it whole, or it was made in a folder before the folder's mark was in.
                self._unheld.setdefault(index, _NO_OPEN[how])
                continue
            # Reached, but its open is not held yet: the fault waits for it (the save is
            # still to open the file or folder), at most OPEN_WAIT_S, then fires unheld.
            if now - self._reached.setdefault(index, now) < OPEN_WAIT_S:
                found[index] = count - 1
        return found

    def landing(self, index: int) -> dict[str, Any]:
        """What fault ``index``'s record says about holding its job: ``file_held``, and
        ``held_open``/``held_pid`` (the open it holds) or ``file_held_why`` (why not)."""
        gate = self._gates.get(index)
        held = gate.held() if gate is not None else None
        if held is not None:
            return {"file_held": True, "held_open": held.path, "held_pid": held.pid}
        expired = getattr(gate, "expired", None)
        if isinstance(expired, dict):
            return {"file_held": False, "file_held_why": (
                f"the lazy filesystem held the job after {expired.get('match')} appeared for "
                f"{expired.get('after_s')} s, its bound, and let it go before the fault was "
                "in: the harness was late (a starved machine?); it fired unheld")}
        why = self._unheld.get(index) or (
            f"its match was not opened within {OPEN_WAIT_S:g} s of appearing (a name renamed "
            "into place, or a folder filled before its mark was in): fired on inotify alone")
        return {"file_held": False, "file_held_why": why}

    def release(self, index: int) -> None:
        """Fault ``index`` is in (or will not be sent): its held open goes on, and no later
        open is held for it."""
        gate = self._gates.get(index)
        if gate is not None and (gate.held() is not None or index in self._reached
                                 or index in self._unheld):
            self._done.add(index)
            self._gates.pop(index).close()  # releases it; the job's opens no longer ask

    def path(self, index: int, count: int) -> str | None:
        """The path of the ``count``-th match of fault ``index``'s watch."""
        gate = self._gates.get(index)
        held = gate.held() if gate is not None else None
        if held is not None:
            return held.match
        so_far = self._so_far(index) if index in self._watches else []
        return so_far[count - 1] if len(so_far) >= count else None

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less if a watched file changes meanwhile."""
        if self._watches:
            ready: list[int] = [w.fileno() for w in self._watches.values()]
            ready += [g.fileno() for g in self._gates.values()]
            select.select(ready, [], [], timeout)
        else:
            time.sleep(timeout)

    def close(self) -> None:
        """Stop watching; every open still held or asking is allowed."""
        for gate in self._gates.values():
            gate.close()
        for watch in self._watches.values():
            watch.close()
