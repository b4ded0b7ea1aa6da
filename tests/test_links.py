"""A generation's connections, cut when a newer plan supersedes it (``reference_impl._links``).

Real sockets on loopback and a real Gloo group: a connection that is cut fails whoever waits
on it at once, as a closed peer would; one to the controller's store or snapshot service, a
listener, one opened before the generation or one already forgotten is never touched. The
end-to-end case, survivors waiting on a wedged live peer after another one died, is the
shipped scenario training/kill_rank_peer_hung_elastic (tests/test_shipped_scenarios.py),
which fails without the cut (the survivors leave only at the peer's release, 3 s later).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from reference_impl._links import Links, sockets
from tests._helpers import on_threads

TIMEOUT_S = 60.0  # what a waiter would wait without the cut


class Peers:
    """A listening socket and the connections made to it, both ends."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.ends: list[socket.socket] = []

    def connect(self) -> tuple[socket.socket, socket.socket]:
        mine = socket.create_connection(("127.0.0.1", self.port))
        theirs, _ = self.server.accept()
        self.ends += [mine, theirs]
        return mine, theirs

    def close(self) -> None:
        for sock in [*self.ends, self.server]:
            sock.close()


@pytest.fixture
def peers() -> Iterator[Peers]:
    made = Peers()
    yield made
    made.close()


def blocked_recv(sock: socket.socket) -> dict[str, Any]:
    """Start a thread that waits on ``sock`` for a message that never comes."""
    sock.settimeout(TIMEOUT_S)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        started = time.monotonic()
        try:
            outcome["got"] = sock.recv(1)
        except OSError as exc:
            outcome["got"] = exc
        outcome["waited_s"] = time.monotonic() - started

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    outcome["thread"] = thread
    time.sleep(0.2)
    assert thread.is_alive(), outcome
    return outcome


def test_a_superseding_plan_cuts_the_generations_connections_and_nothing_else(
        peers: Peers) -> None:
    old, _ = peers.connect()  # opened before the generation: not its own
    store = Peers()  # the controller's store, connected to during the generation's build
    try:
        before = sockets()
        gen, _ = peers.connect()
        service, _ = store.connect()
        listener = socket.create_server(("127.0.0.1", 0))
        links = Links()
        links.note(3, before, {store.port})
        waiting = blocked_recv(gen)

        links.supersede(4)

        waiting["thread"].join(5)
        assert not waiting["thread"].is_alive(), "the cut left the waiter waiting"
        assert waiting["got"] == b"", waiting  # as if the peer had closed it
        assert waiting["waited_s"] < 5 < TIMEOUT_S
        assert links.cut_gen == 3
        # The others still work, and the cut connection's descriptor is still open: it is
        # its owner's (Gloo's) to close.
        for sock in (old, service):
            sock.sendall(b"x")
        assert gen.fileno() >= 0
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening
        listener.close()
    finally:
        store.close()


def test_a_plan_for_the_same_generation_or_an_older_one_cuts_nothing(peers: Peers) -> None:
    before = sockets()
    mine, theirs = peers.connect()
    links = Links()
    links.note(5, before, set())
    links.supersede(5)
    links.supersede(2)
    theirs.sendall(b"y")
    mine.settimeout(5)
    assert mine.recv(1) == b"y"
    assert links.cut_gen == -1


def test_a_forgotten_generation_is_never_cut(peers: Peers) -> None:
    """Its groups are being destroyed, which closes the descriptors; their numbers may be
    reused by the next generation's sockets, which the old plan must never cut."""
    before = sockets()
    mine, theirs = peers.connect()
    links = Links()
    links.note(0, before, set())
    links.forget()
    links.supersede(1)
    theirs.sendall(b"z")
    mine.settimeout(5)
    assert mine.recv(1) == b"z"
    assert links.cut_gen == -1


def test_a_plan_that_came_while_the_groups_were_built_cuts_them_once_noted(
        peers: Peers) -> None:
    links = Links()
    links.supersede(1)  # published before generation 0's sockets were noted
    before = sockets()
    mine, _ = peers.connect()
    links.note(0, before, set())
    mine.settimeout(5)
    assert mine.recv(1) == b""
    assert links.cut_gen == 0


def test_a_gloo_collective_waiting_on_a_silent_live_peer_fails_at_once_when_cut() -> None:
    """Rank 0 waits in an all_reduce that rank 1 never enters (alive, holding its
    connections): without the cut it would wait for the group's timeout."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    store = dist.HashStore()
    before = sockets()
    groups = on_threads(2, lambda rank: dist.ProcessGroupGloo(
        dist.PrefixStore("gen0/dp/", store), rank, 2, timedelta(seconds=TIMEOUT_S)))
    assert not any(isinstance(g, Exception) for g in groups), groups
    links = Links()
    # Both ranks' sockets live in this process: the cut takes both ends, as two cutting
    # members would.
    links.note(0, before, set())
    outcome: dict[str, Any] = {}

    def wait_on_peer() -> None:
        started = time.monotonic()
        try:
            groups[0].allreduce([torch.ones(4)]).wait()
            outcome["error"] = None
        except RuntimeError as exc:
            outcome["error"] = str(exc)
        outcome["waited_s"] = time.monotonic() - started

    waiter = threading.Thread(target=wait_on_peer, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), outcome

    links.supersede(1)

    waiter.join(10)
    assert not waiter.is_alive(), "the cut did not reach Gloo's waiter"
    assert outcome["error"], outcome
    assert outcome["waited_s"] < 10 < TIMEOUT_S, outcome
    links.forget()
    groups.clear()  # the groups' last references: destroyed here, not at exit
