"""The heal journal: what the engine applied and has not yet undone, on disk.

Every fault is written here *before* it is applied (with all that is needed to
undo it), and marked reverted after it is undone. Processes the harness
launched are written here too. If the harness dies, `aftershock heal`, the next
run, or the run's reaper process reads the journal and undoes what is left.

One file per harness run under the state folder; a record names the owning
harness process, so a second run never heals a run that is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults._proc import ProcessRef

STATE_ENV = "AFTERSHOCK_STATE_DIR"


def state_dir() -> Path:
    """Where heal journals live: $AFTERSHOCK_STATE_DIR, else $XDG_STATE_HOME/aftershock."""
    explicit = os.environ.get(STATE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "aftershock"


@dataclass(frozen=True, slots=True)
class Pending:
    """An applied fault (or a launched process tree) that was not undone yet."""

    id: str
    op: str  # "fault" or "launch"
    kind: str
    undo: dict[str, Any]


@dataclass
class Journal:
    path: Path
    owner: ProcessRef | None = None
    _records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def create(cls, run_id: str, folder: Path | None = None) -> Journal:
        folder = folder or state_dir() / "journal"
        folder.mkdir(parents=True, exist_ok=True)
        owner = ProcessRef.of(os.getpid())
        journal = cls(path=folder / f"{run_id}.jsonl", owner=owner)
        journal._append({"op": "owner", "owner": owner.to_json() if owner else None})
        return journal

    def _append(self, record: dict[str, Any]) -> None:
        record = {"t": time.time(), **record}
        line = json.dumps(record, separators=(",", ":")) + "\n"
        # fsync: the point of this file is to survive the harness being killed.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
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
        if not pending(self.path):
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


def read(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))  # a torn last line is skipped
    return records


def owner_of(path: Path) -> ProcessRef | None:
    for record in read(path):
        if record.get("op") == "owner" and record.get("owner"):
            return ProcessRef.from_json(record["owner"])
    return None


def pending(path: Path) -> list[Pending]:
    applied: dict[str, Pending] = {}
    for record in read(path):
        op = record.get("op")
        if op in ("fault", "launch"):
            applied[record["id"]] = Pending(record["id"], op, record["kind"], record["undo"])
        elif op == "reverted":
            applied.pop(record.get("id", ""), None)
    return list(applied.values())


def orphaned_journals(folder: Path | None = None) -> Iterator[Path]:
    """Journals whose owning harness is no longer running."""
    folder = folder or state_dir() / "journal"
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.jsonl")):
        owner = owner_of(path)
        if owner is None or not owner.alive():
            yield path
