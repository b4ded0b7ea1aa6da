"""Peer-memory snapshots: held in the controller's memory, sent over a socket of their own.

One replica of each shard sends its flattened parameters and AdamW state every
``--snapshot-every`` steps and after every sync (``aftershock.reference_impl.resilient``); the
controller
keeps the two newest of each shard, so that losing every replica of a shard at once costs the
steps since the newest snapshot that every shard has, not the run.

They used to travel through the TCPStore, as one 3.2 MB value each (the bench's model). That
cost the sender ~3 ms of CPU per snapshot, most of it with the GIL held, so the training
thread waited (the header's concatenation, pybind's copy of the bytes into a ``std::string``),
and the store's thread in the controller ~1.5 ms more. Here the sender's ``sendall`` releases
the GIL while the kernel copies the tensor's own memory, and the server receives straight into
a buffer it keeps: the sending thread's CPU went from 0.6 to 0.03 ms per training step
with a snapshot every 10 (docs/benchmarks.md).

Wire format, over one TCP connection per sender (and one per reader)::

    request   op (1 byte) shard (int64) step (int64) size (int64), big-endian
    b"P"      followed by ``size`` bytes: a snapshot of ``shard`` at ``step``; no reply
    b"G"      step and size ignored; reply: count (int64), then count ×
              (step (int64) size (int64) and ``size`` bytes), newest first

A snapshot counts only once all its bytes arrived: a sender killed in the middle of one
leaves the previous ones as they were. The server imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

REQUEST = struct.Struct("!cqqq")
COUNT = struct.Struct("!q")
ENTRY = struct.Struct("!qq")
KEEP = 2  # snapshots held per shard


def recv_exactly(sock: socket.socket, into: memoryview) -> bool:
    """Fill ``into`` from ``sock``; False if the peer closed the connection first."""
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if n == 0:
            return False
        got += n
    return True


class Server:
    """The controller's end: keeps the ``KEEP`` newest snapshots of every shard."""

    def __init__(self, host: str) -> None:
        self.listener = socket.create_server((host, 0))
        self.lock = threading.Lock()
        self.held: dict[int, dict[int, bytearray]] = {}  # shard -> step -> bytes
        self.spare: dict[int, bytearray] = {}  # shard -> a dropped buffer, reused
        threading.Thread(target=self._accept, daemon=True, name="snapshots").start()

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        """Stop accepting (the controller's process exits without it; tests call it)."""
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="snapshots-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        with conn, contextlib.suppress(OSError):
            while recv_exactly(conn, memoryview(head)):
                op, shard, step, size = REQUEST.unpack(head)
                if op == b"P":
                    buffer = self._buffer(shard, size)
                    if not recv_exactly(conn, memoryview(buffer)):
                        return  # the sender died in the middle: the snapshot never counts
                    self._keep(shard, step, buffer)
                elif op == b"G":
                    self._send(conn, shard)
                else:
                    return

    def _buffer(self, shard: int, size: int) -> bytearray:
        with self.lock:
            buffer = self.spare.pop(shard, None)
        return buffer if buffer is not None and len(buffer) == size else bytearray(size)

    def _keep(self, shard: int, step: int, buffer: bytearray) -> None:
        with self.lock:
            held = self.held.setdefault(shard, {})
            # The world resumed from this step (a snapshot after a sync) or went on from it:
            # a newer one belongs to a trajectory that was given up (a restore from older
            # snapshots), and must never be mixed with this one's.
            for newer in [s for s in held if s >= step]:
                self.spare[shard] = held.pop(newer)
            held[step] = buffer
            while len(held) > KEEP:
                self.spare[shard] = held.pop(min(held))

    def _send(self, conn: socket.socket, shard: int) -> None:
        # Under the lock: a buffer dropped meanwhile would be reused for the next snapshot.
        # Reads are rare (every replica of a shard lost) and short.
        with self.lock:
            entries = sorted(self.held.get(shard, {}).items(), reverse=True)
            conn.sendall(COUNT.pack(len(entries)))
            for step, buffer in entries:
                conn.sendall(ENTRY.pack(step, len(buffer)))
                conn.sendall(buffer)


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Sender:
    """A rank's end for sending: one connection, opened again after an error."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: socket.socket | None = None

    def put(self, shard: int, step: int, data: memoryview) -> None:
        """Send one snapshot (``data``: its bytes, read in place); raises OSError if the
        controller is gone (the next call connects again)."""
        try:
            if self.sock is None:
                self.sock = _connect(self.address)
            self.sock.sendall(REQUEST.pack(b"P", shard, step, data.nbytes))
            self.sock.sendall(data)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def fetch(address: str, shard: int) -> dict[int, bytearray]:
    """The snapshots the controller holds for ``shard``: step -> bytes."""
    with _connect(address) as sock:
        sock.sendall(REQUEST.pack(b"G", shard, 0, 0))
        head = bytearray(COUNT.size)
        found: dict[int, bytearray] = {}
        if not recv_exactly(sock, memoryview(head)):
            raise ConnectionError("the controller closed the snapshot connection")
        for _ in range(COUNT.unpack(head)[0]):
            entry = bytearray(ENTRY.size)
            if not recv_exactly(sock, memoryview(entry)):
                raise ConnectionError("the controller closed the snapshot connection")
            step, size = ENTRY.unpack(entry)
            data = bytearray(size)
            if not recv_exactly(sock, memoryview(data)):
                raise ConnectionError("the controller closed the snapshot connection")
            found[step] = data
        return found
