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

import json
import os
import time
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.records import Event


class DamagedTimeline(HarnessError):
    """A line of a timeline is not an event (corrupt, torn, foreign): the run cannot be
    judged from it (exit 3). The message names the file and line."""


class Timeline:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._offset = 0
        self._partial = b""

    def emit(self, event: str, source: str = "harness", *, at: float | None = None,
             **fields: Any) -> Event:
        """Append an event; ``at`` backdates it to when the action really began."""
        t = time.monotonic() if at is None else at
        return self.write(Event(t=t, event=event, source=source, fields=fields))

    def write(self, record: Event) -> Event:
        line = json.dumps(record.to_json(), separators=(",", ":"), default=str) + "\n"
        os.write(self._fd, line.encode())
        return record

    def poll(self) -> list[Event]:
        """Events appended since the last poll (whole lines only)."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        events: list[Event] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(Event.from_json(json.loads(line)))
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
    a write cut short, passed over unless ``complete`` (the writer closed the timeline)."""
    events: list[Event] = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
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


def _event(line: bytes, path: Path, number: int) -> Event:
    try:
        data = json.loads(line)
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
