"""JSON-lines files, written and tailed: one home for the encoding, the append and the tail.

Every writer of a JSON-lines file of a run (the timeline, the command file, a journal, the
simulated NVML's event files) appends whole lines with one ``write(2)`` each on an
``O_APPEND`` descriptor, so lines from many writers never interleave; every reader that
follows such a file while it grows keeps the last, unfinished line until its newline comes.
Standard library only: the in-process probe and the engine inside every rank use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO


def encode(record: Mapping[str, Any], *, default: Callable[[Any], Any] | None = None) -> bytes:
    """One record as one compact JSON line, newline included."""
    return (json.dumps(record, separators=(",", ":"), default=default) + "\n").encode()


def append(path: str | os.PathLike[str], line: bytes) -> None:
    """Append ``line`` to ``path`` (created if missing) with one ``write(2)``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Tail:
    """The whole lines appended to a file since the last read, read from where it stopped.

    ``offset`` is how far the file was read; the unfinished last line is held until its
    newline comes, and dropped once it is longer than ``line_limit`` (it is no record)."""

    def __init__(self, *, offset: int = 0, line_limit: int | None = None) -> None:
        self.offset = offset
        self.line_limit = line_limit
        self._partial = b""

    def read(self, handle: BinaryIO, limit: int = -1) -> list[bytes]:
        """The new whole lines of the open file ``handle`` (at most ``limit`` bytes read)."""
        handle.seek(self.offset)
        chunk = handle.read(limit)
        self.offset += len(chunk)
        return self.feed(chunk)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The whole lines that ``chunk``, the file's next bytes, completes."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if self.line_limit is not None and len(self._partial) > self.line_limit:
            self._partial = b""
        return lines
