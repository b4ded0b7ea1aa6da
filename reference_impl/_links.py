"""The connections one membership generation opened, so that a newer plan can cut them.

A survivor blocked in a collective learns of a dead peer from that peer's closed socket, or
from Gloo's timeout (10 s in the bench, 30 s by default) when no socket it waits on closes.
The second happens: a rank whose peer died was found waiting on a *live* member that was
itself stuck on the dead one, and a Gloo send to a killed peer once waited out its timeout
(docs/benchmarks.md, "Runs AJ and AK"). The controller knows of the death within
milliseconds and publishes a plan without it; a member still inside the old generation
then has nothing left to wait for there: no step of a generation that lost a member can
commit (its vote needs every member).

So each member notes the TCP connections its generation's groups and star opened (the
sockets that appeared while they were built, less any to the controller's store or
snapshot service), and its plan watcher shuts them down (``shutdown(2)``: the descriptors
stay open and Gloo closes them with its groups) once a plan that supersedes the
generation is published. Whatever waits on them fails at once, as if the peer had closed
them, and the member goes on to the new plan. A planned switch (a replica rejoining) cuts
nothing: its members finish the step and switch at the vote.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

_FDS = "/proc/self/fd"


def sockets() -> dict[int, int]:
    """This process's open sockets: inode -> descriptor."""
    found = {}
    for name in os.listdir(_FDS):
        with contextlib.suppress(OSError):
            link = os.readlink(f"{_FDS}/{name}")
            if link.startswith("socket:["):
                found[int(link[8:-1])] = int(name)
    return found


def _peer_port(fd: int) -> int | None:
    """The remote port of a connected TCP socket, else None (a listener, UDP, a Unix
    socket). The descriptor is borrowed, never closed."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or sock.type != socket.SOCK_STREAM:
            return None
        try:
            return int(sock.getpeername()[1])
        except OSError:
            return None
    finally:
        sock.detach()


class Links:
    """The connections of the generation a member is in, and the cut of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = -1
        self._held: dict[int, int] = {}  # inode -> descriptor
        self._cut_below = -1  # generations below this one are superseded
        self.cut_gen = -1  # the newest generation whose connections were cut

    def note(self, gen: int, before: dict[int, int], spare_ports: set[int]) -> None:
        """Hold the TCP connections opened since ``before`` (``sockets()`` taken before the
        generation's groups were built), except those to ``spare_ports`` (the store's, the
        snapshot service's): the controller's, which outlive generations. Cuts them at once
        if a plan that supersedes ``gen`` came meanwhile."""
        held = {}
        for inode, fd in sockets().items():
            if inode in before:
                continue
            port = _peer_port(fd)
            if port is not None and port not in spare_ports:
                held[inode] = fd
        with self._lock:
            self._gen, self._held = gen, held
            if self._cut_below > gen:
                self._cut()

    def forget(self) -> None:
        """The generation's groups are about to be destroyed, which closes these descriptors
        (and the numbers may be reused): never touch them again."""
        with self._lock:
            self._held = {}

    def supersede(self, gen: int) -> None:
        """A plan for generation ``gen`` that does not wait for a step boundary was published:
        cut the connections of any older generation this member is still in."""
        with self._lock:
            self._cut_below = max(self._cut_below, gen)
            if self._gen < gen:
                self._cut()

    def _cut(self) -> None:
        if not self._held:
            return
        for inode, fd in self._held.items():
            with contextlib.suppress(OSError):
                # The same socket still: held descriptors are closed only after forget().
                if os.readlink(f"{_FDS}/{fd}") != f"socket:[{inode}]":
                    continue
                sock = socket.socket(fileno=fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()
        self.cut_gen = self._gen
        self._held = {}
