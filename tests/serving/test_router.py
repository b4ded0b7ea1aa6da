"""The router's decisions without processes: fencing, migration, journal replay, resume.

Workers are played by this test over socket pairs (the router's side is a real ``_Link``),
so each decision is exercised on its own in milliseconds. Each test also runs the same
steps against the test-only broken variant of that decision
(``tests/serving/broken/sitecustomize.py``, applied here to a subclass) and shows the
difference a client would see: the variants the harness-level tests run are the ones
proven broken here.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.reference_impl.serving import _wire
from aftershock.reference_impl.serving import journal as journal_module
from aftershock.reference_impl.serving.journal import Journal, replay
from aftershock.reference_impl.serving.router import (
    Chunk,
    End,
    Router,
    RouterConfig,
    _Link,
    _Request,
    http_server,
)

pytestmark = pytest.mark.timeout(30)

PROMPT = "System: be brief. Question: what is seven times six?"  # longer than one block


def _variants() -> types.ModuleType:
    path = Path(__file__).resolve().parent / "broken" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("_broken_serving_variants", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no AFTERSHOCK_INJECT_BROKEN_SERVING here: patches nothing
    return module


VARIANTS = _variants()


def broken(variant: str) -> type[Router]:
    """A Router subclass with ``variant`` applied (the class, not the module, is patched)."""
    namespace = types.SimpleNamespace(Router=type(f"Router_{variant}", (Router,), {}))
    getattr(VARIANTS, variant)(namespace)
    return namespace.Router  # type: ignore[no-any-return]


class Worker:
    """The test's side of one worker link."""

    def __init__(self, router: Router, index: int, link_id: int) -> None:
        mine, theirs = socket.socketpair()
        theirs.settimeout(2.0)
        self.sock = theirs
        self.link = _Link(link_id, mine)
        self.index = index
        self._messages = _wire.read_messages(theirs)
        router._dispatch(self.link, _wire.Hello(index, 0, 1000 + link_id, "model", 16, 1024))

    def received(self) -> _wire.Message:
        message = next(self._messages)
        assert message is not None, "the router sent nothing"
        return message

    def add(self) -> _wire.Add:
        message = self.received()
        assert isinstance(message, _wire.Add), message
        return message

    def tokens(self, router: Router, add: _wire.Add, first: int, count: int, *,
               epoch: int | None = None) -> None:
        """Send ``count`` tokens of ``add``'s request from index ``first`` (token = index)."""
        items = tuple((add.request_id, add.epoch if epoch is None else epoch, i, 100 + i,
                       f"d{i}", i + 1 == add.max_tokens) for i in range(first, first + count))
        router._dispatch(self.link, _wire.Outputs(items))

    def close(self) -> None:
        self.link.stop_writer()
        self.link.shutdown()
        self.link.sock.close()
        self.sock.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for worker in made:
        worker.close()


def start(cls: type[Router], workers: list[Worker], journal: Journal | None = None,
          replayed: object = None) -> Router:
    router = cls(RouterConfig(workers=2), journal, replayed)  # type: ignore[arg-type]
    workers.extend(Worker(router, i, i + 1) for i in range(2))
    return router


def fail(router: Router, index: int) -> None:
    with router._lock:
        router._fail_locked(router._slots[index], "worker_exit")


def indices(router: Router, request: _Request, offset: int = 0) -> list[int]:
    return [c.index for c in router.stream(request, offset) if isinstance(c, Chunk)]


def end(router: Router, request: _Request) -> End:
    last = list(router.stream(request))[-1]
    assert isinstance(last, End)
    return last


def migrate(cls: type[Router], workers: list[Worker]) -> tuple[Router, _Request,
                                                                _wire.Add | None]:
    """A request streams 3 of 6 tokens on its worker, the worker fails; what moved."""
    router = start(cls, workers)
    request = router.submit("r", PROMPT, 6)
    first = next(w for w in workers if w.index == request.worker)
    other = next(w for w in workers if w is not first)
    add = first.add()
    first.tokens(router, add, 0, 3)
    fail(router, first.index)
    if request.finished:
        return router, request, None
    moved = other.add()
    assert moved.epoch > add.epoch
    return router, request, moved


def test_a_failed_workers_request_moves_with_its_emitted_tokens(workers) -> None:
    router, request, moved = migrate(Router, workers)
    assert moved is not None
    assert moved.emitted == (100, 101, 102)
    next(w for w in workers if w.index == request.worker).tokens(router, moved, 3, 3)
    assert indices(router, request) == list(range(6))
    assert end(router, request).error is None


