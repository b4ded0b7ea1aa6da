"""The HTTP streams, written by the router's one stream writer (``_streams.Pump``).

Real sockets end to end: a real HTTP server in front of a router whose workers this test
plays over socket pairs (``test_router.Worker``), and clients that read, stall or vanish.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from aftershock.reference_impl.serving import _wire
from aftershock.reference_impl.serving.router import Chunk, Router, _Request, http_server
from tests.serving.test_router import PROMPT, Worker, start

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served() -> Iterator[tuple[Router, list[Worker], int]]:
    workers: list[Worker] = []
    router = start(Router, workers)
    server = http_server(router)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield router, workers, server.server_address[1]
    finally:
        router.stop()
        server.shutdown()
        server.server_close()
        for worker in workers:
            worker.close()


def post(port: int, request_id: str, max_tokens: int, offset: int = 0, *,
         rcvbuf: int | None = None) -> socket.socket:
    """A streaming completion sent on a raw socket; the response is left to the caller."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window the server sees is small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "request_id": request_id, "offset": offset}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def events(sock: socket.socket) -> Iterator[dict[str, object] | str]:
    """The stream's events as the client reads them, until the server closes it (then the
    client's socket is closed too)."""
    response = http.client.HTTPResponse(sock)
    try:
        response.begin()
        assert response.status == 200
        for raw in iter(response.readline, b""):
            line = raw.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)
    finally:
        response.close()
        sock.close()


def request_of(router: Router, request_id: str) -> _Request:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with router._lock:
            request = router._requests.get(request_id)
            if request is not None and request.worker is not None:
                return request
        time.sleep(0.01)
    raise AssertionError(f"{request_id} was never assigned")


def worker_of(workers: list[Worker], request: _Request) -> Worker:
    return next(w for w in workers if w.index == request.worker)


def started(served: tuple[Router, list[Worker], int], request_id: str, max_tokens: int
            ) -> tuple[socket.socket, _Request, Worker, _wire.Add]:
    """A stream POSTed, its request assigned, and the Add its worker got."""
    router, workers, port = served
    sock = post(port, request_id, max_tokens)
    request = request_of(router, request_id)
    worker = worker_of(workers, request)
    return sock, request, worker, worker.add()


def test_an_http_stream_carries_what_router_stream_yields(served) -> None:
    router, _, port = served
    sock, request, worker, add = started(served, "r", 6)
    worker.tokens(router, add, 0, 4)
    worker.tokens(router, add, 4, 2)
    got = list(events(sock))
    want = [item for item in router.stream(request) if isinstance(item, Chunk)]
    assert [(e["choices"][0]["token_index"], e["choices"][0]["token_ids"],  # type: ignore[index]
             e["choices"][0]["logits_digest"], e["choices"][0]["finish_reason"])  # type: ignore[index]
            for e in got[:-1]] == [(c.index, [c.token], c.digest, "length" if c.last else None)
                                   for c in want]
    assert got[-1] == "[DONE]"
    # A re-POST from an offset gets the rest only.
    again = list(events(post(port, "r", 6, offset=4)))
    assert [e["choices"][0]["token_index"] for e in again[:-1]] == [4, 5]  # type: ignore[index]
    assert again[-1] == "[DONE]"


def test_a_client_that_does_not_read_holds_up_no_other_stream(served) -> None:
    router, workers, port = served
    stalled = post(port, "stalled", 900, rcvbuf=4096)
    request = request_of(router, "stalled")
    worker = worker_of(workers, request)
    add = worker.add()
    # Loopback's send buffer grows to megabytes: pin the server's side of this client small,
    # so that what the client leaves unread backs up in the router, not in the kernel.
    deadline = time.monotonic() + 10
    while True:
        with router._lock:
            attached = router._pump._streams.get(id(request), [])
        if attached:
            attached[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            break
        assert time.monotonic() < deadline, "the stream was never handed to the pump"
        time.sleep(0.01)
    for first in range(0, 900, 100):  # 900 events (~300 kB): more than the socket holds
        router._dispatch(worker.link, _wire.Outputs(tuple(
            (add.request_id, add.epoch, i, i % 256, f"d{i}", i == 899)
            for i in range(first, first + 100))))
    deadline = time.monotonic() + 10
    while not any(s.request is request and s.pending for s in router._pump._blocked):
        assert time.monotonic() < deadline, "the stalled client's stream never backed up"
        time.sleep(0.01)
    # Another client meanwhile streams to its end, on the same worker or the other one.
    other = post(port, "other", 4)
    second = request_of(router, "other")
    theirs = worker_of(workers, second)
    add2 = next(a for a in iter(theirs.add, None) if a.request_id == "other")
    theirs.tokens(router, add2, 0, 4)
    got = list(events(other))
    assert [e["choices"][0]["token_index"] for e in got[:-1]] == [0, 1, 2, 3]  # type: ignore[index]
    # The stalled one still gets all of its stream once it reads.
    stalled_events = list(events(stalled))
    assert [e["choices"][0]["token_index"] for e in stalled_events[:-1]] == list(range(900))  # type: ignore[index]
    assert stalled_events[-1] == "[DONE]"


def test_a_client_that_goes_away_ends_its_stream(served) -> None:
    router = served[0]
    sock, request, worker, add = started(served, "gone", 50)
    # It goes without a goodbye: a reset, so the server's next write fails.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    worker.tokens(router, add, 0, 1)
    stream = events(sock)
    first = next(stream)
    assert first["choices"][0]["token_index"] == 0  # type: ignore[index]
    stream.close()  # closes the socket
    deadline = time.monotonic() + 10
    first_token = 1
    while True:
        worker.tokens(router, add, first_token, 1)
        first_token += 1
        with router._lock:
            attached = id(request) in router._pump._streams
        if not attached:
            break
        assert first_token < 49, "the stream outlived its client"
        assert time.monotonic() < deadline, "the stream outlived its client"
        time.sleep(0.02)


def test_stopping_the_router_ends_every_stream_with_an_error(served) -> None:
    router = served[0]
    sock, _, worker, add = started(served, "cut", 20)
    worker.tokens(router, add, 0, 3)
    stream = events(sock)
    seen = [next(stream) for _ in range(3)]
    assert [e["choices"][0]["token_index"] for e in seen] == [0, 1, 2]  # type: ignore[index]
    router.stop()
    rest = list(stream)  # ends: the server closed the connection
    assert len(rest) == 1
    assert rest[0]["error"]["message"] == "the server is shutting down"  # type: ignore[index]
    # Nothing left to send: the writer's thread ends, as the router's other threads do ...
    deadline = time.monotonic() + 5
    while router._pump._running:
        assert time.monotonic() < deadline, "the stream writer outlived the router"
        time.sleep(0.01)
    # ... and a stream asked for afterwards (a re-POST of a known request) still ends.
    again = list(events(post(served[2], "cut", 20, offset=3)))
    assert again == [{"error": {"message": "the server is shutting down",
                                "type": "worker_failed", "param": None}}]
