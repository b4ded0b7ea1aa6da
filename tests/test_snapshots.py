"""The controller's snapshot server (reference_impl/_snapshots.py) over real sockets: what it
keeps, what it never keeps, and a broken server the checks catch."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import closing

import pytest

from aftershock.reference_impl import _snapshots


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Puts have no reply: wait until the server shows what was sent."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the server never showed it"
        time.sleep(0.005)


@pytest.fixture
def server() -> Iterator[_snapshots.Server]:
    with closing(_snapshots.Server("127.0.0.1")) as server:
        yield server


def data(step: int, size: int = 4096) -> memoryview:
    return memoryview(bytes([step % 256]) * size)


def test_keeps_the_two_newest_whole_snapshots_per_shard(server: _snapshots.Server) -> None:
    with closing(_snapshots.Sender(server.address)) as sender:
        for step in (10, 20, 30):
            sender.put(0, step, data(step))
        sender.put(1, 30, data(99, 8))
    eventually(lambda: set(_snapshots.fetch(server.address, 0)) == {20, 30})
    held = _snapshots.fetch(server.address, 0)
    assert held == {20: bytearray(data(20)), 30: bytearray(data(30))}
    assert _snapshots.fetch(server.address, 1) == {30: bytearray(data(99, 8))}
    assert _snapshots.fetch(server.address, 2) == {}


def test_a_sender_killed_mid_snapshot_leaves_the_previous_ones(
    server: _snapshots.Server,
) -> None:
    """A sender that dies after half of a snapshot: that one never counts (restoring it
    would load half a state)."""
    with closing(_snapshots.Sender(server.address)) as sender:
        sender.put(0, 10, data(10))
    eventually(lambda: 10 in _snapshots.fetch(server.address, 0))
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as dying:
        dying.sendall(_snapshots.REQUEST.pack(b"P", 0, 20, 4096) + bytes(2048))
    time.sleep(0.2)  # no reply to a put; the broken server's thread needs moments
    assert _snapshots.fetch(server.address, 0) == {10: bytearray(data(10))}


def test_a_snapshot_after_a_restore_drops_the_given_up_newer_ones(
    server: _snapshots.Server,
) -> None:
    """The world went back to step 20 (every replica of some shard was lost): the step 30
    it held belongs to a trajectory given up, and must not meet the new one's snapshots."""
    with closing(_snapshots.Sender(server.address)) as sender:
        for step in (20, 30, 20):
            sender.put(0, step, data(step + 1 if step == 20 else step))
        sender.put(9, 0, data(0))  # one connection, served in order: once this shows, all did
    eventually(lambda: 0 in _snapshots.fetch(server.address, 9))
    assert _snapshots.fetch(server.address, 0) == {20: bytearray(data(21))}


class KeepsTornSnapshots(_snapshots.Server):
    """Broken: keeps whatever arrived of a snapshot, as a store that wrote in place would."""

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(_snapshots.REQUEST.size)
        with conn:
            while _snapshots.recv_exactly(conn, memoryview(head)):
                op, shard, step, size = _snapshots.REQUEST.unpack(head)
                if op == b"G":
                    self._send(conn, shard)
                    continue
                buffer = bytearray(size)
                _snapshots.recv_exactly(conn, memoryview(buffer))
                self._keep(shard, step, buffer)


class KeepsNewer(_snapshots.Server):
    """Broken: keeps the newest two by step, whatever came after them."""

    def _keep(self, shard: int, step: int, buffer: bytearray) -> None:
        with self.lock:
            held = self.held.setdefault(shard, {})
            held[step] = buffer
            while len(held) > _snapshots.KEEP:
                held.pop(min(held))


@pytest.mark.parametrize(("broken", "check"), [
    (KeepsTornSnapshots, test_a_sender_killed_mid_snapshot_leaves_the_previous_ones),
    (KeepsNewer, test_a_snapshot_after_a_restore_drops_the_given_up_newer_ones),
])
def test_the_checks_catch_a_broken_server(
    broken: type[_snapshots.Server], check: Callable[[_snapshots.Server], None]
) -> None:
    with closing(broken("127.0.0.1")) as server, pytest.raises(AssertionError):
        check(server)
