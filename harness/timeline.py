"""The run's one timeline: ``events.jsonl``, written by the harness and every probe.

The harness appends its own events (launch, faults, exits) to the same file the
probes write, on the same monotonic clock, and tails it to drive triggers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from harness.records import Event


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
                continue  # a foreign or torn line is not an event; never stop the run for it
        return events

    def close(self) -> None:
        os.close(self._fd)


def read_events(path: Path) -> list[Event]:
    """Every event of a recorded run, in time order."""
    events: list[Event] = []
    with open(path, "rb") as handle:
        for line in handle:
            try:
                events.append(Event.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue
    events.sort(key=lambda e: e.t)
    return events
