"""The file triggers of a run (`at: {file}`): one inotify watch per fault, from launch on.

The schedule (harness/schedule.py) only counts; this is the I/O behind the count. The run
loop waits on the watches' descriptors, so it wakes the moment a watched file changes
instead of at its next tick.
"""

from __future__ import annotations

import select
import time
from pathlib import Path

from faults import FaultUnavailable, FileWatch
from harness.spec import FileWhen


class FileTriggers:
    def __init__(self) -> None:
        self._watches: dict[int, FileWatch] = {}

    def watch(self, index: int, root: Path, pattern: str, when: FileWhen) -> None:
        """Watch for fault ``index`` (raises FaultUnavailable or OSError if it cannot)."""
        self._watches[index] = FileWatch(root, pattern, when)

    def poll(self) -> list[tuple[int, FaultUnavailable]]:
        """Read what happened; the watches that broke (events were lost, so their count is no
        longer true), which are dropped."""
        broken: list[tuple[int, FaultUnavailable]] = []
        for index, watch in list(self._watches.items()):
            try:
                watch.poll()
            except FaultUnavailable as exc:
                self._watches.pop(index).close()
                broken.append((index, exc))
        return broken

    def hits(self) -> dict[int, int]:
        """Matches so far, by fault, for the watches still open."""
        return {index: len(watch.hits) for index, watch in self._watches.items()}

    def path(self, index: int, count: int) -> str | None:
        """The path of the ``count``-th match of fault ``index``'s watch."""
        watch = self._watches.get(index)
        return watch.hits[count - 1] if watch is not None and len(watch.hits) >= count else None

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less if a watched file changes meanwhile."""
        if self._watches:
            select.select(list(self._watches.values()), [], [], timeout)
        else:
            time.sleep(timeout)

    def close(self) -> None:
        for watch in self._watches.values():
            watch.close()
