"""Reading the files of a run folder without trusting them: one home for it.

A run folder holds what the system under test (or anyone who could write there) left:
a log may be a link to a private file elsewhere, a FIFO that never ends, a device such as
/dev/zero, or a gigabyte long. Everything here opens a path as a regular file only
(``O_NOFOLLOW | O_NONBLOCK``, so neither a link nor a FIFO is followed or waited on),
optionally only inside a given folder, and reads it streamed and capped, so what a
command holds in memory is bounded by what it shows, not by what is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


def refusal(path: Path, *, within: Path | None = None) -> str | None:
    """Why ``path`` is not read as a file of its folder, or None: a link (one out of
    ``within`` in particular), or not a regular file."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or "cannot be read"
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        if within is not None and not Path(target).is_relative_to(os.path.realpath(within)):
            return "a link out of the run folder, not followed"
        return "a link, not followed"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, a device or a folder), not read"
    return None


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO | None]:
    """``path`` opened for reading if it is a regular file reached without a link; None
    otherwise (a link, a FIFO, a device, a folder, or nothing there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield None
        return
    with os.fdopen(fd, "rb") as handle:
        yield handle if stat.S_ISREG(os.fstat(fd).st_mode) else None


def lines(path: Path, *, start: int = 0, line_limit: int, total_limit: int
          ) -> Iterator[tuple[int, bytes]]:
    """Each line of a regular file from byte ``start`` on, with its offset: its first
    ``line_limit`` bytes (the rest of a longer line is skipped, not held), without its line
    break, up to ``total_limit`` bytes read in all. Nothing for anything but a regular file."""
    with open_regular(path) as handle:
        if handle is None:
            return
        handle.seek(start)
        offset = start
        while offset - start < total_limit:
            try:
                raw = handle.readline(line_limit)
                length = len(raw)
                while raw and not raw.endswith(b"\n") and length >= line_limit:
                    more = handle.readline(line_limit)  # the rest of a long line: skipped
                    length += len(more)
                    if not more or more.endswith(b"\n") or len(more) < line_limit:
                        break
            except OSError:
                return
            if not raw:
                return
            yield offset, raw.rstrip(b"\n").rstrip(b"\r")
            offset += length


def head(path: Path, limit: int) -> bytes | None:
    """A regular file's first ``limit`` bytes; None for anything else."""
    with open_regular(path) as handle:
        if handle is None:
            return None
        try:
            return handle.read(limit)
        except OSError:
            return None


class Refused(ValueError):
    """A file that is not read: reached through a link, not a regular file (a FIFO, a
    device, a folder), or over its limit. The message names the file and says which."""


@contextlib.contextmanager
def open_file(path: Path, *, what: str = "this file") -> Iterator[BinaryIO]:
    """``path`` opened for reading, if it is a regular file reached without a link. Raises
    :class:`Refused` for a link, a FIFO, a device or a folder (none is waited on or
    followed); OSError if it cannot be opened (FileNotFoundError: nothing there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(path):  # ELOOP; a link to a folder answers ENOTDIR on some systems
            raise Refused(f"{path}: a link, not followed; {what} is read only as a regular "
                          f"file") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{path}: not a regular file (a FIFO, a device or a folder), not "
                          f"read; {what} is read only as a regular file")
        yield handle


def read_capped(path: Path, limit: int, *, what: str = "this file") -> bytes:
    """A regular file's whole content, as :func:`open_file` opens it; :class:`Refused` if
    it is over ``limit`` bytes (only ``limit + 1`` are ever read)."""
    with open_file(path, what=what) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise Refused(f"{path}: larger than {size(limit)}, the limit for {what}; not read")
    return data


def loads(data: bytes | str, *, depth: int) -> Any:
    """``json.loads`` of a file's text, refusing (ValueError) a value nested more than
    ``depth`` levels deep: JSON's own parser recurses, so a line of 200,000 ``[`` would end
    in a RecursionError, and a value deep enough to parse can still break whoever walks it."""
    raw = data.encode(errors="replace") if isinstance(data, str) else data
    opened = raw.count(b"[") + raw.count(b"{")
    too_deep = ValueError(f"nested more than {depth} levels deep (the limit)")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    if opened > depth and _depth(value) > depth:  # only a value with that many brackets can be
        raise too_deep
    return value


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = (item.values() if isinstance(item, dict) else
                    item if isinstance(item, list) else None)
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def size(limit: int) -> str:
    """A limit in words: 64 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= scale and limit % scale == 0:
            return f"{limit // scale} {unit}"
    return f"{limit} bytes"
