"""The vote's own connections: rank 0 of a group and each other rank, over TCP.

Every training step ends with a vote over the whole world, a sum of one or a few float64
through rank 0 (``model.sum_through_root``). Over Gloo's point-to-point calls each of its
messages wakes two threads on the receiving side: Gloo's transport loop reads the bytes, then
wakes the waiting caller. Here the caller reads its own socket, so a message wakes one. With
4 ranks on 2 cores: 42 µs per vote against 178 µs over Gloo's calls, and 60 against 275 µs
of all ranks' CPU (``python -m bench.allreduce_sizes --methods star,socket_star``); in the
``trainer_no_ckpt`` row's job, 3.0% less time per step (docs/benchmarks.md).

A star fails as a Gloo group does, so the loops around it need no new cases: a peer's
connection that closes or resets fails the call at once, a silent one at ``timeout``
(``StarError``, a ``RuntimeError`` whose text says "timed out" for a timeout, as Gloo's do).
A star that failed closes every connection it holds, so a rank waiting on it fails at once
too: rank 0's failure fails every other rank, and a failed rank fails rank 0 at its next
receive. The harness's network faults reach it like any connection (``net.reset`` resets it,
a partition silences it); its calls are not process-group calls, so ``collective.*`` faults
do not (docs/trainer.md).

Rendezvous, through the job's store: rank 0 listens on the address peers reach it at
(``reachable_host``) and publishes ``host port token`` under ``key``; each other rank waits
for that key, connects and says hello (magic, the token, its rank, the group's size). Rank 0
takes only hellos that carry the token, a rank in range and not yet taken, and the same
size; anything else is closed and not counted. Every message is framed (its payload's byte
count and its number on the connection), so a message of the wrong size or out of turn is a
``StarError`` ("protocol"), never a silently wrong sum.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import time
from datetime import timedelta
from typing import Any

import torch

from aftershock.reference_impl._snapshots import recv_exactly
from aftershock.reference_impl.model import sum_through_root

MAGIC = b"ASv1"
HELLO = struct.Struct("!4s16sII")  # magic, token, rank, size
HEADER = struct.Struct("!IQ")  # payload bytes, the message's number on this connection
_SIOCGIFADDR = 0x8915


class StarError(RuntimeError):
    """A call over the star failed: a peer's connection closed, reset or fell silent until
    the timeout ("timed out"), or a message broke the protocol."""


def reachable_host() -> str:
    """The address this process's peers reach it at, found the way Gloo finds its own: the
    interface named by ``GLOO_SOCKET_IFNAME`` (its first), else the first address of this
    host's name that can be bound, else loopback."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if names.strip():
        return _interface_address(names.split(",")[0].strip())
    with contextlib.suppress(OSError):
        for family, _, _, _, address in socket.getaddrinfo(
                socket.gethostname(), None, type=socket.SOCK_STREAM):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((address[0], 0))
                except OSError:
                    continue
                return str(address[0])
    return "127.0.0.1"


