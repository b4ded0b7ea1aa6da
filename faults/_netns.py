"""Network namespaces: run a tool (nft, ss) inside another one, such as a container's."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000


def enter(fd: int) -> None:
    """setns(2) into the network namespace open as ``fd``: what a child runs between fork
    and exec, so only a system call, nothing that could wait on a lock held at fork."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
