"""Where the harness keeps what it may reuse between runs, and whether a file there is
believed (one definition for every module)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from aftershock.faults import contract
from aftershock.faults.journal import others_can_write, unsafe_folder


def cache_dir() -> Path:
    """$AFTERSHOCK_CACHE_DIR, else $XDG_CACHE_HOME/aftershock (fault-free twins, the platform
    line of aftershock.harness.twin.golden)."""
    explicit = os.environ.get(contract.CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aftershock"


def untrusted(path: Path) -> str | None:
    """Why a cached file cannot be believed, or None: it must be a regular file (not a
    link) that this user owns and no one else can write, in a folder that passes the heal
    journal's rules (aftershock.faults.journal.unsafe_folder): otherwise anyone who could write
    there
    could have planted a digest that fails a correct run or passes a broken one."""
    folder_problem = unsafe_folder(path.parent)
    if folder_problem is not None:
        return folder_problem
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}"
    if others_can_write(st):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