def _interface_address(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise StarError(f"GLOO_SOCKET_IFNAME={name}: no IPv4 address on that interface "
                            f"({exc.strerror}); name an interface that has one") from exc
    return socket.inet_ntoa(packed[20:24])


class Star:
    """Rank 0's connection to each other rank of one group (the others hold one, to rank 0).

    Single-threaded, like the training loop that calls it. ``send`` and ``recv`` have the
    shape ``sum_through_root`` takes; ``sum`` is the vote."""

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self.socks = socks
        self.sent = dict.fromkeys(socks, 0)
        self.received = dict.fromkeys(socks, 0)
        self.broken: str | None = None
        # Blocking sockets with the kernel's timeouts: one recv(2) per message, where
        # Python's own timeout makes it a failed recv, a poll(2) and the recv again.
        seconds = int(timeout)
        limit = struct.pack("ll", seconds, max(int((timeout - seconds) * 1e6), 0 if seconds else 1))
        for sock in socks.values():
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)

    @classmethod
    def connect(cls, store: Any, rank: int, size: int, timeout: float,
                key: str = "star") -> Star:
        """Build the star of ``rank`` in a group of ``size`` through ``store`` (a
        torch.distributed store: every rank of the group calls this with the same ``key``).
        Fails with ``StarError`` if the group is not complete within ``timeout`` seconds."""
        if size == 1:
            return cls(rank, size, {}, timeout)
        deadline = time.monotonic() + timeout
        if rank == 0:
            return cls(0, size, _accept(store, key, size, timeout, deadline), timeout)
        try:
            store.wait([key], timedelta(seconds=timeout))
            value = store.get(key)
        except RuntimeError as exc:  # the store's timeout (DistStoreError), or its loss
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "time" in text.lower():
                raise StarError(f"vote: timed out after {timeout:g}s waiting for rank 0's "
                                f"address ({text})") from exc
            raise StarError(f"vote: no address from rank 0: {text}") from exc
        try:
            host, port, hexed = value.decode().split(" ")
            address, token = (host, int(port)), bytes.fromhex(hexed)
        except ValueError as exc:
            raise StarError(f"vote: the store's {key!r} holds {value[:80]!r}, not an address "
                            "a star published") from exc
        try:
            sock = socket.create_connection(address,
                                            timeout=max(deadline - time.monotonic(), 0.001))
            sock.sendall(HELLO.pack(MAGIC, token, rank, size))
        except OSError as exc:
            raise StarError(f"vote: cannot reach rank 0 at {host}:{port}: {exc}") from exc
        return cls(rank, size, {0: sock}, timeout)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        payload = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
        sock = self._sock(peer)
        try:
            sock.sendall(HEADER.pack(len(payload), self.sent[peer]) + payload)
        except OSError as exc:
            self._fail(peer, exc)
        self.sent[peer] += 1

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        into = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
        sock = self._sock(peer)
        frame = bytearray(HEADER.size + len(into))
        view = memoryview(frame)
        try:
            # One read brings the whole frame when it is there; the header is checked
            # before waiting for more, so a frame of another size never stalls to a timeout.
            got = sock.recv_into(view)
            if got == 0:
                self._fail(peer, None)
            if got < HEADER.size and not recv_exactly(sock, view[got:HEADER.size]):
                self._fail(peer, None)
            size, number = HEADER.unpack_from(frame)
            if size != len(into) or number != self.received[peer]:
                self._protocol(peer, f"message {number} of {size} bytes, expected message "
                                     f"{self.received[peer]} of {len(into)}")
            if got < len(frame) and not recv_exactly(sock, view[max(got, HEADER.size):]):
                self._fail(peer, None)
        except OSError as exc:
            self._fail(peer, exc)
        into[:] = view[HEADER.size:]
        self.received[peer] += 1

    def sum(self, value: torch.Tensor) -> None:
        """Sum ``value`` (a small float64 tensor) in place over the group, through rank 0."""
        sum_through_root(value, self.rank, self.size, send=self.send, recv=self.recv)

    def start_sum(self, value: torch.Tensor) -> None:
        """The first half of :meth:`sum`, split so that the caller can work between the two:
        every rank but 0 sends ``value`` to rank 0 now (it does not wait for rank 0)."""
        if self.rank != 0:
            self.send(value, 0)

    def finish_sum(self, value: torch.Tensor) -> None:
        """The second half: rank 0 adds the others' values to its own in rank order and
        sends the total back; the others receive it into ``value``. The same bits as
        :meth:`sum`."""
        if self.size == 1:
            return
        if self.rank != 0:
            self.recv(value, 0)
            return
        parts = [torch.empty_like(value) for _ in range(1, self.size)]
        for peer, part in enumerate(parts, start=1):
            self.recv(part, peer)
        for part in parts:
            value += part
        for peer in range(1, self.size):
            self.send(value, peer)

    def interrupt(self) -> None:
        """From another thread: shut every connection down, without closing it (the thread
        using the star closes it once its call failed). A call blocked on one fails now, as
        does a peer waiting on us."""
        for sock in list(self.socks.values()):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close every connection: a peer waiting on one fails now."""
        socks, self.socks = self.socks, {}
        for sock in socks.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # -- failures ---------------------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        sock = self.socks.get(peer)
        if sock is None:
            raise StarError(f"vote: no connection to rank {peer}"
                            + (f" (the star failed: {self.broken})" if self.broken else ""))
        return sock

    def _fail(self, peer: int, exc: OSError | None) -> None:
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # the kernel's timeout: EAGAIN
            why = f"timed out after {self.timeout:g}s waiting for rank {peer}"
        elif exc is None:
            why = f"rank {peer} closed its connection"
        else:
            why = f"connection to rank {peer} failed: {exc}"
        self.broken = why
        self.close()
        raise StarError(f"vote: {why}") from exc

    def _protocol(self, peer: int, what: str) -> None:
        self.broken = f"protocol: rank {peer} sent {what}"
        self.close()
        raise StarError(f"vote: {self.broken}")


def _accept(store: Any, key: str, size: int, timeout: float,
            deadline: float) -> dict[int, socket.socket]:
    """Rank 0's side of the rendezvous: publish, then take one valid hello per other rank."""
    host = reachable_host()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family, backlog=size)
    token = os.urandom(16)
    socks: dict[int, socket.socket] = {}
    try:
        store.set(key, f"{host} {listener.getsockname()[1]} {token.hex()}")
        while len(socks) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(socks))
                raise StarError(f"vote: timed out after {timeout:g}s waiting for ranks "
                                f"{missing} to connect")
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            hello = bytearray(HELLO.size)
            try:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                complete = recv_exactly(conn, memoryview(hello))
            except OSError:
                complete = False
            magic, theirs, rank, their_size = HELLO.unpack(hello)
            if (not complete or magic != MAGIC or theirs != token or their_size != size
                    or not 1 <= rank < size or rank in socks):
                conn.close()  # not one of ours, or a second hello for a rank: not counted
                continue
            socks[rank] = conn
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    finally:
        listener.close()
    return socks
