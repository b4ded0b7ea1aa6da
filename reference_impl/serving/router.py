"""The serving router: an OpenAI-style HTTP API in front of engine workers, and their keeper.

The router owns every request from the moment it is journaled until its last token is
streamed. Workers only compute: each holds the requests the router assigned to it and
sends back the tokens of every engine step. The router decides which tokens count.

Scheduling. Prefix affinity with bounded load: requests whose first prompt block (the
engine's KV block size, in tokens) is the same go to the same worker while it is healthy
and holds fewer than ``AFFINITY_SLACK`` more requests than the least loaded healthy worker,
so that worker's prefix cache serves them. Otherwise the least loaded healthy worker (fewest
requests in flight). The bound matters: the batch-invariant kernel computes each sequence
of a step on its own, so a step's time grows with the requests in it, and four prefixes on
three workers with pure affinity put two thirds of the load on one worker and none on
another; a hit saves one prefill of the prefix, a hot spot costs every request on it. A
prompt shorter than one block has no cacheable prefix.

Health. A worker is declared failed, with ``cause``:

- ``worker_exit``: its process ended (the worker keeper sees it, or its link hits EOF and the
  process is gone);
- ``link_lost``: its link hit EOF or a reset while the process lives (``ss -K``), or the
  worker reconnected before the router noticed the break;
- ``heartbeat``: no heartbeat for ``dead_after`` seconds. Heartbeats come from their own
  thread in the worker, so a long engine step does not stop them; a frozen process does;
- ``wedged``: heartbeats arrive, the engine holds work, but its step counter has not moved
  for ``wedged_after`` seconds, and in that time the engine thread was blocked (neither on a
  CPU nor waiting for one, by the kernel's scheduler account that each heartbeat carries)
  for ``wedged_after``, or ran on a CPU that long. A step that waits for a CPU (a busy
  machine, a CPU quota) is slow, not stuck. A long prefill does not trip this either: the
  engine chunks it over steps (``EngineConfig.max_step_tokens`` prompt positions per
  step; a 512-token step took 0.05-0.8 s of CPU on a 2-core machine), while an engine
  stuck in one call (a hung device sync, a deadlock) blocks. ``wedged_after`` must exceed
  the CPU time of the longest single step. Only a busy worker can be wedged: an idle one
  makes no progress by design;
- ``xid``: the worker's GPU reported an Xid whose NVIDIA action is not ``none``
  (``aftershock.reference_impl.health.XidWatcher``); the worker reports it and exits. Xids with
  action
  ``none`` (63, 92, ...) are only logged by the worker. For ``drain_node`` (Xid 79: the GPU
  fell off the bus) the worker index is *drained*: the keeper does not respawn it and the
  router never assigns work to it again; in a real cluster that GPU needs a reboot or RMA,
  so capacity is down one worker until an operator acts. ``restart_app`` and ``reset_gpu``
  Xids are treated like a crash (the new process gets the GPU after the node agent reset it).

What happens to the failed worker's process: after ``heartbeat`` it is left alone (it may
be frozen or partitioned and come back; the router tells it to drop everything and it
rejoins as a fresh worker, with an empty engine); after ``wedged`` the keeper kills it
(its engine loop is stuck, it would never act on that message) and respawns it.

Recovery ``migrate``: every in-flight request of the failed worker is re-sent to a healthy
worker together with the tokens already emitted (``Engine.add(..., emitted=...)``): the new
worker re-prefills prompt + emitted tokens and continues at the next index, using its prefix
cache where it holds the same blocks. Policy: **always re-prefill, never restore a KV
snapshot**. Re-prefill needs nothing from the failed worker (which may be dead, frozen or
have corrupt memory), costs one prefill of at most ``max_seq`` tokens per request (tens of
ms for the reference model), and its result is exact: decoding is batch-invariant, so the
recomputed KV gives the same next token as the lost one. A KV snapshot would have to be
copied off the worker continuously, taking bandwidth on the failure-free path, to save that
one prefill. Requests that find no healthy worker wait, and are assigned when one is ready.

Fencing. Every assignment of a request to a worker has an epoch, unique and increasing. A
token is accepted only if it comes on the link the request is assigned to, carries that
assignment's epoch, and has index == the next index the request expects; anything else is
counted (``fenced_tokens``, ``dropped_tokens``) and dropped. A stale worker (frozen, then
woken; a link that broke and came back) can therefore never inject a token, even one that
was already on the wire when the router migrated the request.

Recovery ``fail_stop``: the baseline most servers have today. On any worker failure every
in-flight request is ended with an error and every worker is restarted cold. The client
must retry; a retry starts the request from scratch (token 0), even under its old
``request_id``.

Idempotency: re-POSTing a known ``request_id`` never starts a second generation of a
request that is running or finished; it streams that request from ``offset``. Only a
request that ended in an *error* (fail_stop, an engine refusal) is started again from
scratch by a re-POST: its first generation is over, and a retry is what the client asks.

The decisions the checks exist to police are small methods (``_refusal_locked``: which
tokens count; ``_move_locked``: what happens to a failed worker's request; ``_restore``:
what a restarted router resumes). Deliberately broken variants of them, which show the
harness's checks failing, live in the tests (``tests/serving/broken/``), never here.

The journal (``journal.py``): a request is journaled before it is acknowledged, tokens and
a request's end before any stream sees them; see there for fsync. Records are posted under
the router's lock (so they reach the file in the order of the decisions) and written by the
journal's own thread, never under the lock: a write that waits for the disk holds up no
heartbeat, no other worker's tokens and no new request, only the visibility of what it
carries. A request's log holds every accepted token at once (migration re-sends them);
``shown`` says how many of them are written and so streamable. A router started on an
existing journal serves finished requests from it and resumes unfinished ones.

Standard library only (plus the probe): the router starts in milliseconds and never
imports torch. Tokens are bytes, exactly as ``model.encode`` / ``model.decode``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from aftershock.faults.contract import COMMANDS_ENV
from aftershock.harness import probe
from aftershock.reference_impl.serving import _wire
from aftershock.reference_impl.serving._streams import Pump, Stream
from aftershock.reference_impl.serving.journal import (
    Journal,
    Replay,
    finish_record,
    request_record,
    token_runs_record,
)

RECOVERIES = ("migrate", "fail_stop")
AFFINITY_KEYS = 4096  # prefixes remembered for affinity; more than any worker's cache holds
AFFINITY_SLACK = 2  # affinity yields when its worker has this many more requests than the least


def encode(text: str) -> list[int]:
    """Prompt text -> token ids: its UTF-8 bytes (``model.encode``)."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int] | tuple[int, ...]) -> str:
    """Token ids -> text, one character per byte (``model.decode``: latin-1)."""
    return bytes(tokens).decode("latin-1")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    workers: int = 3  # worker indices 0..workers-1
    dead_after: float = 1.0  # no heartbeat for this long: the worker is dead
    wedged_after: float = 2.0  # busy, step counter unchanged this long: wedged
    recovery: str = "migrate"  # migrate | fail_stop
    check_every: float = 0.05  # how often the health monitor looks

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.recovery not in RECOVERIES:
            raise ValueError(f"recovery {self.recovery!r} is not one of {RECOVERIES}")


