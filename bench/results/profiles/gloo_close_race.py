"""Gloo (torch 2.13) can miss a connection that closes while collectives run on it.

``python bench/results/profiles/gloo_close_race.py MODE TRIES``: two ranks (threads of one
process, a real ``ProcessGroupGloo`` with a 2 s timeout) run all_reduces back to back; at a
random moment (20-80 ms in) the run ends one of three ways, and the script counts the tries
in which some rank went on waiting for more than a second:

- ``cut``: every connection of the group is shut down (``shutdown(2)``, both ends), as a
  member's plan watcher did in f312999 (reverted);
- ``one_end``: one end of each connection is shut down, as a peer's death or its teardown
  closes them;
- ``leave``: nothing is closed; each rank's wait gives up once a flag is set
  (``reference_impl._leave``), and the groups are dropped afterwards, off the way.

Measured on this machine (2026-12-05, this script): ``cut`` 25 of 60 tries, ``one_end`` 13
of 40 (the waiting rank failed at Gloo's 2 s timeout, "Timed out waiting ... for recv/send
operation" in unbound_buffer.cc, its peer at once), ``leave`` 0 of 40. (A first, throwaway
version of the same loop: ``cut`` 34 of 60, ``one_end`` 15 of 40, ``leave`` 0 of 40, both
ranks out within 20 ms; dropping the abandoned groups afterwards took ~30 ms, at most the
2 s timeout.) Gloo's listener sockets are never shut down: that kills the process
("accept: Invalid argument").
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reference_impl._leave import Abandonable, Leave


def _groups(name: str, store: Any) -> list[Any]:
    """A two-rank Gloo group, each rank built on a thread of its own."""
    out: list[Any] = [None, None]

    def build(rank: int) -> None:
        out[rank] = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), rank, 2,
                                          timedelta(seconds=2))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _sockets() -> dict[int, int]:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _shut(fds: list[int], one_end: bool) -> None:
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # Gloo closed it already
            continue
        try:
            peer = sock.getpeername()[1]  # a listener has none: Gloo's, never touched
            if not one_end or sock.getsockname()[1] < peer:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()


def trial(mode: str, index: int, rng: random.Random) -> list[float]:
    store = dist.HashStore()
    before = _sockets()
    raw = _groups(f"t{index}", store)
    fds = [fd for inode, fd in _sockets().items() if inode not in before]
    leave = Leave()
    groups: list[Any] = [Abandonable(g, leave, 0) for g in raw] if mode == "leave" else raw
    ended: dict[int, float] = {}

    def loop(rank: int) -> None:
        tensor = torch.ones(64)
        try:
            while True:
                groups[rank].allreduce([tensor]).wait()
                sum(range(rng.randint(0, 2000)))  # a little work between collectives
        except RuntimeError:
            ended[rank] = time.monotonic()

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(rng.uniform(0.02, 0.08))
    start = time.monotonic()
    if mode == "leave":
        leave.supersede(1)
    else:
        _shut(fds, one_end=mode == "one_end")
    for thread in threads:
        thread.join(5)
    box = [*raw]
    raw.clear()
    groups.clear()
    threading.Thread(target=box.clear, daemon=True).start()
    return [ended.get(rank, float("inf")) - start for rank in range(2)]


def main() -> None:
    mode, tries = sys.argv[1], int(sys.argv[2])
    assert mode in ("cut", "one_end", "leave"), mode
    rng = random.Random(1)
    slow = [waits for i in range(tries) if max(waits := trial(mode, i, rng)) > 1.0]
    print(f"{mode}: some rank waited over 1 s in {len(slow)} of {tries} tries")
    for waits in slow[:5]:
        print("  waits (s):", [round(w, 3) for w in waits])


if __name__ == "__main__":
    main()