def test_drop_inflight_ends_the_request_short_and_silently(workers) -> None:
    router, request, moved = migrate(broken("drop_inflight"), workers)
    assert moved is None
    assert indices(router, request) == [0, 1, 2]
    assert end(router, request).error is None  # a [DONE] after 3 of 6 tokens


def test_replay_from_zero_streams_the_moved_request_again(workers) -> None:
    router, request, moved = migrate(broken("replay_from_zero"), workers)
    assert moved is not None
    assert moved.emitted == ()
    next(w for w in workers if w.index == request.worker).tokens(router, moved, 0, 6)
    assert indices(router, request) == [0, 1, 2, 0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("variant", [None, "no_fencing"])
def test_a_stale_assignments_tokens_are_fenced(workers, variant: str | None) -> None:
    router, request, moved = migrate(broken(variant) if variant else Router, workers)
    assert moved is not None
    old = next(w for w in workers if w.index != request.worker)
    new = next(w for w in workers if w.index == request.worker)
    stale_epoch = moved.epoch - 1
    old.tokens(router, moved, 3, 1, epoch=stale_epoch)  # computed before the failure
    new.tokens(router, moved, 3, 3)
    if variant is None:
        assert indices(router, request) == list(range(6))
        assert router.stats()["fenced_tokens"] == 1
    else:  # the stale token counted, then the live one at the same index
        assert indices(router, request) == [0, 1, 2, 3, 3, 4, 5]
        assert router.stats()["fenced_tokens"] == 0


@pytest.mark.parametrize("variant", [None, "resume_from_zero"])
def test_a_restarted_router_resumes_journaled_requests(tmp_path: Path, workers,
                                                       variant: str | None) -> None:
    path = tmp_path / "j.wal"
    journal = Journal(path)
    journal.request("r", list(PROMPT.encode()), 6)
    journal.tokens("r", 0, [100, 101, 102], ["d0", "d1", "d2"])
    journal.close()
    journal, replayed = Journal.open(path)
    try:
        router = start(broken(variant) if variant else Router, workers, journal, replayed)
        (request,) = router._requests.values()
        worker = next(w for w in workers if w.index == request.worker)
        add = worker.add()
        if variant is None:
            assert add.emitted == (100, 101, 102)
            worker.tokens(router, add, 3, 3)
            assert indices(router, request, offset=3) == [3, 4, 5]
        else:
            assert add.emitted == ()
            worker.tokens(router, add, 0, 6)
            assert indices(router, request, offset=3) == [0, 1, 2, 3, 4, 5]
    finally:
        journal.close()


@pytest.mark.parametrize("variant", [None, "ignore_offset"])
def test_a_resuming_client_gets_the_stream_from_its_offset(workers,
                                                           variant: str | None) -> None:
    router = start(broken(variant) if variant else Router, workers)
    request = router.submit("r", PROMPT, 6)
    worker = next(w for w in workers if w.index == request.worker)
    worker.tokens(router, worker.add(), 0, 6)
    assert router.submit("r", PROMPT, 6) is request  # a re-POST: the same request
    assert indices(router, request, offset=4) == ([4, 5] if variant is None
                                                  else list(range(6)))


def test_http_ready_waits_for_every_worker_to_come_up_once(workers) -> None:
    """`GET /health/ready` is what a load waits for (examples/own_server): 200 only once every
    worker has come up. It used to answer 200 with one worker of two: on a slow host the load
    then ran on worker 1 alone, and the example's kill of worker 0 moved no request, so the
    scenario passed without the migration it exists to show."""
    import urllib.error
    import urllib.request

    router = Router(RouterConfig(workers=2))
    server = http_server(router)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health/ready"

    def status() -> int:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)

    try:
        assert status() == 503
        workers.append(Worker(router, 0, 1))
        assert router.is_ready()  # it can serve ...
        assert status() == 503  # ... but has not finished starting
        workers.append(Worker(router, 1, 2))
        assert status() == 200
        fail(router, 0)  # a worker lost later: still ready while one serves
        assert status() == 200
    finally:
        server.shutdown()
        server.server_close()


