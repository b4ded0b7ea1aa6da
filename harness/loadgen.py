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
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from faults.contract import SERVING_READY
from harness.records import Event
from harness.schema import Duration, Strict
from harness.timeline import Timeline


class PromptMix(Strict):
    """Prompt lengths, in tokens (bytes), drawn uniformly with the run's seed."""

    min: int = Field(16, ge=1, le=1_000_000)
    max: int = Field(64, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _ordered(self) -> PromptMix:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class Load(Strict):
    """The built-in load generator: streaming OpenAI-style completions, as real clients
    send them (Poisson arrivals, shared system-prompt prefixes, resume on a broken stream).
    Everything is drawn from the run's seed, so the fault-free twin sends the same load."""

    requests: int = Field(40, ge=1, le=100_000, description="requests in all")
    rate: float = Field(20.0, gt=0, le=100_000, description="arrivals per second (Poisson)")
    concurrency: int = Field(16, ge=1, le=1024, description="most requests in flight at once")
    prompt_tokens: PromptMix = PromptMix()
    shared_prefixes: int = Field(
        4, ge=0, le=100_000, description="distinct shared prefixes (system prompts); 0: none"
    )
    prefix_tokens: int = Field(32, ge=0, le=1_000_000, description="length of each shared prefix")
    max_tokens: int = Field(32, ge=1, le=4096, description="tokens generated per request")
    retries: int = Field(
        20, ge=0, le=100_000, description="times a client resumes a broken stream (same "
        "request id, offset = tokens received) before it gives the request up"
    )
    request_timeout: Duration = Field(
        timedelta(seconds=60), description="a request not finished by then is lost"
    )


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


class LoadDriver:
    """The load generator as the driver of a run (harness/systems/__init__.py, ``Driver``):
    it starts when the server says where it listens (a ``serving_ready`` event with its
    ``url``), and the run ends when the last request has: then the server's own counters
    (``GET /v1/stats``) go on the timeline as ``serving_stats``."""

    def __init__(self, load: Load, *, seed: int, timeline: Timeline) -> None:
        self.load = load
        self.seed = seed
        self.timeline = timeline
        self.generator: LoadGenerator | None = None

    def observe(self, event: Event) -> None:
        url = event.fields.get("url")
        if event.event == SERVING_READY and self.generator is None and isinstance(url, str):
            self.generator = LoadGenerator(url, self.load, seed=self.seed,
                                           timeline=self.timeline)
            self.generator.start()

    def done(self) -> bool:
        return self.generator is not None and self.generator.done.is_set()

    def finish(self) -> Event | None:
        if self.generator is None:
            return None
        stats = fetch_json(self.generator.url, "/v1/stats")
        return self.timeline.emit("serving_stats", source="client", **serving_stats(stats))

    def stop(self) -> None:
        if self.generator is not None:
            self.generator.stop()


def serving_stats(stats: dict[str, object] | None) -> dict[str, Any]:
    """The server's own counters (``GET /v1/stats``), flattened for the timeline."""
    if stats is None:
        return {"available": False}
    flat: dict[str, Any] = {"available": True}
    engine = stats.get("engine")
    for source in (engine if isinstance(engine, dict) else {}, stats):
        for key, value in source.items():
            if isinstance(value, int | float | str | bool) and key not in flat:
                flat[key] = value
    return flat