class ApiError(Exception):
    """A request the API refuses: HTTP status, message, and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param}}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed token: ``position`` in the request's delivery log (== ``index`` unless
    the server is broken), the token's output ``index``, the digest of the logits row it was
    chosen from (``engine.logits_digest``; "" where unknown), and whether it is the last."""

    position: int
    index: int
    token: int
    digest: str
    last: bool


@dataclass(frozen=True, slots=True)
class End:
    error: str | None  # None: the request finished normally


class _Request:
    """Router-side state of one request; guarded by the router's lock."""

    def __init__(self, request_id: str, prompt: tuple[int, ...], max_tokens: int,
                 lock: threading.Lock) -> None:
        self.id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        # (index, token, logits digest) in the order streamed
        self.log: list[tuple[int, int, str]] = []
        self.expected = 0  # the next token index this request accepts
        self.finished = False
        self.error: str | None = None
        # What the journal holds of it, so what clients may see (durable before visible):
        self.recorded = False  # its `req` record: the request may be acknowledged
        self.shown = 0  # entries of `log` written: streams send these
        # Per entry of `log` shown: the journal's byte offset of the record holding it (-1:
        # no journal), sent with the token so a client can prove where it came from.
        self.offsets: list[int] = []
        self.over = False  # its `fin` record: streams may end
        self.worker: int | None = None  # assigned worker index (None: pending)
        self.link: _Link | None = None  # the link of that assignment
        self.epoch = 0  # of the current assignment; 0 = none
        self.moved_at: float | None = None  # when it was taken from a failed worker
        self.changed = threading.Condition(lock)

    @property
    def tokens(self) -> list[int]:
        return [token for _, token, _ in self.log]


