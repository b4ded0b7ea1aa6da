"""Reach a recorded folder again without trusting the path to it: for a heal's writes.

A heal runs long after its journal was written, often as root, and the run folder may
have been moved, deleted or swapped for a link since. So a heal never hands a recorded
path to the kernel whole: it walks it one folder at a time from ``/``, each opened with
``O_NOFOLLOW | O_DIRECTORY`` relative to the one before (a link anywhere on the way is
refused, not followed), and checks that the folders the fault acted in are the very ones
it recorded (device and inode). Everything it then does is relative to the descriptor it
ends with (``dir_fd=``, or ``/proc/self/fd/N`` for whole trees), so a swap after the check
changes nothing either.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from aftershock.faults.journal import UndoRefused

Identity = tuple[int, int]  # (st_dev, st_ino)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MNT_DETACH = 2


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino


def identity_of(value: object) -> Identity | None:
    """A recorded ``[dev, ino]``; None if ``value`` is not one."""
    if isinstance(value, list | tuple) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return int(value[0]), int(value[1])
    return None


def describe(parent: int, name: str) -> str:
    """What ``name`` in the folder open as ``parent`` is now, in words."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link to {os.readlink(name, dir_fd=parent)}"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISREG(st.st_mode):
        return "a file"
    return "a special file (FIFO, socket or device)"


def _open_below(parent: int, name: str, shown: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise UndoRefused(f"{shown} no longer exists (deleted, or moved away)") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UndoRefused(f"{shown} is now {describe(parent, name)}, not the folder it "
                              "was") from None
        raise UndoRefused(f"{shown} cannot be opened: {exc.strerror}") from None


@contextlib.contextmanager
def folder(path: Path, expected: Sequence[Identity | None] = ()) -> Iterator[int]:
    """A descriptor on the folder ``path``, reached with no link followed on the way.

    ``expected`` are the identities of ``path``'s last ``len(expected)`` folders (the
    deepest last), as recorded when the fault acted; None in it checks nothing. Raises
    :class:`UndoRefused` saying what changed if any is not the folder it was.
    """
    if not path.is_absolute() or os.path.normpath(path) != str(path):
        raise UndoRefused(f"{path} is not an absolute, normal path")
    parts = path.parts[1:]
    first_checked = len(parts) - len(expected) + 1  # parts[i-1] is the i-th folder below /
    fd = os.open("/", _DIR_FLAGS)
    try:
        shown = Path("/")
        for depth, name in enumerate(parts, 1):
            shown = shown / name
            below = _open_below(fd, name, shown)
            os.close(fd)
            fd = below
            if depth >= first_checked:
                want = expected[depth - first_checked]
                if want is not None and identity(os.fstat(fd)) != want:
                    raise UndoRefused(f"{shown} is another folder than the one the fault "
                                      "acted in (moved, or replaced, after the fault)")
        yield fd
    finally:
        os.close(fd)


def proc_path(fd: int, *names: str) -> Path:
    """A path through the descriptor ``fd`` (``/proc/self/fd/N``): for tools that take paths,
    such as shutil's tree copies; the kernel resolves it to that very folder."""
    return Path(f"/proc/self/fd/{fd}", *names)


def detach(fd: int) -> None:
    """Detach the mount whose root folder ``fd`` is open on (``umount2(MNT_DETACH)``): it
    leaves the tree at once and is freed once nothing uses it. Through the descriptor,
    never a path, so it is the mount that was checked."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(proc_path(fd)), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    id: int
    dev: int  # st_dev of the files on it
    point: Path  # where it is mounted now
    fstype: str
    source: str
    options: tuple[str, ...] = ()  # the mount's own options, then its filesystem's


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash as \040, \011, \012, \134."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[Mount]:
    """This process's mounts, in mount order (the last on a point is the top one)."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            cols = line.split()
            try:
                sep = cols.index("-", 6)
                major, minor = cols[2].split(":")
                found.append(Mount(int(cols[0]), os.makedev(int(major), int(minor)),
                                   Path(_unescape(cols[4])), cols[sep + 1],
                                   _unescape(cols[sep + 2]),
                                   (*cols[5].split(","), *cols[sep + 3].split(","))))
            except (ValueError, IndexError):
                continue  # not a line this parser knows: not one of ours either
    return found
