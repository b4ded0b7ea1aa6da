"""The run's one timeline: ``events.jsonl``, written by the harness and every probe.

The harness appends its own events (launch, faults, exits) to the same file the
probes write, on the same monotonic clock, and tails it to drive triggers.

Every writer appends whole lines, one ``write(2)`` each (O_APPEND), so a line that is not
an event is damage, not noise: :func:`read_events` refuses the timeline, naming the line,
rather than let a run be judged on what was left (:class:`DamagedTimeline`). The one
exception is a last line cut short with no newline, which is what a writer killed in the
middle of its write leaves; it is passed over unless the timeline is ``complete`` (the
harness closed it with its own ``run_end``, so nothing can have been cut after it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from aftershock.faults import jsonl
from aftershock.harness.errors import HarnessError
from aftershock.harness.run import _files
from aftershock.harness.run._room import Room
from aftershock.harness.run.records import Event

#: The longest line of a timeline: an event is a few KiB at most (a captured log line, an
#: argv); a longer line is damage, and is not held whole to find that out.
LINE_LIMIT = 1 << 20
#: How deep an event's fields may nest (JSON's parser recurses: 200,000 ``[`` would crash it).
DEPTH_LIMIT = 64
#: The largest timeline judged: its events are all held at once, at ~10 times their bytes.
TOTAL_LIMIT = 64 << 20


class DamagedTimeline(HarnessError):
    """A line of a timeline is not an event (corrupt, torn, foreign): the run cannot be
    judged from it (exit 3). The message names the file and line."""


class Timeline:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Neither a FIFO left in a reused folder waited on (O_NONBLOCK: no reader, ENXIO)
        # nor a link followed: the timeline is a regular file of the run folder, or nothing.
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):
                raise
            regular = False
        else:
            if not regular:
                os.close(self._fd)
        if not regular:
            raise DamagedTimeline(f"{path}: not a regular file (a FIFO, a device or a link), "
                                  "so no timeline is written there; remove it, or run in "
                                  "another --run-dir")
        # Where a full disk under the run folder is noted, by this and every other writer of
        # the run (harness/run/_room.py); the run loop stops the run when it is.
        self.room = Room(path.parent)
        self._tail = jsonl.Tail(line_limit=LINE_LIMIT)  # a longer unfinished line: no event

    def emit(self, event: str, source: str = "harness", *, at: float | None = None,
             **fields: Any) -> Event:
        """Append an event; ``at`` backdates it to when the action really began."""
        t = time.monotonic() if at is None else at
        return self.write(Event(t=t, event=event, source=source, fields=fields))

    def write(self, record: Event) -> Event:
        line = jsonl.encode(record.to_json(), default=str)
        # A full disk is noted, not raised: the writer may be a log thread, or a heal in
        # the teardown, and the run is stopped, never judged, from a timeline missing lines.
        self.room.write(self._fd, line, self.path)
        return record

    def poll(self) -> list[Event]:
        """Events appended since the last poll (whole lines only)."""
        # Not waited on if something put a FIFO in its place, nor followed through a link:
        # read_events refuses such a timeline once the run is over.
        with _files.open_regular(self.path) as handle:
            if handle is None:
                return []
            lines = self._tail.read(handle, TOTAL_LIMIT)
        events: list[Event] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(Event.from_json(_files.loads(line, depth=DEPTH_LIMIT)))
            except (ValueError, KeyError, TypeError):
                # Not an event: the run goes on (its faults are still healed at the end),
                # and read_events refuses the timeline once it is over.
                continue
        return events

    def close(self) -> None:
        os.close(self._fd)


def read_events(path: Path, *, complete: bool = False) -> list[Event]:
    """Every event of a recorded run, in time order. Raises DamagedTimeline at the first
    line that is not an event; a last line without its newline that is not one either is
    a write cut short, passed over unless ``complete`` (the writer closed the timeline).
    A timeline that is not a regular file (a link, a FIFO, a device), is over
    :data:`TOTAL_LIMIT`, or has a line over :data:`LINE_LIMIT` is damaged too."""
    events: list[Event] = []
    with _open(path) as handle:
        number, read = 0, 0
        while line := handle.readline(LINE_LIMIT + 1):
            number, read = number + 1, read + len(line)
            if read > TOTAL_LIMIT:
                raise DamagedTimeline(
                    f"{path}: larger than {_files.size(TOTAL_LIMIT)}, the limit for a "
                    "timeline: not judged")
            if len(line) > LINE_LIMIT:
                raise DamagedTimeline(
                    f"{path}:{number}: longer than {_files.size(LINE_LIMIT)}, the limit for an "
                    f"event ({_shown(line)}); the timeline is damaged, so the run is not "
                    "judged from what is left")
            if line.endswith(b"\n"):
                events.append(_event(line[:-1], path, number))
                continue
            try:  # the last line, without its newline
                events.append(_event(line, path, number))
            except DamagedTimeline:
                if complete:
                    raise DamagedTimeline(
                        f"{path}:{number}: the last line is cut short ({_shown(line)}), in a "
                        "timeline the harness closed after it: damaged, not judged") from None
    events.sort(key=lambda e: e.t)
    return events


@contextlib.contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    try:
        with _files.open_file(path, what="a timeline") as handle:
            yield handle
    except _files.Refused as exc:
        raise DamagedTimeline(f"{exc}; the run is not judged") from None


def _event(line: bytes, path: Path, number: int) -> Event:
    try:
        data = _files.loads(line, depth=DEPTH_LIMIT)
        if not isinstance(data, dict) or not isinstance(data.get("event"), str):
            raise ValueError("not an object with an `event`")
        return Event.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedTimeline(
            f"{path}:{number}: not an event ({_shown(line)}: {exc}); the timeline is damaged "
            "(a fault or a writer that touched it), so the run is not judged from what is "
            "left") from None


def _shown(line: bytes, limit: int = 80) -> str:
    text = repr(line[:limit])
    return text + ("..." if len(line) > limit else "")
