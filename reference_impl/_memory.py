"""Memory a process keeps once freed, and memory it makes ready for a recovery while it waits.

A warm spare, or a slot's standby, takes part in a recovery with a process that never held
the model: every page it writes first (the model and its optimizer state, the state copy it
receives, the first step's activations and gradients) costs a page fault. For the bench's
model that was ~5,500 faults in the spare between the kill and its first step, and on the
bench's host (a virtual machine) a fault on memory the process never used costs 3-25 µs:
15-100 ms of CPU, on the recovery's critical path (docs/benchmarks.md, "Recovery: where the
time went").

Touching that memory once, early, is not enough by itself: glibc's malloc serves every
allocation of 128 KiB or more with a fresh ``mmap`` and unmaps it on release, and it gives
memory freed at the top of its heap back to the kernel. ``prefault`` therefore first raises
both limits (``mallopt``: allocations up to 32 MiB come from the heap, freed memory stays
with the process), then writes ``nbytes`` of heap and frees them: later allocations of the
process's main thread reuse those pages without a fault. The process keeps that memory (its
resident size grows by ``nbytes``) until it exits.

Every training rank calls ``keep_freed`` at its start (``aftershock.reference_impl.trainer.main``):
a
step frees and allocates the same megabytes again, and with glibc's defaults each step
faulted them in anew (docs/benchmarks.md, "Page faults every step").

Only glibc has ``mallopt``; elsewhere ``prefault`` and ``keep_freed`` do nothing and say so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit hosts; larger allocations are mmap()ed anyway,
#: so prefaulting more than a few of them would not help.
MMAP_THRESHOLD_MAX = 32 << 20
#: What one process prefaults at most, and in pieces of what size (each under the threshold,
#: or it would be mmap()ed and unmapped again on release).
LIMIT = 64 << 20
PIECE = 8 << 20


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` from the C library this process already has loaded.
    ``ctypes.util.find_library`` would run ``ldconfig`` in a child process: a fork and an
    exec at the start of every rank, and pids it takes from the rank's namespace."""
    try:
        return getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return None


def keep_freed() -> bool:
    """Serve allocations up to 32 MiB from the heap and never hand freed memory back to the
    kernel, for the rest of the process's life (inherited by its forks). False where the C
    library has no ``mallopt`` (not glibc) or refused."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def prefault(nbytes: int) -> int:
    """Make ``nbytes`` (at most ``LIMIT``) of heap resident now, for the allocations to come;
    returns how many bytes it touched (0 where ``keep_freed`` could not apply)."""
    nbytes = max(0, min(nbytes, LIMIT))
    if nbytes == 0 or not keep_freed():
        return 0
    pieces = []
    for start in range(0, nbytes, PIECE):
        piece = torch.empty(min(PIECE, nbytes - start), dtype=torch.uint8)
        piece.fill_(0)  # every page written: torch.zeros may take them from calloc, unwritten
        pieces.append(piece)
    del pieces  # back to the heap, which now keeps them
    return nbytes