class _Link:
    """One worker connection: a reader thread (in the router) and a writer thread."""

    def __init__(self, link_id: int, sock: socket.socket) -> None:
        self.id = link_id
        self.sock = sock
        self.worker: int | None = None  # set by its Hello
        self.fenced = False  # the router gave this link up: nothing from it counts
        self.ended = threading.Event()  # EOF or error seen by the reader
        self._out: list[bytes | None] = []
        self._wake = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name=f"link{link_id}-tx",
                                        daemon=True)
        self._writer.start()

    def post(self, message: _wire.Message) -> None:
        """Queue a message; never blocks (a frozen worker must not stall the router)."""
        with self._wake:
            self._out.append(_wire.encode(message))
            self._wake.notify()

    def shutdown(self) -> None:
        """Break the link: the reader sees EOF and closes the socket."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._out:
                    self._wake.wait()
                batch, self._out = self._out, []
            if None in batch:
                return
            try:
                self.sock.sendall(b"".join(b for b in batch if b is not None))
            except OSError:
                self.shutdown()  # the reader turns this into a failure, in one place
                return

    def stop_writer(self) -> None:
        with self._wake:
            self._out.append(None)
            self._wake.notify()


# A record's mark (``Journal.post``): what the router may show once the record is written:
# (request, "req", 0) it may be acknowledged, (request, "tok", n) the first n entries of its
# log may be streamed, (request, "fin", 0) its streams may end.
_Mark = tuple[_Request, str, int]


@dataclass
class _Slot:
    """A worker index: the process that fills it now, and what the router knows of it."""

    index: int
    state: str = "starting"  # starting | ready | failed | restarting | drained | stopped
    pid: int | None = None
    generation: int = 0
    link: _Link | None = None
    requests: set[str] = field(default_factory=set)
    last_heartbeat: float = 0.0
    progress_at: float = 0.0  # last time its step counter moved, or it was idle
    # The engine thread's scheduler account (cpu, wait) at the last beat and at progress_at.
    engine: tuple[float, float] | None = None
    engine_at_progress: tuple[float, float] | None = None
    steps: int = 0
    busy: bool = False
    failures: int = 0
    ever_ready: bool = False


class FaultPoints(Protocol):
    """The harness's in-process fault engine (``aftershock.faults.inproc.Engine``), as the router
    uses it."""

    def at_point(self, step: int, phase: str) -> None: ...


def fault_points() -> FaultPoints | None:
    """The in-process fault engine for the router's own fault points, or None outside the
    harness. Not ``probe.install``: that routes torch's collectives too, and the router never
    imports torch."""
    path = os.environ.get(COMMANDS_ENV)
    if not probe.enabled() or not path:
        return None
    from aftershock.faults import inproc

    engine: FaultPoints = inproc.Engine(inproc.Inbox(path), rank=lambda: None, emit=probe.emit)
    return engine


_log_lock = threading.Lock()


def _log(message: str) -> None:
    with _log_lock:
        print(f"[router] {message}", file=sys.stderr, flush=True)


class Router:
    """Requests, workers, journal. Every method is thread-safe."""

    def __init__(
        self,
        config: RouterConfig,
        journal: Journal | None = None,
        replayed: Replay | None = None,
        *,
        process_gone: Callable[[int], bool] | None = None,
        kill: Callable[[int], None] | None = None,
        restart_all: Callable[[], None] | None = None,
        faults: FaultPoints | None = None,
    ) -> None:
        self.config = config
        self._faults = faults
        self.journal = journal
        self._process_gone = process_gone or (lambda index: False)
        self._kill = kill or (lambda index: None)
        self._restart_all = restart_all or (lambda: None)
        self._lock = threading.Lock()
        self._slots = [_Slot(i) for i in range(config.workers)]
        self._requests: dict[str, _Request] = {}
        self._pending: list[str] = []  # request ids waiting for a healthy worker
        self._recovering: dict[int, set[str]] = {}  # failed worker -> requests still to move
        self._moved_from: dict[str, int] = {}  # pending request id -> the worker it left
        self._fail_stop_from: int | None = None  # fail_stop: the worker whose failure restarts
        self._fail_stop_began = 0.0
        self._affinity: dict[tuple[int, ...], int] = {}
        self._engine_stats: dict[int, dict[str, float]] = {}  # pid -> its engine's last counters
        self._epoch = 0
        self._links = 0
        self._model_id: str | None = None
        self._block_size: int | None = None
        self._max_seq: int | None = None
        self._counters = {"accepted": 0, "migrations": 0, "failures": 0, "fenced_tokens": 0,
                          "dropped_tokens": 0, "failed_requests": 0, "resumed_from_journal": 0,
                          "retried": 0}
        self._resume_latency: list[float] = []  # migration -> first token accepted, seconds
        self._stopping = False
        self.ready = threading.Event()  # every worker said hello once
        self._cpu_at_ready = 0.0  # process CPU time when it was: serving, not start-up
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        # The HTTP streams' writer; `sent`: a fault point once tokens went to clients.
        self._pump = Pump(self._lock, lambda: self._stopping,
                          sent=lambda: self._point("token_sent"))
        self._token_records = 0  # token records so far: the router's "step" for fault points
        if journal is not None:
            journal.listen(self._written, point=self._point)
        if replayed is not None:
            self._restore(replayed)

    # ------------------------------------------------------------------ journal
    def _point(self, name: str) -> None:
        """A fault point on the durability path of tokens: ``token_produced`` (a worker's
        tokens accepted, their record not yet posted), ``journal_appended`` (written, not
        fsynced), ``journal_synced`` (durable, not yet shown), ``token_sent`` (sent to
        clients). The step is the number of token records so far."""
        if self._faults is not None:
            self._faults.at_point(self._token_records, name)

    def _record_locked(self, record: dict[str, object], marks: list[_Mark]) -> None:
        """Journal ``record``; what its ``marks`` allow is shown once it is durable."""
        if self.journal is None:
            self._show_locked(marks)
        else:
            self.journal.post(record, marks)

    def _written(self, posted: list[tuple[object, int]]) -> None:
        """The journal made these records durable (its writer thread): each one's list of
        marks, and the byte offset of its record."""
        with self._lock:
            for marks, offset in posted:
                self._show_locked(marks, offset)  # type: ignore[arg-type]

    def _show_locked(self, marks: list[_Mark], offset: int = -1) -> None:
        for request, kind, shown in marks:
            if kind == "tok":
                if shown > len(request.offsets):
                    request.offsets.extend([offset] * (shown - len(request.offsets)))
                request.shown = max(request.shown, shown)
            elif kind == "fin":
                request.over = True
            else:
                request.recorded = True
            request.changed.notify_all()
            self._pump.changed_locked(request)

    # ------------------------------------------------------------------ journal replay
    def _restore(self, replayed: Replay) -> None:
        for old in replayed.requests.values():
            request = _Request(old.request_id, old.prompt, old.max_tokens, self._lock)
            request.log = [(index, token, digest) for index, (token, digest)
                           in enumerate(zip(old.tokens, old.digests, strict=True))]
            request.expected = len(old.tokens)
            request.finished = old.finished or len(old.tokens) >= old.max_tokens
            request.error = old.error
            request.recorded, request.shown, request.over = True, len(request.log), old.finished
            request.offsets = list(old.offsets)
            self._requests[request.id] = request
            if not request.finished:
                self._pending.append(request.id)
                self._counters["resumed_from_journal"] += 1
            elif not old.finished:  # all tokens were there, only `fin` was torn
                self._record_locked(finish_record(request.id), [(request, "fin", 0)])
        if replayed.requests:
            _log(f"journal: {len(replayed.requests)} requests, "
                 f"{self._counters['resumed_from_journal']} to resume, "
                 f"{replayed.ignored_bytes} torn bytes ignored")

    # ------------------------------------------------------------------ worker links
    def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Open the socket workers connect to and start the health monitor."""
        listener = socket.create_server((host, port))
        self._listener = listener
        for target, name in ((self._accept_loop, "links"), (self._monitor_loop, "monitor")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        address = listener.getsockname()
        return str(address[0]), int(address[1])

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed: shutting down
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopping:
                    sock.close()
                    continue
                self._links += 1
                link = _Link(self._links, sock)
            threading.Thread(target=self._serve_link, args=(link,), name=f"link{link.id}-rx",
                             daemon=True).start()

    def _serve_link(self, link: _Link) -> None:
        try:
            for message in _wire.read_messages(link.sock):
                if message is None:
                    continue
                if link.worker is None and not isinstance(message, _wire.Hello):
                    raise _wire.ProtocolError(f"{message.op} before hello")
                self._dispatch(link, message)
        except (OSError, _wire.ProtocolError) as exc:
            if not link.fenced and not self._stopping:
                _log(f"link {link.id} (worker {link.worker}): {exc}")
        finally:
            link.ended.set()
            link.stop_writer()
            with contextlib.suppress(OSError):
                link.sock.close()
            self._link_ended(link)

    def _dispatch(self, link: _Link, message: _wire.Message) -> None:
        if isinstance(message, _wire.Outputs):
            self._on_outputs(link, message)
        elif isinstance(message, _wire.Heartbeat):
            self._on_heartbeat(link, message)
        elif isinstance(message, _wire.Hello):
            self._on_hello(link, message)
        elif isinstance(message, _wire.Rejected):
            self._on_rejected(link, message)
        elif isinstance(message, _wire.XidReport):
            with self._lock:
                slot = self._slot_of(link)
                if slot is not None:
                    self._fail_locked(slot, "xid", code=message.code, action=message.action)
        else:
            raise _wire.ProtocolError(f"{message.op} is not a worker message")

    def _slot_of(self, link: _Link) -> _Slot | None:
        """The slot this link currently serves, or None for a stale or fenced link."""
        if link.worker is None or link.fenced:
            return None
        slot = self._slots[link.worker]
        return slot if slot.link is link else None

    def _on_hello(self, link: _Link, hello: _wire.Hello) -> None:
        with self._lock:
            if not 0 <= hello.worker < len(self._slots):
                raise _wire.ProtocolError(f"worker index {hello.worker} out of range")
            if self._model_id is not None and hello.model_id != self._model_id:
                # Migration between different weights would change tokens mid-request.
                raise _wire.ProtocolError(
                    f"worker {hello.worker} serves {hello.model_id}, the others "
                    f"{self._model_id}")
            slot = self._slots[hello.worker]
            # "restarting": fail_stop has condemned this worker's process and the keeper is
            # about to kill it; its link broke, so it reconnects, but work given to it now
            # would only fail a second time. Its replacement says hello once spawned.
            if slot.state in ("drained", "restarting") or self._stopping:
                link.fenced = True
                link.shutdown()
                return
            if slot.link is not None:
                self._fail_locked(slot, "link_lost", detail="the worker reconnected")
            self._model_id = hello.model_id
            self._block_size = hello.block_size
            self._max_seq = hello.max_seq
            now = time.monotonic()
            link.worker = hello.worker
            slot.link, slot.state, slot.pid = link, "ready", hello.pid
            slot.generation = hello.generation
            slot.last_heartbeat = slot.progress_at = now
            slot.engine = slot.engine_at_progress = None
            slot.steps, slot.busy, slot.ever_ready = -1, False, True
            _log(f"worker {hello.worker} ready (pid {hello.pid}, generation "
                 f"{hello.generation}, link {link.id})")
            self._assign_pending_locked()
            if all(s.ever_ready or s.state == "drained" for s in self._slots):
                if not self.ready.is_set():
                    self._cpu_at_ready = time.process_time()
                self.ready.set()
            self._check_full_strength_locked()

    def _on_heartbeat(self, link: _Link, beat: _wire.Heartbeat) -> None:
        with self._lock:
            slot = self._slot_of(link)
            if slot is None:
                return
            now = time.monotonic()
            slot.last_heartbeat = now
            slot.engine = (None if beat.engine_cpu_s is None or beat.engine_wait_s is None
                           else (beat.engine_cpu_s, beat.engine_wait_s))
            if beat.steps != slot.steps or not beat.busy or not slot.busy:
                slot.progress_at, slot.engine_at_progress = now, slot.engine
            slot.steps, slot.busy = beat.steps, beat.busy
            if slot.pid is not None:
                self._engine_stats[slot.pid] = dict(beat.stats)

    def _on_rejected(self, link: _Link, message: _wire.Rejected) -> None:
        with self._lock:
            request = self._requests.get(message.request_id)
            slot = self._slot_of(link)
            if request is None or slot is None or request.epoch != message.epoch:
                return
            slot.requests.discard(request.id)
            self._finish_locked(request, error=f"the engine refused it: {message.message}")

    def _refusal_locked(self, link: _Link, request: _Request, epoch: int,
                        index: int) -> str | None:
        """Why a token is not accepted (the counter it goes to), or None to accept it.
        Fencing: it must come on the link of the request's current assignment, with that
        assignment's epoch; and it must be the next index of an unfinished request."""
        if link.fenced or request.link is not link or epoch != request.epoch:
            return "fenced_tokens"
        if request.finished or index != request.expected:
            return "dropped_tokens"
        return None

    def _on_outputs(self, link: _Link, message: _wire.Outputs) -> None:
        with self._lock:
            now = time.monotonic()
            accepted: dict[str, list[tuple[int, int, str, bool]]] = {}
            for request_id, epoch, index, token, digest, finished in message.items:
                request = self._requests.get(request_id)
                refused = ("dropped_tokens" if request is None
                           else self._refusal_locked(link, request, epoch, index))
                if request is None or refused is not None:
                    self._counters[refused or "dropped_tokens"] += 1
                    continue
                request.expected = index + 1
                accepted.setdefault(request_id, []).append((index, token, digest, finished))
            if not accepted:
                return
            # One record for the step, posted before any `fin` it causes; streams see the
            # tokens once it is written (_show_locked), a migration right away (the log).
            record = token_runs_record([(rid, items[0][0], [t for _, t, _, _ in items],
                                         [d for _, _, d, _ in items])
                                        for rid, items in accepted.items()]
                                       ) if self.journal is not None else {}
            self._token_records += 1
            self._point("token_produced")
            marks: list[_Mark] = []
            done: list[_Request] = []
            for request_id, items in accepted.items():
                request = self._requests[request_id]
                if request.moved_at is not None:
                    self._resume_latency.append(now - request.moved_at)
                    request.moved_at = None
                request.log.extend((index, token, digest) for index, token, digest, _ in items)
                marks.append((request, "tok", len(request.log)))
                if (any(f for _, _, _, f in items)
                        or request.expected >= request.max_tokens):
                    done.append(request)
            self._record_locked(record, marks)
            for request in done:
                if request.worker is not None:
                    self._slots[request.worker].requests.discard(request.id)
                self._finish_locked(request)

    def _link_ended(self, link: _Link) -> None:
        with self._lock:
            slot = self._slot_of(link)
            if slot is None:
                return
        # A SIGKILLed worker's socket is closed by the kernel while the process is still
        # being torn down: give the exit a moment to show before blaming the link.
        gone = False
        deadline = time.monotonic() + 0.2
        while not gone and time.monotonic() < deadline:
            gone = self._process_gone(slot.index)
            if not gone:
                time.sleep(0.01)
        with self._lock:
            if self._slot_of(link) is slot:
                self._fail_locked(slot, "worker_exit" if gone else "link_lost")

    # ------------------------------------------------------------------ worker keeper hooks
    def worker_started(self, index: int, pid: int, generation: int) -> None:
        """The worker keeper (``server.WorkerKeeper``) spawned a process for ``index``."""
        probe.emit("worker_started", worker=index, pid=pid, generation=generation)
        with self._lock:
            slot = self._slots[index]
            if slot.state != "drained":
                slot.state = "starting" if slot.link is None else slot.state
                slot.pid, slot.generation = pid, generation

    def worker_exited(self, index: int, returncode: int) -> None:
        """The worker keeper saw the process of ``index`` end."""
        with self._lock:
            link = self._slots[index].link
        if link is not None:
            link.ended.wait(0.2)  # let the reader drain what the worker said last (an Xid)
        with self._lock:
            slot = self._slots[index]
            if slot.link is not None and slot.link is link:
                self._fail_locked(slot, "worker_exit", returncode=returncode)
            if slot.state not in ("drained", "stopped"):
                slot.state = "restarting" if slot.state == "restarting" else "failed"
            slot.pid = None

    def resuming(self) -> bool:
        """Requests moved off a failed worker are re-prefilling on healthy ones: assigned,
        no token since the move. (A moved request still waiting for any worker does not
        count: it needs the replacement.)"""
        with self._lock:
            return any(r.moved_at is not None and r.worker is not None and not r.finished
                       for r in self._requests.values())

    def drained(self, index: int) -> bool:
        with self._lock:
            return self._slots[index].state == "drained"

    # ------------------------------------------------------------------ health
    def _monitor_loop(self) -> None:
        while not self._stopping:
            time.sleep(self.config.check_every)
            with self._lock:
                now = time.monotonic()
                for slot in self._slots:
                    if slot.state != "ready" or slot.link is None:
                        continue
                    silent = now - slot.last_heartbeat
                    if silent > self.config.dead_after:
                        self._fail_locked(slot, "heartbeat", silent_s=round(silent, 3))
                    elif slot.busy and now - slot.progress_at > self.config.wedged_after:
                        stuck = self._stuck(slot, now)
                        if stuck is not None:
                            self._fail_locked(slot, "wedged", steps=slot.steps, **stuck)

    def _stuck(self, slot: _Slot, now: float) -> dict[str, float] | None:
        """How a busy engine whose step counter has not moved for ``wedged_after`` spent that
        time, if it is wedged; None if it is only starved. Wedged: blocked (neither on a CPU
        nor waiting for one) for ``wedged_after``, or on a CPU that long without finishing a
        step. A step that waits on the run queue (a busy machine, a CPU quota) is slow, not
        stuck. Without the kernel's account, every second counts as blocked."""
        stuck = now - slot.progress_at
        ran = waited = 0.0
        if slot.engine is not None and slot.engine_at_progress is not None:
            ran = slot.engine[0] - slot.engine_at_progress[0]
            waited = slot.engine[1] - slot.engine_at_progress[1]
        blocked = stuck - ran - waited
        limit = self.config.wedged_after
        if blocked <= limit and ran <= limit:
            return None
        return {"stuck_s": round(stuck, 3), "cpu_s": round(ran, 3),
                "cpu_wait_s": round(waited, 3), "blocked_s": round(blocked, 3)}

    def _fail_locked(self, slot: _Slot, cause: str, **detail: Any) -> None:
        link = slot.link
        if link is None or link.fenced or self._stopping:
            return
        link.fenced = True  # from here on, nothing from this link counts
        slot.link = None
        slot.failures += 1
        self._counters["failures"] += 1
        drained = cause == "xid" and detail.get("action") == "drain_node"
        slot.state = "drained" if drained else "failed"
        in_flight = sorted(slot.requests)
        slot.requests = set()
        probe.detected(cause, worker=slot.index, pid=slot.pid, generation=slot.generation,
                       requests=in_flight, **detail)
        _log(f"worker {slot.index} failed ({cause}{', drained' if drained else ''}): "
             f"{len(in_flight)} requests in flight")
        if cause in ("heartbeat", "wedged"):
            # It may still be alive: tell it to drop everything and come back fresh. Its
            # link stays open so whatever it sends meanwhile arrives, and is fenced.
            link.post(_wire.Reset(cause))
        else:
            link.shutdown()
        if cause == "wedged":
            self._kill(slot.index)  # its engine loop is stuck; it would never read the Reset
        if self.config.recovery == "fail_stop":
            self._fail_stop_locked(slot, cause)
            return
        now = time.monotonic()
        self._recovering[slot.index] = self._recovering.get(slot.index, set()) | set(in_flight)
        for request_id in in_flight:
            self._move_locked(self._requests[request_id], slot.index, now)
        self._check_recovered_locked(slot.index)

    def _move_locked(self, request: _Request, failed: int, now: float) -> None:
        """Migrate ``request`` off failed worker ``failed``: to a healthy worker, with the
        tokens it has emitted, or to the pending queue until one is ready."""
        request.worker, request.link, request.epoch = None, None, 0
        request.moved_at = now
        self._assign_locked(request, moved_from=failed)

    def _fail_stop_locked(self, failed: _Slot, cause: str) -> None:
        """The baseline: error out everything, restart every worker cold."""
        message = (f"worker {failed.index} failed ({cause}); the server restarts all "
                   "workers; retry the request")
        for request in self._requests.values():
            if not request.finished:
                request.worker, request.link = None, None
                self._finish_locked(request, error=message)
        self._pending.clear()
        for slot in self._slots:
            if slot.state == "drained":
                continue
            if slot.link is not None:
                slot.link.fenced = True
                slot.link.shutdown()
                slot.link = None
            slot.requests = set()
            slot.state = "restarting"
            slot.ever_ready = False
        if self._fail_stop_from is None:
            self._fail_stop_from = failed.index
            self._fail_stop_began = time.monotonic()
        self._restart_all()

    def _check_full_strength_locked(self) -> None:
        if self._fail_stop_from is None:
            return
        if all(s.state in ("ready", "drained") for s in self._slots):
            probe.recovered(worker=self._fail_stop_from, recovery="fail_stop",
                            took_s=round(time.monotonic() - self._fail_stop_began, 3))
            self._fail_stop_from = None

    def _check_recovered_locked(self, index: int) -> None:
        left = self._recovering.get(index)
        if left is not None and not left:
            del self._recovering[index]
            probe.recovered(worker=index)

    # ------------------------------------------------------------------ scheduling
    def _healthy_locked(self) -> list[_Slot]:
        return [s for s in self._slots
                if s.state == "ready" and s.link is not None and not s.link.fenced]

    def _choose_locked(self, prompt: tuple[int, ...]) -> _Slot | None:
        healthy = self._healthy_locked()
        if not healthy:
            return None
        block = self._block_size or 0
        key = prompt[:block] if block and len(prompt) >= block else None
        chosen = min(healthy, key=lambda s: (len(s.requests), s.index))
        if key is not None:
            index = self._affinity.get(key)
            for slot in healthy:
                if slot.index == index:
                    if len(slot.requests) < len(chosen.requests) + AFFINITY_SLACK:
                        return slot
                    return chosen  # too hot: overflow, the affinity stays where the cache is
        if key is not None:
            self._affinity[key] = chosen.index
            if len(self._affinity) > AFFINITY_KEYS:
                del self._affinity[next(iter(self._affinity))]  # the oldest prefix
        return chosen

    def _assign_locked(self, request: _Request, moved_from: int | None = None) -> bool:
        slot = self._choose_locked(request.prompt)
        if slot is None or slot.link is None:
            if request.id not in self._pending:
                self._pending.append(request.id)
            if moved_from is not None:
                self._moved_from[request.id] = moved_from
            return False
        self._epoch += 1
        request.worker, request.link, request.epoch = slot.index, slot.link, self._epoch
        slot.requests.add(request.id)
        # What the new worker re-prefills after the prompt: the tokens before the next index
        # the request expects, i.e. all it has emitted (none for a new request).
        emitted = tuple(request.tokens[: request.expected])
        slot.link.post(_wire.Add(request.id, self._epoch, request.prompt, request.max_tokens,
                                 emitted))
        moved_from = self._moved_from.pop(request.id, moved_from)
        if moved_from is not None:
            self._counters["migrations"] += 1
            probe.emit("request_migrated", request_id=request.id, from_worker=moved_from,
                       to_worker=slot.index, emitted=len(emitted), epoch=self._epoch)
            left = self._recovering.get(moved_from)
            if left is not None:
                left.discard(request.id)
                self._check_recovered_locked(moved_from)
        return True

    def _assign_pending_locked(self) -> None:
        waiting, self._pending = self._pending, []
        for request_id in waiting:
            request = self._requests[request_id]
            if not request.finished:
                self._assign_locked(request)

    def _finish_locked(self, request: _Request, error: str | None = None) -> None:
        if request.finished:
            return
        request.finished, request.error = True, error
        if error is not None:
            self._counters["failed_requests"] += 1
        self._record_locked(finish_record(request.id, error), [(request, "fin", 0)])

    # ------------------------------------------------------------------ the API
    def submit(self, request_id: str | None, prompt: str, max_tokens: int, *,
               resume: bool = False) -> _Request:
        """Accept a request (journaled first), or return the known one with this id.
        ``resume``: only the known one, running or finished (a client that never submits
        twice: what the server acknowledged, it must still have); 404 otherwise."""
        tokens = tuple(encode(prompt))
        with self._lock:
            known = self._requests.get(request_id) if request_id is not None else None
            if resume and (known is None or known.error is not None):
                raise ApiError(404, f"request_id {request_id!r} is not known" + (
                    "" if known is None else f": it ended in an error ({known.error})"),
                    "request_id", kind="not_found")
            request = self._accept_locked(request_id, tokens, max_tokens)
        return self._recorded(request)

    def _accept_locked(self, request_id: str | None, tokens: tuple[int, ...],
                       max_tokens: int) -> _Request:
        """A new request (posted to the journal and assigned), or the known one."""
        if request_id is not None and request_id in self._requests:
            known = self._requests[request_id]
            if known.prompt != tokens:
                raise ApiError(409, f"request_id {request_id!r} is known with another "
                               "prompt", "prompt")
            if known.max_tokens != max_tokens:
                raise ApiError(409, f"request_id {request_id!r} is known with max_tokens "
                               f"{known.max_tokens}, not {max_tokens}", "max_tokens")
            if known.error is None:
                return known  # running or done: never a second generation
        if self._stopping:
            raise ApiError(503, "the server is shutting down", kind="unavailable")
        if not self._healthy_locked():
            raise ApiError(503, "no worker is ready", kind="unavailable")
        if not tokens:
            raise ApiError(400, "prompt must not be empty", "prompt")
        limit = self._max_seq or 0
        if len(tokens) + max_tokens > limit:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) + max_tokens "
                           f"({max_tokens}) exceeds the model's {limit} positions",
                           "max_tokens")
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        retry = self._requests.get(request_id)
        request = _Request(request_id, tokens, max_tokens, self._lock)
        # Acknowledged (submit returns) only once written; its worker may start at once:
        # its tokens are posted after this record, so none is shown before it.
        self._record_locked(request_record(request_id, tokens, max_tokens),
                            [(request, "req", 0)])
        self._requests[request_id] = request
        self._counters["retried" if retry is not None else "accepted"] += 1
        if retry is not None:  # streams still reading the errored one get its end
            retry.changed.notify_all()
            self._pump.changed_locked(retry)
        self._assign_locked(request)
        return request

    def _recorded(self, request: _Request) -> _Request:
        """``request`` once the journal holds it (what a client is told it may rely on)."""
        with self._lock:
            while not request.recorded:
                if self._stopping:
                    raise ApiError(503, "the server is shutting down", kind="unavailable")
                if self.journal is not None and self.journal.failed is not None:
                    raise ApiError(503, f"the journal failed: {self.journal.failed}",
                                   kind="unavailable")
                request.changed.wait(timeout=0.5)
        return request

    def stream(self, request: _Request, offset: int = 0) -> Iterator[Chunk | End]:
        """The request's tokens from position ``offset``, live, then its End."""
        position = offset
        while True:
            with self._lock:
                # Only what the journal holds: `shown` tokens, and the end once `over`.
                while (position >= request.shown and not request.over
                       and not self._stopping):
                    request.changed.wait(timeout=1.0)
                chunk = request.log[position:request.shown]
                done, error = request.over and request.shown >= len(request.log), request.error
                if self._stopping and not done:
                    done, error = True, "the server is shutting down"
            for n, (index, token, digest) in enumerate(chunk):
                last = done and error is None and n == len(chunk) - 1
                yield Chunk(position, index, token, digest, last)
                position += 1
            if done:
                yield End(error)
                return

    def subscribe(self, request: _Request, offset: int, sock: socket.socket,
                  render: Callable[[int, int, int, str, bool], bytes],
                  end: Callable[[str | None], bytes]) -> Stream:
        """What :meth:`stream` yields, from position ``offset``, written to ``sock`` by the
        router's stream writer (``_streams.Pump``) as ``render``/``end`` frame it; the
        stream's ``done`` is set once it is all sent or the client is gone."""
        stream = Stream(request, offset, sock, render, end)
        self._pump.attach(stream)
        return stream

    def model_id(self) -> str:
        with self._lock:
            return self._model_id or "aftershock-reference"

    def is_ready(self) -> bool:
        with self._lock:
            return bool(self._healthy_locked())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            summed = {name: 0.0 for name in _wire.ENGINE_COUNTERS}
            for counters in self._engine_stats.values():
                for name in _wire.ENGINE_COUNTERS:
                    summed[name] += float(counters.get(name, 0))
            engine: dict[str, float] = {k: int(v) for k, v in summed.items()}
            engine["prefix_hit_rate"] = round(
                summed["prefix_hit_tokens"] / summed["prompt_tokens"], 4
            ) if summed["prompt_tokens"] else 0.0
            requests = self._requests.values()
            finished = sum(r.finished for r in requests)
            latency = sorted(self._resume_latency)
            return {
                "model": self._model_id,
                "recovery": self.config.recovery,
                "workers": [
                    {"worker": s.index, "state": s.state, "pid": s.pid,
                     "generation": s.generation, "requests": len(s.requests),
                     "steps": max(s.steps, 0), "busy": s.busy, "failures": s.failures,
                     "link": s.link.id if s.link is not None else None}
                    for s in self._slots
                ],
                "requests": {
                    "total": len(self._requests),
                    "in_flight": len(self._requests) - finished,
                    "pending": len(self._pending),
                    "finished": finished,
                    "failed": self._counters["failed_requests"],
                    "accepted": self._counters["accepted"],
                    "retried": self._counters["retried"],
                    "resumed_from_journal": self._counters["resumed_from_journal"],
                },
                "migrations": self._counters["migrations"],
                "failures": self._counters["failures"],
                "fenced_tokens": self._counters["fenced_tokens"],
                "dropped_tokens": self._counters["dropped_tokens"],
                "migration_first_token_s": {
                    "count": len(latency),
                    "p50": round(latency[len(latency) // 2], 4) if latency else None,
                    "max": round(latency[-1], 4) if latency else None,
                },
                "engine": engine,
                # CPU of the router process (all its threads: HTTP, links, journal) since
                # every worker was ready: what serving cost it, without its start-up
                "router_cpu_ms": round((time.process_time() - self._cpu_at_ready) * 1e3),
                "journal": ({"enabled": True, **self.journal.stats().as_dict()}
                            if self.journal is not None else {"enabled": False}),
            }

    def quiesce(self) -> None:
        """Shutdown has begun: from now on a worker that dies is not a failure to act on.
        Only sets a flag, so a signal handler may call it."""
        self._stopping = True

    def stop(self) -> None:
        """Stop taking work, break every link, wake every stream."""
        with self._lock:
            self._stopping = True
            links = [s.link for s in self._slots if s.link is not None]
            for slot in self._slots:
                slot.state = "stopped" if slot.state != "drained" else slot.state
                slot.link = None
            for request in self._requests.values():
                request.changed.notify_all()
            self._pump.stopping_locked()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        for link in links:
            link.fenced = True
            link.shutdown()


def flat_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats()`` with the engine counters and the scalars at the top level, as the harness
    flattens ``GET /v1/stats`` for its ``serving_stats`` event (nested parts stay nested)."""
    flat = dict(stats["engine"])
    for key, value in stats.items():
        if key != "engine":
            flat.setdefault(key, value)
    return flat


# ---------------------------------------------------------------------- HTTP


@dataclass(frozen=True, slots=True)
class Completion:
    """A validated ``POST /v1/completions`` body."""

    prompt: str
    max_tokens: int
    stream: bool
    request_id: str | None
    offset: int
    resume: bool = False  # only stream a request the server knows (never start one)


def parse_completion(body: bytes, idempotency_key: str | None) -> Completion:
    """Validate a request body; ApiError(400) names the field at fault. Fields other than
    these (``model``, ...) are accepted and ignored, as OpenAI clients send them."""
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        raise ApiError(400, f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body must be a JSON object")
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    max_tokens = data.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}",
                       "max_tokens")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    offset = data.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ApiError(400, f"offset must be an integer >= 0, got {offset!r}", "offset")
    if offset > max_tokens:
        raise ApiError(400, f"offset {offset} is beyond max_tokens {max_tokens}", "offset")
    request_id = data.get("request_id")
    if request_id is not None and (not isinstance(request_id, str)
                                   or not 0 < len(request_id) <= 200):
        raise ApiError(400, "request_id must be a string of 1 to 200 characters",
                       "request_id")
    if idempotency_key is not None:
        if request_id is not None and request_id != idempotency_key:
            raise ApiError(400, f"request_id {request_id!r} differs from the Idempotency-Key "
                           f"header {idempotency_key!r}", "request_id")
        request_id = idempotency_key
    resume = data.get("resume", False)
    if not isinstance(resume, bool):
        raise ApiError(400, f"resume must be true or false, got {resume!r}", "resume")
    if resume and request_id is None:
        raise ApiError(400, "resume needs a request_id (or an Idempotency-Key)", "resume")
    return Completion(prompt, max_tokens, stream, request_id, offset, resume)


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer
    server_version = "aftershock-serving/0.1"
    protocol_version = "HTTP/1.0"  # a stream ends when the connection closes; no chunking

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the failure log the tests read

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        router = self.server.router
        if self.path == "/health/live":
            self._json(200, {"status": "live"})
        elif self.path == "/health/ready":
            # Started (every worker came up once, as `serving_ready` says) and able to serve
            # now. Any one healthy worker can serve, but a load let in before the others are
            # up would run on that one alone.
            ready = router.ready.is_set() and router.is_ready()
            self._json(200 if ready else 503, {"status": "ready" if ready else "not ready"})
        elif self.path == "/v1/stats":
            self._json(200, router.stats())
        else:
            self._json(404, ApiError(404, f"no route {self.path}", kind="not_found").body())

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._json(404, ApiError(404, f"no route {self.path}", kind="not_found").body())
            return
        router = self.server.router
        try:
            length = int(self.headers.get("Content-Length") or 0)
            completion = parse_completion(self.rfile.read(length),
                                          self.headers.get("Idempotency-Key"))
            request = router.submit(completion.request_id, completion.prompt,
                                    completion.max_tokens, resume=completion.resume)
        except ApiError as exc:
            self._json(exc.status, exc.body())
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if completion.stream:
                self._stream(router, request, completion.offset)
            else:
                self._whole(router, request, completion.offset)

    def _stream(self, router: Router, request: _Request, offset: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Request-Id", request.id)
        self.end_headers()
        self.wfile.flush()
        # The router's stream writer sends the events; this thread only waits for the end.
        stream = router.subscribe(request, offset, self.connection,
                                  token_event(request.id, router.model_id(), request.offsets,
                                              router.journal.writer_at
                                              if router.journal is not None else None),
                                  end_event)
        stream.done.wait()

    def _whole(self, router: Router, request: _Request, offset: int) -> None:
        tokens: list[int] = []
        indices: list[int] = []
        digests: list[str | None] = []
        for item in router.stream(request, offset):
            if isinstance(item, Chunk):
                tokens.append(item.token)
                indices.append(item.index)
                digests.append(item.digest or None)
            elif item.error is not None:
                self._json(503, ApiError(503, item.error, kind="worker_failed").body())
                return
        self._json(200, {
            "id": request.id, "object": "text_completion", "created": int(time.time()),
            "model": router.model_id(),
            "choices": [{"index": 0, "text": decode(tokens), "token_ids": tokens,
                         "token_indices": indices, "logits_digests": digests,
                         "offset": offset,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(request.prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(request.prompt) + len(tokens)},
        })


def token_event(request_id: str, model: str, offsets: list[int] | None = None,
                writer_at: Callable[[int], str | None] | None = None
                ) -> Callable[[int, int, int, str, bool], bytes]:
    """The server-sent event of one streamed token of ``request_id``, as
    :meth:`Router.subscribe` wants it framed. ``offsets``: the request's journal offsets per
    position (``_Request.offsets``; set before a position is shown), sent as
    ``journal_offset``: where the journal holds the token, for the client to check;
    ``writer_at``: the writer its record names (``Journal.writer_at``), sent as
    ``journal_writer``."""

    def render(position: int, index: int, token: int, digest: str, last: bool) -> bytes:
        where = offsets[position] if offsets is not None and position < len(offsets) else -1
        writer = writer_at(where) if writer_at is not None and where >= 0 else None
        body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "text": decode([token]), "token_ids": [token],
                             "token_index": index, "logits_digest": digest or None,
                             "journal_offset": where if where >= 0 else None,
                             "journal_writer": writer,
                             "finish_reason": "length" if last else None}]}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    return render


def end_event(error: str | None) -> bytes:
    """The last event of a stream: ``[DONE]``, or the error it ended with."""
    if error is None:
        return b"data: [DONE]\n\n"
    body = ApiError(503, error, kind="worker_failed").body()
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True  # a stream's thread must not hold the process at shutdown
    allow_reuse_address = True
    router: Router


def http_server(router: Router, host: str = "127.0.0.1", port: int = 0, *,
                sock: socket.socket | None = None) -> _HttpServer:
    """The HTTP API on ``host:port`` (0: a free port), or on ``sock``, a socket already
    listening (the launcher's, which outlives any one router); call ``serve_forever``."""
    if sock is None:
        server = _HttpServer((host, port), _Handler)
    else:
        server = _HttpServer(sock.getsockname(), _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.server_address = sock.getsockname()
    server.router = router
    return server
