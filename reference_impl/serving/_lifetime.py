"""No orphans: a child process of the server dies with the process that started it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the process that spawned it dies (Linux only). The kernel
    ties this to the parent *thread*: spawn from a thread that lives as long as the parent."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:
        os._exit(0)  # the parent died before prctl took effect


class StopRequest:
    """A stop that a signal handler requests: ``on_signal`` only sets flags, never a lock.

    Python runs a handler between two bytecodes of the main thread, wherever it is, and a
    second signal can arrive while the first handler runs (the harness signals the whole
    process group, and the launcher forwards its own SIGTERM to the router a moment later).
    A handler that calls ``threading.Event.set()`` can so run inside another ``set()`` or
    ``wait()`` that holds the Event's lock, and that lock's second acquire by the same
    thread never returns: a router hung that way on SIGTERM until SIGKILL
    (tests/test_signal_safety.py). The main thread polls the flag instead (``wait``)."""

    POLL_S = 0.05  # how soon a waiting main thread sees the request

    def __init__(self, on_request: tuple[Callable[[], None], ...] = ()) -> None:
        self.requested = False
        self._on_request = list(on_request)

    def also(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (which must only set flags too) when a stop is requested."""
        self._on_request.append(hook)

    def on_signal(self, signum: int, frame: object) -> None:
        for hook in self._on_request:
            hook()
        self.requested = True

    def wait(self, timeout: float) -> bool:
        """Sleep until a stop is requested or ``timeout`` passed; whether it was."""
        deadline = time.monotonic() + timeout
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, self.POLL_S))
        return self.requested
