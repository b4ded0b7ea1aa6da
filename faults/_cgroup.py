"""Cgroup helpers for faults that need a group of their own (v1 controllers and v2).

A fault's group is made *inside* the target's current group, so it stays under
whatever limits that group imposes (a container's, say), and is removed on
revert after its processes are moved back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path


def _mounts() -> list[tuple[str, str, str]]:
    """(mountpoint, fs type, options) of each line of /proc/self/mounts."""
    found: list[tuple[str, str, str]] = []
    with open("/proc/self/mounts") as handle:
        for line in handle:
            cols = line.split()
            if len(cols) >= 4:
                found.append((cols[1].replace("\\040", " "), cols[2], cols[3]))
    return found


def v1_mount(controller: str) -> Path | None:
    """Where the cgroup v1 hierarchy holding ``controller`` is mounted, if anywhere."""
    for point, fstype, options in _mounts():
        if fstype == "cgroup" and controller in options.split(","):
            return Path(point)
    return None


def v2_mount() -> Path | None:
    for point, fstype, _ in _mounts():
        if fstype == "cgroup2":
            return Path(point)
    return None


def group_of(pid: int, controller: str | None) -> str | None:
    """The group path of ``pid`` in the v1 hierarchy of ``controller``, or in v2 if None."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if controller is None and hier == "0" and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    return None


def directory(mount: Path, group: str) -> Path:
    return mount / group.lstrip("/")


def move(pid: int, group_dir: Path) -> None:
    """Move process ``pid`` with all its threads into ``group_dir``."""
    (group_dir / "cgroup.procs").write_text(f"{pid}\n")


def members(group_dir: Path) -> list[int]:
    try:
        return [int(x) for x in (group_dir / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove(group_dir: Path, home: Path, root: Path) -> None:
    """Move every process in ``group_dir`` to ``home`` (or ``root`` if gone), then rmdir.

    Only processes found *in* the group are moved, so a reused pid is never touched.
    Idempotent: a group that is already gone is fine.
    """
    dest = home if (home / "cgroup.procs").exists() else root
    for _ in range(50):
        if not group_dir.exists():
            return
        for pid in members(group_dir):
            with contextlib.suppress(OSError):  # exited meanwhile
                move(pid, dest)
        try:
            group_dir.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        time.sleep(0.02)  # a task still exiting keeps the group busy for a moment
    raise RuntimeError(f"cgroup {group_dir} still busy (members {members(group_dir)})")


def writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)
