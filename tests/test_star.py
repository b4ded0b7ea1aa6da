"""The vote's own TCP connections (reference_impl/_star.py): the exact sum, and failures that
surface as a Gloo group's do, at once where a connection closes and at the timeout where a
peer falls silent, never as a wrong sum. Real sockets over loopback, one thread per rank,
around one in-memory store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests._helpers import on_threads

torch = pytest.importorskip("torch")


def _store() -> Any:
    import torch.distributed as dist

    return dist.HashStore()


def _stars(size: int, timeout: float = 30.0, store: Any = None) -> list[Any]:
    from aftershock.reference_impl._star import Star

    store = _store() if store is None else store
    stars = on_threads(size, lambda rank: Star.connect(store, rank, size, timeout))
    assert all(isinstance(s, Star) for s in stars), stars
    return stars


def _close_all(stars: list[Any]) -> None:
    for star in stars:
        if star is not None and not isinstance(star, Exception):
            star.close()


def _votes_failing(stars: list[Any], odd: int, instead: Callable[[], None]) -> list[Any]:
    """Every rank but ``odd`` votes and must fail (``StarError``): (seconds it took, the
    error's text) for each; ``odd`` runs ``instead`` of voting."""
    from aftershock.reference_impl._star import StarError

    def vote(rank: int) -> Any:
        if rank == odd:
            instead()
            return None
        started = time.monotonic()
        with pytest.raises(StarError) as failed:
            stars[rank].sum(torch.ones(1, dtype=torch.float64))
        return time.monotonic() - started, str(failed.value)

    return on_threads(len(stars), vote)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_sum_split_in_two_halves_is_the_whole_sum_bit_for_bit(size: int) -> None:
    """``start_sum``, other work, then ``finish_sum`` (the trainer sends its vote before the
    gradient all_reduce and reads it after): every rank ends with the bits ``sum`` gives,
    whichever order the ranks reach the halves in, call after call."""
    stars = _stars(size)
    try:
        for call in range(6):
            values = [torch.tensor([0.1 * (rank + 1) * (call + 1), 2.0**-40 * rank, 1e16],
                                   dtype=torch.float64) for rank in range(size)]

            def whole(rank: int, values: list[Any] = values) -> list[float]:
                value = values[rank].clone()
                stars[rank].sum(value)
                return value.tolist()

            def halves(rank: int, call: int = call, values: list[Any] = values) -> list[float]:
                value = values[rank].clone()
                stars[rank].start_sum(value)
                time.sleep(0.002 * ((rank + call) % 3))  # the ranks reach the second half apart
                stars[rank].finish_sum(value)
                return value.tolist()

            want = on_threads(size, whole)
            assert len({tuple(w) for w in want}) == 1
            assert on_threads(size, halves) == want
    finally:
        _close_all(stars)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_rank_ends_with_the_exact_sum_call_after_call(size: int) -> None:
    """Votes of one element and of nine (one plus two fingerprint slots per rank, as the
    resilient loop's vote with fingerprints), alternating on the same connections: every
    rank ends with the same, exact sum."""
    stars = _stars(size)
    try:
        for call in range(20):
            length = 1 if call % 2 == 0 else 1 + 2 * size

            def vote(rank: int, call: int = call, length: int = length) -> list[float]:
                value = torch.full((length,), float(2**31 + rank * 7 + call),
                                   dtype=torch.float64)
                stars[rank].sum(value)
                return value.tolist()

            want = [float(sum(2**31 + r * 7 + call for r in range(size)))] * length
            assert on_threads(size, vote) == [want] * size
    finally:
        _close_all(stars)


@pytest.mark.parametrize("gone", [0, 3])
def test_a_rank_that_closes_its_star_fails_every_other_rank_at_once(gone: int) -> None:
    """The loops close their star on a failure (with their groups), as a dead process's
    kernel does. Every other rank's vote must then fail within a second or so, not at the
    30 s timeout, saying the connection closed (a collective error, not a timeout): rank 0
    at its receive from the closed rank, the others at their receive from rank 0, whose
    failed star closed every connection."""

    size = 4
    stars = _stars(size, timeout=30.0)

    def close() -> None:
        time.sleep(0.3)  # the others are waiting in the vote by now
        stars[gone].close()

    try:
        results = [r for rank, r in enumerate(_votes_failing(stars, gone, close))
                   if rank != gone]
        assert all(isinstance(r, tuple) for r in results), results
        assert max(waited for waited, _ in results) < 3.0, results
        for _, text in results:
            assert "closed" in text, text
            assert "timed out" not in text, text
    finally:
        _close_all(stars)


def test_a_silent_rank_fails_the_vote_at_the_timeout_naming_it() -> None:
    """A frozen rank never sends: rank 0 fails at the timeout, saying "timed out" (the loops'
    collective_timeout) and naming the rank; the others, waiting on rank 0 since the same
    moment, fail then too (at their own timeout, or when rank 0's failed star closes)."""

    size, silent = 4, 2
    stars = _stars(size, timeout=0.5)

    try:
        results = _votes_failing(stars, silent, lambda: time.sleep(2.0))
        waited, text = results[0]
        assert 0.4 < waited < 3.0, results[0]
        assert "timed out" in text, text
        assert "rank 2" in text, text
        for rank in (1, 3):
            waited, text = results[rank]
            assert waited < 3.0, results[rank]
            assert "rank 0 closed" in text or "timed out" in text, text
    finally:
        _close_all(stars)


def test_a_message_of_another_size_fails_at_once_as_a_protocol_error() -> None:
    """A peer that sends two elements where rank 0 expects one (the ranks disagree on whether
    fingerprints ride in this vote) must fail the call at once, never sum the wrong bytes or
    wait for the rest until the timeout."""
    from aftershock.reference_impl._star import StarError

    stars = _stars(2, timeout=30.0)
    try:
        def vote(rank: int) -> Any:
            started = time.monotonic()
            try:
                stars[rank].sum(torch.ones(2 if rank == 1 else 1, dtype=torch.float64))
            except StarError as exc:
                return time.monotonic() - started, str(exc)
            return "no error"

        results = on_threads(2, vote)
        waited, text = results[0]
        assert waited < 3.0, results
        assert "protocol" in text, text
        assert "16 bytes" in text, text
        assert isinstance(results[1], tuple), results  # rank 0 closed: rank 1 fails too
    finally:
        _close_all(stars)


def test_strangers_are_refused_and_the_star_still_forms() -> None:
    """Rank 0 counts only hellos with the token it published, a rank in range and the group's
    size: a stray connection, a wrong token, a wrong size and a rank out of range are closed
    and not counted, and the real ranks still make a star that sums."""
    from aftershock.reference_impl._star import HELLO, MAGIC, Star

    size, store = 3, _store()
    zero: list[Any] = []
    thread = threading.Thread(target=lambda: zero.append(Star.connect(store, 0, size, 30.0)),
                              daemon=True)
    thread.start()
    store.wait(["star"])
    host, port, hexed = store.get("star").decode().split(" ")
    token = bytes.fromhex(hexed)
    refused = []
    for hello in (b"GET / HTTP/1.0\r\n\r\n" + b" " * HELLO.size,
                  HELLO.pack(MAGIC, b"x" * 16, 1, size),
                  HELLO.pack(MAGIC, token, 1, size + 1),
                  HELLO.pack(MAGIC, token, size, size)):
        stranger = socket.create_connection((host, int(port)), timeout=10)
        stranger.sendall(hello)
        refused.append(stranger)
    for stranger in refused:  # each is closed by rank 0 without a word
        try:
            assert stranger.recv(1) == b""
        except ConnectionResetError:
            pass  # closed with bytes of ours unread: the kernel resets instead
        finally:
            stranger.close()
    others = on_threads(size - 1, lambda i: Star.connect(store, i + 1, size, 30.0))
    thread.join(30)
    stars = [zero[0], *others]
    try:
        def vote(rank: int) -> float:
            value = torch.tensor([float(rank + 1)], dtype=torch.float64)
            stars[rank].sum(value)
            return float(value[0])

        assert on_threads(size, vote) == [6.0] * size
    finally:
        _close_all(stars)


def test_a_rank_that_never_comes_fails_the_rendezvous_at_the_timeout() -> None:
    """The star forms within the timeout or fails naming who did not come; a rank whose
    rank 0 never published waits no longer than the timeout either."""
    from aftershock.reference_impl._star import Star, StarError

    store = _store()
    results = on_threads(2, lambda rank: Star.connect(store, rank, 3, 0.5))
    assert isinstance(results[0], StarError), results
    assert "timed out" in str(results[0])
    assert "[2]" in str(results[0])
    _close_all(results)
    started = time.monotonic()
    with pytest.raises(StarError, match="timed out"):
        Star.connect(_store(), 1, 2, 0.5)
    assert time.monotonic() - started < 5.0


def test_a_foreign_value_under_the_key_is_named_not_trusted() -> None:
    from aftershock.reference_impl._star import Star, StarError

    store = _store()
    store.set("star", "not an address")
    with pytest.raises(StarError, match="not an address a star published"):
        Star.connect(store, 1, 2, 5.0)


def test_the_address_follows_gloo_socket_ifname(monkeypatch: Any) -> None:
    from aftershock.reference_impl._star import StarError, reachable_host

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert reachable_host() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(StarError, match="GLOO_SOCKET_IFNAME=nosuchif0"):
        reachable_host()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    host = reachable_host()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family):  # the host's name's, and bindable
        pass
