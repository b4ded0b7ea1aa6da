"""No orphans: a child process of the server dies with the process that started it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the process that spawned it dies (Linux only). The kernel
    ties this to the parent *thread*: spawn from a thread that lives as long as the parent."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:
        os._exit(0)  # the parent died before prctl took effect