def test_fail_stop_takes_no_work_to_a_worker_it_is_restarting(workers) -> None:
    """After a fail-stop every worker is condemned; one whose link broke reconnects before
    the launcher kills it. It must get no work (it would fail again); its successor does."""
    router = Router(RouterConfig(workers=2, recovery="fail_stop"))
    workers.extend(Worker(router, i, i + 1) for i in range(2))
    request = router.submit("r", PROMPT, 6)
    fail(router, request.worker or 0)
    assert end(router, request).error is not None
    condemned = Worker(router, 1, 3)  # worker 1's old process, on a new link
    workers.append(condemned)
    assert not router.is_ready()
    assert condemned.link.fenced
    router.worker_started(1, 2001, 1)  # the launcher spawned its successor
    successor = Worker(router, 1, 4)
    workers.append(successor)
    assert router.is_ready()
    retried = router.submit("r", PROMPT, 6)  # the client's retry
    assert retried is not request
    assert successor.add().request_id == "r"


def test_the_router_is_resuming_while_a_moved_request_awaits_its_first_token(workers) -> None:
    """While a moved request re-prefills on a healthy worker the dead worker's replacement
    waits (server.WorkerKeeper._held): its `import torch` would take a core from it."""
    router, request, moved = migrate(Router, workers)
    assert moved is not None
    assert router.resuming()
    next(w for w in workers if w.index == request.worker).tokens(router, moved, 3, 1)
    assert not router.resuming()


def test_a_replacement_waits_for_the_moved_requests_but_not_for_ever() -> None:
    import argparse

    from aftershock.reference_impl.serving import server

    class Resuming:
        resuming_now = True

        def resuming(self) -> bool:
            return self.resuming_now

    args = argparse.Namespace(workers=1, seed=0, block_size=16, num_blocks=8, max_batch=1,
                              device="cpu", threads=1, heartbeat=0.1, no_checksums=False,
                              verify=None, step_sleep=0.0, dead_after=0.5,
                              no_batch_invariant=False)
    router = Resuming()
    keeper = server.WorkerKeeper(args, router, ("127.0.0.1", 1))  # type: ignore[arg-type]
    keeper._hold_until[0] = 100.0 + server.RESPAWN_HOLD_S  # a worker died at t=100
    assert keeper._held(0, 100.5)
    router.resuming_now = False
    assert not keeper._held(0, 100.5)  # the moved requests stream again: start it now
    router.resuming_now = True
    assert not keeper._held(0, 100.0 + server.RESPAWN_HOLD_S)  # held long enough: start it


# -- the journal off the router's lock: durable before visible ----------------------------------


class HeldWrites:
    """``os`` for the journal module, with its write(2) calls held while ``gate`` is clear:
    a disk that stalls (an append waiting for the batched fsync) at a moment the test picks."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a write is being held

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if not self.gate.is_set():
            self.waiting.set()
            assert self.gate.wait(10), "the test never let the write through"
        return os.write(fd, data)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldWrites:
    writes = HeldWrites()
    monkeypatch.setattr(journal_module, "os", writes)
    return writes


class ShownBeforeWritten(Router):
    """Test-only broken variant: tokens and ends are streamable once queued for the journal,
    not once written (a router crash then loses tokens a client already saw)."""

    def _record_locked(self, record: dict[str, object], marks: list) -> None:  # type: ignore[type-arg]
        self._show_locked(marks)
        super()._record_locked(record, marks)


def _collect(router: Router, request: _Request, into: list[Chunk | End],
             path: Path) -> threading.Thread:
    """Stream ``request`` on a thread; each item also records whether the journal held it
    when it was streamed."""

    def run() -> None:
        for item in router.stream(request):
            # A broken router may stream before even the request's record is written.
            held_now = replay(path).requests.get(request.id)
            on_disk = held_now is not None and (
                held_now.finished if isinstance(item, End) else len(held_now.tokens) > item.index)
            into.append(item)
            durable.append(on_disk)

    durable: list[bool] = []
    thread = threading.Thread(target=run, daemon=True)
    thread.durable = durable  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_a_stalled_journal_write_holds_up_no_other_decision(tmp_path: Path, workers,
                                                             held: HeldWrites) -> None:
    """An append that waits for the disk must not stall heartbeats, other workers' tokens
    or new requests: the router's lock is free while a record is being written."""
    journal = Journal(tmp_path / "j.wal")
    try:
        router = start(Router, workers, journal)
        request = router.submit("r", PROMPT, 6)
        worker = next(w for w in workers if w.index == request.worker)
        add = worker.add()
        held.gate.clear()
        sender = threading.Thread(target=worker.tokens, args=(router, add, 0, 3), daemon=True)
        sender.start()
        assert held.waiting.wait(5)
        free = router._lock.acquire(timeout=1.0)
        if free:
            router._lock.release()
        held.gate.set()
        sender.join(5)
        assert free, "the router's lock was held across a journal write"
    finally:
        held.gate.set()
        journal.close()


