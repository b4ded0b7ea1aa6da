"""The built-in load generator: what clients of an LLM server really do, recorded.

It speaks the OpenAI-style streaming completions API (``POST /v1/completions``
with ``stream: true``, server-sent events, one token per event with its
``token_index``) that the reference server offers and most servers copy.
Standard library only: the harness never imports torch.

A client here is a demanding one. Each request carries an idempotency key
(``request_id``); when its stream breaks (connection reset, server error,
stream ended early) it asks again with the same id and ``offset`` = tokens
received, so a server that keeps its promises loses and repeats nothing. The
client never hides a server's mistakes: a token index it already had is
counted as a duplicate, a gap as a loss.

Every request ends as one ``request_done`` or ``request_failed`` event on the
timeline, carrying its tokens, the arrival time of each and the digest of the
logits row each was chosen from (``logits_digest`` in the chunk, when the server
sends one), so every serving metric is a pure function of the timeline
(``harness.metrics``). One
``first_token`` event per request lets scenarios trigger on load
(``at: {event: first_token, count: 10}``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import string
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from harness.spec import Load
from harness.timeline import Timeline

_ALPHABET = string.ascii_letters + string.digits + " .,"
_BACKOFF_S = 0.05


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt: str
    max_tokens: int
    send_at: float  # seconds after the load started (Poisson arrivals)


def plan(load: Load, seed: int) -> list[Request]:
    """The whole load, drawn from the seed: the fault-free twin sends the same requests."""
    rng = random.Random(f"aftershock-load-{seed}")
    prefixes = ["".join(rng.choice(_ALPHABET) for _ in range(load.prefix_tokens))
                for _ in range(load.shared_prefixes)]
    requests: list[Request] = []
    t = 0.0
    for i in range(load.requests):
        length = rng.randint(load.prompt_tokens.min, load.prompt_tokens.max)
        prefix = prefixes[i % len(prefixes)] if prefixes else ""
        tail = "".join(rng.choice(_ALPHABET) for _ in range(max(1, length - len(prefix))))
        requests.append(Request(f"req-{seed}-{i:05d}", prefix + tail, load.max_tokens, t))
        t += rng.expovariate(load.rate)
    return requests


@dataclass
class _Progress:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    digests: list[str | None] = field(default_factory=list)  # None: the server sent none
    duplicates: int = 0
    gaps: int = 0
    resumes: int = 0
    finished: bool = False
    ended: bool = False  # the server said the request is complete (finish_reason)
    error: str = ""


class _Broken(Exception):
    """The stream ended before the request finished; the client resumes it."""


class LoadGenerator:
    """Sends the planned load to ``url`` from worker threads; ``done`` is set at the end."""

    def __init__(self, url: str, load: Load, *, seed: int, timeline: Timeline) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"not an http://host:port URL: {url!r}")
        self.url = url
        self.host, self.port = parts.hostname, parts.port
        self.load = load
        self.timeline = timeline
        self.requests = plan(load, seed)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(load.concurrency)
        self._threads: list[threading.Thread] = []
        self._driver = threading.Thread(target=self._drive, name="loadgen", daemon=True)

    def start(self) -> None:
        self.timeline.emit("load_started", source="client", requests=len(self.requests),
                           url=f"http://{self.host}:{self.port}")
        self._driver.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Give up on whatever is still running (the run is ending) and join the threads."""
        self._stop.set()
        self._driver.join(timeout)
        for thread in self._threads:
            thread.join(timeout)

    def _drive(self) -> None:
        start = time.monotonic()
        try:
            for request in self.requests:
                delay = start + request.send_at - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                thread = threading.Thread(target=self._run, args=(request,),
                                          name=f"client-{request.id}", daemon=True)
                self._threads.append(thread)
                thread.start()
            for thread in self._threads:
                while thread.is_alive() and not self._stop.is_set():
                    thread.join(0.1)
        finally:
            if not self._stop.is_set():
                self.timeline.emit("load_finished", source="client")
            self.done.set()

    # -- one request
    def _run(self, request: Request) -> None:
        progress = _Progress()
        sent = time.monotonic()
        self.timeline.emit("request_sent", source="client", request=request.id)
        deadline = sent + self.load.request_timeout.total_seconds()
        attempts = 0
        try:
            while not progress.finished and not self._stop.is_set():
                if time.monotonic() > deadline:
                    progress.error = f"not finished after {self.load.request_timeout}"
                    break
                try:
                    self._stream(request, progress, deadline)
                except (OSError, http.client.HTTPException, _Broken, ValueError) as exc:
                    progress.error = f"{type(exc).__name__}: {exc}"
                    attempts += 1
                    if attempts > self.load.retries:
                        break
                    progress.resumes += 1
                    self._stop.wait(_BACKOFF_S * min(attempts, 10))
        finally:
            self._slots.release()
            record: dict[str, Any] = {
                "request": request.id, "sent": sent, "tokens": progress.tokens,
                "times": [round(t, 6) for t in progress.times], "digests": progress.digests,
                "max_tokens": request.max_tokens,
                "duplicates": progress.duplicates, "gaps": progress.gaps,
                "resumes": progress.resumes,
            }
            if progress.finished:
                self.timeline.emit("request_done", source="client", **record)
            else:
                self.timeline.emit("request_failed", source="client",
                                   error=progress.error or "stopped", **record)

    def _stream(self, request: Request, progress: _Progress, deadline: float) -> None:
        body = json.dumps({
            "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
            "request_id": request.id, "offset": len(progress.tokens),
        })
        timeout = max(0.5, deadline - time.monotonic())
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json",
                                  "Idempotency-Key": request.id})
            response = conn.getresponse()
            if response.status != 200:
                detail = response.read(500).decode(errors="replace")
                raise _Broken(f"HTTP {response.status}: {detail.strip()}")
            for raw in iter(response.readline, b""):
                if self._stop.is_set():
                    raise _Broken("load generator stopped")
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    if progress.ended or len(progress.tokens) >= request.max_tokens:
                        progress.finished = True
                        return
                    raise _Broken(f"[DONE] after {len(progress.tokens)} of "
                                  f"{request.max_tokens} tokens")
                self._token(request, progress, json.loads(payload))
            raise _Broken(f"stream ended after {len(progress.tokens)} tokens")
        finally:
            conn.close()

    def _token(self, request: Request, progress: _Progress, chunk: dict[str, object]) -> None:
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"no choices in {chunk!r:.200}")
        choice = choices[0]
        index = choice.get("token_index")
        ids = choice.get("token_ids")
        if not isinstance(index, int) or not isinstance(ids, list) or len(ids) != 1:
            raise ValueError(f"a chunk needs token_index and one token_ids entry: {choice!r:.200}")
        now = time.monotonic()
        if index < len(progress.tokens):
            progress.duplicates += 1  # the server sent a token the client already had
            return
        if index > len(progress.tokens):
            progress.gaps += index - len(progress.tokens)
            raise _Broken(f"token {index} arrived while {len(progress.tokens)} was expected")
        digest = choice.get("logits_digest")
        progress.tokens.append(int(ids[0]))
        progress.times.append(now)
        progress.digests.append(digest if isinstance(digest, str) and digest else None)
        if choice.get("finish_reason"):
            progress.ended = True
        if len(progress.tokens) == 1:
            self.timeline.emit("first_token", source="client", request=request.id)


def fetch_json(url: str, path: str, timeout: float = 2.0) -> dict[str, object] | None:
    """GET a JSON document from the server (its stats), or None if it has none."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            return None
        value = json.loads(data)
        return value if isinstance(value, dict) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            conn.close()
