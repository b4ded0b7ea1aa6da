"""The file triggers of a run (`at: {file}`): one inotify watch per fault, from launch on.

The schedule (harness/schedule.py) only counts; this is the I/O behind the count. The run
loop waits on the watches' descriptors, so it wakes the moment a watched file changes
instead of at its next tick.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aftershock.faults import FaultUnavailable, FileWatch
from aftershock.harness.spec import FileWhen


def describe_file_state(file: str, state: Mapping[str, Any]) -> str:
    """What a file-triggered fault's record says about its file at the fault's moment
    (``file_size``, ``file_open``, ``file_writers`` of its `fault_injected` event)."""
    size = state.get("file_size")
    what = f"{file} was gone" if size is None else f"{file} was {size} bytes"
    if state.get("file_open"):
        pids = ", ".join(map(str, state.get("file_writers") or []))
        return f"{what}, still open for writing (pid {pids})"
    if state.get("file_open") is None and "file_writers" not in state:
        return what  # not read: the scenario does not expect faults_landed
    if state.get("file_open") is None:
        pids = ", ".join(map(str, state.get("file_unreadable") or []))
        return f"{what}; whether it was open is unknown (cannot read the descriptors of {pids})"
    return f"{what}, open for writing by no process of the run"


class FileTriggers:
    def __init__(self) -> None:
        self._watches: dict[int, FileWatch] = {}

    def watch(self, index: int, root: Path, pattern: str, when: FileWhen,
              writing: Callable[[Path], bool] | None = None) -> None:
        """Watch for fault ``index`` (raises FaultUnavailable or OSError if it cannot);
        ``writing(path)``: is a process of the run holding ``path`` open for writing?"""
        self._watches[index] = FileWatch(root, pattern, when, writing)

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
