"""Cgroup helpers: a run's own v2 group, and groups for faults (v1 controllers and v2).

A fault's group is made *inside* the target's current group (the run's group,
when there is one), so it stays under whatever limits that group imposes (a
container's, say), and is removed on revert after its processes are moved back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from aftershock.faults._openat import mounts


def v1_mount(controller: str) -> Path | None:
    """Where the cgroup v1 hierarchy holding ``controller`` is mounted, if anywhere."""
    for mount in mounts():
        if mount.fstype == "cgroup" and controller in mount.options:
            return mount.point
    return None


def v2_mount() -> Path | None:
    for mount in mounts():
        if mount.fstype == "cgroup2":
            return mount.point
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


# ----------------------------------------------------------------------- a run's own group
#
# Every process the harness launches for a run starts inside one cgroup v2 group,
# ``<harness's group>/aftershock_run_<run id>``. Membership is inherited at fork and cannot
# be dropped the way an environment variable can (``env -i``, a daemon that scrubs its
# environment), so ending the group ends the whole run; systemd tracks services this way.

RUN_PREFIX = "aftershock_run_"


def run_group_dir(run_id: str) -> tuple[Path | None, str]:
    """Where run ``run_id``'s group goes (inside this process's own v2 group), or None and
    why not: no cgroup2 mount, or a group this process may not create groups in."""
    mount = v2_mount()
    if mount is None:
        return None, "no cgroup2 mount"
    own = group_of(os.getpid(), None)
    if own is None:
        return None, "this process is in no cgroup v2 group"
    parent = directory(mount, own)
    if not writable(parent) or not os.access(parent / "cgroup.procs", os.W_OK):
        return None, f"cgroup {parent} is not writable"
    return parent / f"{RUN_PREFIX}{run_id}", ""


def is_run_group(path: Path, run_id: str) -> bool:
    """Whether ``path`` can only be run ``run_id``'s group: named for it, inside a mounted
    cgroup2 hierarchy, with no ``..`` to climb out. Checked before anything is killed."""
    mount = v2_mount()
    return (
        mount is not None
        and path.is_absolute()
        and ".." not in path.parts
        and path.name == f"{RUN_PREFIX}{run_id}"
        and path.is_relative_to(mount)
        and path != mount
    )


def _subtree(group_dir: Path) -> list[Path]:
    """``group_dir`` and every group below it, deepest first (the order rmdir needs)."""
    found: list[Path] = []
    for folder, _subdirs, _files in os.walk(group_dir, topdown=False):
        found.append(Path(folder))
    return found


def subtree_members(group_dir: Path) -> list[int]:
    """Pids of every process in ``group_dir`` or below it (a fault's nested group)."""
    return [pid for group in _subtree(group_dir) for pid in members(group)]


def populated(group_dir: Path) -> bool:
    """Whether any live process is in ``group_dir`` or below (``cgroup.events``)."""
    try:
        text = (group_dir / "cgroup.events").read_text()
    except OSError:
        return bool(subtree_members(group_dir)) if group_dir.exists() else False
    return "populated 1" in text.split("\n")


def has_kill_file(group_dir: Path) -> bool:
    """``cgroup.kill`` (Linux 5.14): one write SIGKILLs the whole subtree, race-free."""
    return (group_dir / "cgroup.kill").exists()


def _kill_member(pid: int, group_dir: Path) -> None:
    """SIGKILL ``pid`` only while it is still in the subtree of ``group_dir``: the pidfd
    pins the process, so a pid reused after the member exited is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
        here = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        mount = v2_mount()
        if here is None or mount is None:
            return
        if directory(mount, here).is_relative_to(group_dir):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass  # exited meanwhile
    finally:
        os.close(pidfd)


def kill_tree(group_dir: Path, timeout: float) -> bool:
    """SIGKILL every process in ``group_dir`` and below; True once none is left.

    ``cgroup.kill`` where the kernel has it; otherwise the group is frozen (so nothing
    can fork a new member between listing and killing), every member is killed (a
    frozen process still dies of SIGKILL), and the group thawed, until it is empty.
    Bounded by ``timeout``: a process stuck in the kernel (state D) can outlive it.
    """
    if not group_dir.exists():
        return True
    deadline = time.monotonic() + timeout
    freeze = group_dir / "cgroup.freeze"
    frozen = False
    try:
        while populated(group_dir):
            if has_kill_file(group_dir):
                with contextlib.suppress(FileNotFoundError):
                    (group_dir / "cgroup.kill").write_text("1\n")
            else:
                if not frozen and freeze.exists():
                    with contextlib.suppress(OSError):
                        freeze.write_text("1\n")
                        frozen = True
                for pid in subtree_members(group_dir):
                    _kill_member(pid, group_dir)
            if time.monotonic() >= deadline:
                return not populated(group_dir)
            time.sleep(0.02)
    finally:
        if frozen:
            with contextlib.suppress(OSError):
                freeze.write_text("0\n")
    return True


def remove_tree(group_dir: Path, timeout: float = 2.0) -> bool:
    """rmdir ``group_dir`` and the (empty) groups below it; True once it is gone.

    Idempotent. Used only on a group whose processes were all ended: a group with a
    live member stays (EBUSY) and False says so.
    """
    deadline = time.monotonic() + timeout
    while group_dir.exists():
        busy = False
        for group in _subtree(group_dir):
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy = True
        if not busy or time.monotonic() >= deadline:
            break
        time.sleep(0.02)  # a task still exiting keeps its group busy for a moment
    return not group_dir.exists()


def end_run_group(group_dir: Path, run_id: str, timeout: float = 5.0) -> bool:
    """End every process of run ``run_id``'s group and remove the group; True when done.

    Refuses (ValueError) a path that :func:`is_run_group` does not prove is that run's.
    """
    if not is_run_group(group_dir, run_id):
        raise ValueError(f"{group_dir} is not the cgroup of aftershock run {run_id}")
    return kill_tree(group_dir, timeout) and remove_tree(group_dir)