@pytest.mark.parametrize("cls", [Router, ShownBeforeWritten])
def test_a_token_is_streamed_only_once_its_record_is_written(tmp_path: Path, workers,
                                                             held: HeldWrites,
                                                             cls: type[Router]) -> None:
    """The journal's promise: a client never sees a token (or an end) the journal lacks,
    so a router crash loses nothing a client saw. Writes held: nothing new is streamed."""
    path = tmp_path / "j.wal"
    journal = Journal(path)
    try:
        router = start(cls, workers, journal)
        request = router.submit("r", PROMPT, 6)
        worker = next(w for w in workers if w.index == request.worker)
        add = worker.add()
        worker.tokens(router, add, 0, 2)
        seen: list[Chunk | End] = []
        reader = _collect(router, request, seen, path)
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.gate.clear()
        sender = threading.Thread(target=worker.tokens, args=(router, add, 2, 4), daemon=True)
        sender.start()  # tokens 2..5, the last one ends the request
        assert held.waiting.wait(5)
        # The correct router shows nothing while the write is held (0.3 s of nothing); the
        # broken one shows all of it, given the time a loaded machine may take.
        deadline = time.monotonic() + (0.3 if cls is Router else 5)
        while len(seen) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        early = list(seen)
        held.gate.set()
        sender.join(5)
        reader.join(5)
        assert [c.index for c in seen if isinstance(c, Chunk)] == list(range(6))
        assert isinstance(seen[-1], End)
        if cls is Router:
            assert [c.index for c in early if isinstance(c, Chunk)] == [0, 1]
            assert all(reader.durable)  # type: ignore[attr-defined]
        else:  # streamed while their record was still waiting for the disk
            assert [c.index for c in early if isinstance(c, Chunk)] == list(range(6))
            assert not all(reader.durable)  # type: ignore[attr-defined]
    finally:
        held.gate.set()
        journal.close()


def test_a_request_is_acknowledged_only_once_its_record_is_written(tmp_path: Path, workers,
                                                                   held: HeldWrites) -> None:
    path = tmp_path / "j.wal"
    journal = Journal(path)
    try:
        router = start(Router, workers, journal)
        held.gate.clear()
        accepted: list[_Request] = []
        client = threading.Thread(target=lambda: accepted.append(router.submit("r", PROMPT, 6)),
                                  daemon=True)
        client.start()
        assert held.waiting.wait(5)
        time.sleep(0.2)
        assert not accepted  # the client has no answer while its request is not journaled
        held.gate.set()
        client.join(5)
        assert accepted
        assert "r" in replay(path).requests
    finally:
        held.gate.set()
        journal.close()


@pytest.mark.parametrize(("ran", "waited", "wedged"), [
    (0.2, 2.7, False),  # starved: runnable all along, waiting for a CPU
    (0.01, 0.01, True),  # blocked: a deadlock, a hung device sync, a hang fault's sleep
    (2.5, 0.4, True),  # spinning: on a CPU for longer than wedged_after, no step done
    (None, None, True),  # no scheduler account: every stuck second counts as blocked
])
def test_a_stuck_step_is_wedged_only_when_it_is_not_waiting_for_a_cpu(
        workers, ran: float | None, waited: float | None, wedged: bool) -> None:
    """A busy worker's step counter stands still 3 s (wedged_after 2 s); the engine
    thread's scheduler account in its heartbeats tells a starved step from a stuck one."""
    router = start(Router, workers)
    worker = workers[0]
    account = (None, None) if ran is None else (100.0, 50.0)
    router._dispatch(worker.link, _wire.Heartbeat(7, True, 1, {}, *account))
    later = (None, None) if ran is None or waited is None else (100.0 + ran, 50.0 + waited)
    router._dispatch(worker.link, _wire.Heartbeat(7, True, 1, {}, *later))
    slot = router._slots[worker.index]
    stuck = router._stuck(slot, slot.progress_at + 3.0)
    assert (stuck is not None) == wedged, stuck
    if stuck is not None and ran is not None:
        assert stuck["blocked_s"] == pytest.approx(3.0 - ran - (waited or 0.0), abs=1e-3)
