"""The router's streams: one thread writes every client stream, instead of one per stream.

A streamed completion used to hold its HTTP thread awake for every token: the thread
slept on its request's condition, woke for each token the journal let through, took the
router's lock back, framed one event and wrote it. With ~24 streams and three workers
that is a thread wake (and a fight for the router's lock and the interpreter's) per token
per stream, the largest part of the router's CPU. Here the HTTP thread sends the
response's head, hands its socket to the :class:`Pump` and sleeps until the stream is over;
the pump's one thread wakes once for whatever the router made visible since it last
looked (one journal write shows the tokens of a whole engine step: several streams at
once), frames each stream's new events and writes them.

Writes never block the pump: the sockets it writes are non-blocking, and what a client
does not take stays queued on its stream (a slow or stopped client holds up nobody, only
its own stream); the pump retries those every ``RETRY_S`` while any is queued. A client
that went away (reset, broken pipe) ends its stream. What a stream may send is decided
under the router's lock, exactly as :meth:`Router.stream` decides it: the tokens the
journal holds (``shown``), then the end once ``over``; when the router stops, every
stream ends with an error event, and the pump's thread ends once nothing is left to send
(a stream asked for after that starts it again).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

RETRY_S = 0.01  # how often a client that did not take everything is tried again
STOP_GRACE_S = 2.0  # after the router stops: how long queued events wait for slow clients
STOPPING_ERROR = "the server is shutting down"


class Visible(Protocol):
    """What a stream reads of its request (the router's ``_Request``), under the lock."""

    log: list[tuple[int, int, str]]  # (index, token, logits digest), in stream order
    shown: int  # entries of ``log`` the journal holds: what may be sent
    over: bool  # the request's end is journaled
    error: str | None  # what it ended with (None: normally)


class Stream:
    """One client's stream: where it is in its request's log, and what waits to be sent.

    ``render(position, index, token, digest, last)`` frames one token event and
    ``end(error)`` the final event (``None``: a normal end); both run on the pump's thread.
    ``done`` is set once the stream is over: everything sent, or the client gone."""

    def __init__(self, request: Visible, position: int, sock: socket.socket,
                 render: Callable[[int, int, int, str, bool], bytes],
                 end: Callable[[str | None], bytes]) -> None:
        self.request = request
        self.position = position  # the next log entry to send (guarded by the router's lock)
        self.sock = sock
        self.render = render
        self.end = end
        self.pending = bytearray()  # framed, not yet taken by the client (pump thread only)
        self.ending = False  # its end is framed: done once `pending` is sent
        self.done = threading.Event()
        self.client_gone: OSError | None = None


class Pump:
    """Writes every attached stream from one thread. ``lock`` is the router's lock: what a
    stream may send is read under it, and :meth:`changed_locked` is called under it."""

    def __init__(self, lock: threading.Lock, stopping: Callable[[], bool], *,
                 sent: Callable[[], None] | None = None) -> None:
        self._lock = lock
        self._stopping = stopping  # read under the lock
        self._sent = sent  # after a round that gave clients bytes (pump thread, no lock)
        self._wake = threading.Condition(lock)
        self._streams: dict[int, list[Stream]] = {}  # id(request) -> its streams (lock)
        self._dirty: dict[int, Visible] = {}  # id(request) -> request, changed since (lock)
        self._blocked: list[Stream] = []  # streams with bytes queued (pump thread only)
        self._stopped_at: float | None = None  # pump thread only
        self.events = 0  # events framed (pump thread only; for tests and stats)
        self._running = False  # the thread is alive (lock): it ends once the router stopped
        with lock:
            self._start_locked()

    def _start_locked(self) -> None:
        self._running = True
        threading.Thread(target=self._run, name="streams", daemon=True).start()

    # -- called by the router and its HTTP threads -------------------------------------------
    def attach(self, stream: Stream) -> None:
        """Start sending ``stream`` (its socket is made non-blocking)."""
        stream.sock.setblocking(False)
        with self._lock:
            if not self._running:  # a stream asked for after the router stopped (a re-POST)
                self._start_locked()
            self._streams.setdefault(id(stream.request), []).append(stream)
            self._dirty[id(stream.request)] = stream.request
            self._wake.notify()

    def changed_locked(self, request: Visible) -> None:
        """The router's lock is held and ``request``'s visible state moved on."""
        key = id(request)
        if key in self._streams:
            self._dirty[key] = request
            self._wake.notify()

    def stopping_locked(self) -> None:
        """The router stops (its lock is held): every stream ends."""
        for streams in self._streams.values():
            if streams:
                self._dirty[id(streams[0].request)] = streams[0].request
        self._wake.notify()

    # -- the pump's thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._round():
                    return
            except Exception:  # a bug here must not leave every stream hanging silently
                traceback.print_exc(file=sys.stderr)
                time.sleep(RETRY_S)

    def _round(self) -> bool:
        """Send what changed; False once the router stopped and every stream is over."""
        with self._lock:
            while not self._dirty:
                if self._blocked:
                    self._wake.wait(timeout=RETRY_S)
                    break
                if self._stopping() and not self._streams:
                    self._running = False
                    return False
                self._wake.wait(timeout=1.0)
            work = self._take_locked()
        for stream, items, end, error in work:
            try:
                self._frame(stream, items, end, error)
            except Exception:  # a stream that cannot be framed ends, cut short: not silent
                traceback.print_exc(file=sys.stderr)
                self._cut(stream)
        self._send_all()
        return True

    def _take_locked(self) -> list[tuple[Stream, list[tuple[int, int, int, str]], bool,
                                         str | None]]:
        """What each changed request's streams may send now (the router's lock is held)."""
        dirty, self._dirty = self._dirty, {}
        stopping = self._stopping()
        work = []
        for key, request in dirty.items():
            streams = self._streams.get(key)
            if not streams:
                continue
            shown, log = request.shown, request.log
            done = request.over and shown >= len(log)
            error = request.error
            if stopping and not done:
                done, error = True, STOPPING_ERROR
            for stream in streams:
                items = [(stream.position + n, *entry)
                         for n, entry in enumerate(log[stream.position:shown])]
                stream.position += len(items)
                work.append((stream, items, done, error))
            if done:
                del self._streams[key]
        return work

    def _frame(self, stream: Stream, items: list[tuple[int, int, int, str]], end: bool,
               error: str | None) -> None:
        if stream.ending:
            return
        for n, (position, index, token, digest) in enumerate(items):
            last = end and error is None and n == len(items) - 1
            stream.pending += stream.render(position, index, token, digest, last)
            self.events += 1
        if end:
            stream.pending += stream.end(error)
            stream.ending = True
        if stream.pending and stream not in self._blocked:
            self._blocked.append(stream)
        elif stream.ending and not stream.pending:
            stream.done.set()

    def _send_all(self) -> None:
        """Give every stream with queued bytes what its client takes now."""
        still: list[Stream] = []
        gave = False
        for stream in self._blocked:
            try:
                sent = stream.sock.send(stream.pending)
                del stream.pending[:sent]
                gave = gave or sent > 0
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:  # the client went away: its stream is over
                stream.client_gone = exc
                stream.pending.clear()
                self._detach(stream)
                continue
            if stream.pending:
                still.append(stream)
            elif stream.ending:
                stream.done.set()
        self._blocked = still
        if gave and self._sent is not None:
            self._sent()
        self._give_up_after_stop()

    def _cut(self, stream: Stream) -> None:
        """End ``stream`` now, without its end event: the client sees the stream broken."""
        with contextlib.suppress(OSError):
            stream.sock.shutdown(socket.SHUT_RDWR)
        stream.pending.clear()
        if stream in self._blocked:
            self._blocked.remove(stream)
        self._detach(stream)

    def _detach(self, stream: Stream) -> None:
        with self._lock:
            streams = self._streams.get(id(stream.request), [])
            if stream in streams:
                streams.remove(stream)
                if not streams:
                    del self._streams[id(stream.request)]
        stream.ending = True
        stream.done.set()

    def _give_up_after_stop(self) -> None:
        """Once the router stopped, a client that does not read gets ``STOP_GRACE_S``."""
        if not self._blocked:
            return
        with self._lock:
            stopping = self._stopping()
        if not stopping:
            return
        now = time.monotonic()
        if self._stopped_at is None:
            self._stopped_at = now
        elif now - self._stopped_at > STOP_GRACE_S:
            for stream in self._blocked:
                with contextlib.suppress(OSError):
                    stream.sock.shutdown(socket.SHUT_RDWR)
                stream.pending.clear()
                stream.done.set()
            self._blocked = []
