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
(``aftershock.harness.verdict.metrics``). One
``first_token`` event per request lets scenarios trigger on load
(``at: {event: first_token, count: 10}``).
"""

from __future__ import annotations

import contextlib
import json
import random
import string
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from aftershock.faults.contract import SERVING_READY
from aftershock.harness.oracle.serving_journal import JOURNAL_CHECKED
from aftershock.harness.run.records import Event
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.schema import Duration, Strict

# http.client (ssl with it: ~8 ms of CPU) is imported where a request is made: only serving
# runs speak HTTP, and every `aftershock run` imports this module.


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
    resubmit: bool = Field(
        True, description="false: once the server acknowledged a request (answered 200), a "
        "broken stream is only resumed (`resume: true` in the body): the client never submits "
        "it again, so a request the server forgot, or ended with an error, is lost; the "
        "reference server's API"
    )
    request_timeout: Duration = Field(
        timedelta(seconds=60), description="a request not finished by then is lost"
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="fields added to every request's JSON body, as the "
        "server takes them: e.g. `{ignore_eos: true}` (vLLM, SGLang), so that a request ends "
        "at `max_tokens`, not at an end-of-sequence token, and counts as complete")

    @field_validator("extra_body")
    @classmethod
    def _not_the_clients_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & set(CLIENT_FIELDS))
        if taken:
            raise ValueError(
                f"extra_body sets {', '.join(taken)}: the load generator sets it (the fields "
                f"it sends: {', '.join(CLIENT_FIELDS)}); remove it from extra_body")
        return value


#: What the load generator itself puts in every request's body.
CLIENT_FIELDS = ("prompt", "max_tokens", "stream", "request_id", "offset", "resume")


class Ready(Strict):
    """When a scenario-level load starts: when ``GET url + path`` answers 200, or when the
    system reports ``event`` (a log probe's or the in-process probe's), whichever is given;
    either bounded by ``timeout`` from launch."""

    path: str | None = Field(
        None, pattern=r"^/[!-~]*$", description="poll this path (every 100 ms) until it "
        "answers 200; default `/v1/models` (OpenAI-compatible servers have it)")
    event: str | None = Field(
        None, pattern=r"^[a-z_]+$", description="start when the system reports this event "
        "instead (e.g. a log probe's `event: serving_ready`)")
    timeout: Duration = Field(
        timedelta(seconds=60), description="not ready by then: the load never starts and "
        "every serving check fails saying the server never became ready")

    @model_validator(mode="after")
    def _one_way(self) -> Ready:
        if self.path is not None and self.event is not None:
            raise ValueError("give `path` or `event`, not both")
        return self

    def polled(self) -> str | None:
        """The path polled for readiness, or None when an event says it."""
        return None if self.event is not None else (self.path or "/v1/models")


class ScenarioLoad(Load):
    """A scenario-level load: the built-in load generator driving any OpenAI-compatible
    completions endpoint the system (a `command:`) starts, at ``url``."""

    url: str = Field(
        description="where the server listens: `http://HOST:PORT`; `${port}` is a free port "
        "the harness picks for the run, expanded in the command and its env too")
    ready: Ready = Field(Ready(), description="when the load starts")

    @field_validator("url")
    @classmethod
    def _http_host_port(cls, value: str) -> str:
        parts = urlsplit(value.replace("${port}", "1"))
        allowed = "allowed: http://HOST:PORT, PORT a number or ${port}"
        if parts.scheme != "http":
            raise ValueError(f"{value!r} is not an http:// URL ({allowed})")
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.hostname is None or port is None:
            raise ValueError(f"{value!r} names no port ({allowed})")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{value!r} has a path; the client posts to /v1/completions "
                             f"under it ({allowed})")
        return value


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
    # Where the server said it journaled each token (`journal_offset`); None: it did not say.
    offsets: list[int | None] = field(default_factory=list)
    # Which writer the server said journaled each (`journal_writer`); None: it did not say.
    writers: list[str | None] = field(default_factory=list)
    acknowledged: bool = False  # the server answered 200 once: it accepted the request
    server_errors: int = 0  # error events: the server said the request failed
    forgotten: str = ""  # a resume the server refused: what it said
    duplicates: int = 0
    gaps: int = 0
    resumes: int = 0
    finished: bool = False
    unindexed: bool = False  # a chunk carried no token_index: counted in order
    ended: bool = False  # the server said the request is complete (finish_reason)
    finish_reason: str | None = None  # what it said
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
        self.records: list[dict[str, Any]] = []  # each request's record, once it ended
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
        import http.client
        try:
            while not progress.finished and not self._stop.is_set():
                if time.monotonic() > deadline:
                    progress.error = f"not finished after {self.load.request_timeout}"
                    break
                try:
                    self._stream(request, progress, deadline)
                except (OSError, http.client.HTTPException, _Broken, ValueError) as exc:
                    progress.error = (str(exc) if isinstance(exc, _Broken)
                                      else f"{type(exc).__name__}: {exc}")
                    if progress.forgotten:
                        break  # acknowledged, and the server no longer has it: lost
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
                "resumes": progress.resumes, "unindexed": progress.unindexed,
                "finish_reason": progress.finish_reason,
                "journal_offsets": progress.offsets, "journal_writers": progress.writers,
                "acknowledged": progress.acknowledged,
                "server_errors": progress.server_errors,
            }
            self.records.append(record)
            if progress.finished:
                self.timeline.emit("request_done", source="client", **record)
            else:
                self.timeline.emit("request_failed", source="client",
                                   error=progress.error or "stopped", **record)

    def _stream(self, request: Request, progress: _Progress, deadline: float) -> None:
        resume = progress.acknowledged and not self.load.resubmit
        body = json.dumps({
            **self.load.extra_body,
            "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
            "request_id": request.id, "offset": len(progress.tokens),
            **({"resume": True} if resume else {}),
        })
        import http.client

        timeout = max(0.5, deadline - time.monotonic())
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json",
                                  "Idempotency-Key": request.id})
            response = conn.getresponse()
            if response.status != 200:
                detail = response.read(500).decode(errors="replace")
                if resume and response.status == 404:
                    progress.forgotten = detail.strip()
                    raise _Broken(f"acknowledged, then lost: the server no longer has it "
                                  f"(HTTP 404: {detail.strip()})")
                raise _Broken(f"HTTP {response.status}: {detail.strip()}")
            progress.acknowledged = True
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
                chunk = json.loads(payload)
                if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
                    progress.server_errors += 1
                    raise _Broken(f"the server ended the stream with an error: "
                                  f"{json.dumps(chunk['error'])[:300]}")
                self._token(request, progress, chunk)
            raise _Broken(f"stream ended after {len(progress.tokens)} tokens")
        finally:
            conn.close()

    def _token(self, request: Request, progress: _Progress, chunk: dict[str, object]) -> None:
        choice, token = _one_token(chunk)
        index = choice.get("token_index")
        if index is None:
            # Without an index the client can only count tokens in order: a repeated token
            # looks like a new one (no_duplicated_tokens then says "not observed").
            progress.unindexed = True
            index = len(progress.tokens)
        if not isinstance(index, int):
            raise ValueError(f"token_index is not a number: {choice!r:.200}")
        now = time.monotonic()
        if index < len(progress.tokens):
            progress.duplicates += 1  # the server sent a token the client already had
            return
        if index > len(progress.tokens):
            progress.gaps += index - len(progress.tokens)
            raise _Broken(f"token {index} arrived while {len(progress.tokens)} was expected")
        digest = choice.get("logits_digest")
        where = choice.get("journal_offset")
        progress.offsets.append(where if isinstance(where, int) and where >= 0 else None)
        writer = choice.get("journal_writer")
        progress.writers.append(writer if isinstance(writer, str) and writer else None)
        progress.tokens.append(token)
        progress.times.append(now)
        progress.digests.append(digest if isinstance(digest, str) and digest else None)
        if choice.get("finish_reason"):
            progress.ended = True
            progress.finish_reason = str(choice["finish_reason"])
        if len(progress.tokens) == 1:
            self.timeline.emit("first_token", source="client", request=request.id)


def _one_token(chunk: dict[str, object]) -> tuple[dict[str, Any], int]:
    """A streamed chunk's one choice and the one token it carries (ValueError otherwise)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices in {chunk!r:.200}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or len(ids) != 1 or not isinstance(ids[0], int):
        raise ValueError(f"a chunk needs one token_ids entry: {choice!r:.200}")
    return choice, int(ids[0])


def fetch_json(url: str, path: str, timeout: float = 2.0) -> dict[str, object] | None:
    """GET a JSON document from the server (its stats), or None if it has none."""
    import http.client

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


#: Of a load, how long clients insist and when they start: never what a fault-free server
#: answers them (the fault-free twin's cache key leaves them out).
LOAD_TIMING = ("retries", "request_timeout", "ready", "resubmit")


def twin_key(load: Load) -> dict[str, Any]:
    """What of a load decides the fault-free twin's outputs, as JSON."""
    data: dict[str, Any] = load.model_dump(mode="json")
    for name in LOAD_TIMING:
        data.pop(name, None)
    if not data.get("extra_body"):
        data.pop("extra_body", None)  # the keys of loads from before it existed stay valid
    return data


#: Event on the timeline when a scenario-level load never started: its ``error`` says why.
NOT_READY = "load_not_ready"
_READY_POLL_S = 0.1


def _answer(url: str, path: str, timeout: float = 1.0) -> tuple[int | None, str]:
    """``GET url + path``: its status (None: no HTTP answer) and what to tell a user."""
    import http.client

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read(4096)
        return response.status, f"HTTP {response.status}"
    except (OSError, http.client.HTTPException) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            conn.close()


class LoadDriver:
    """The load generator as the driver of a run (harness/systems/__init__.py, ``Driver``).

    It starts when the server is ready: for the reference server's ``system.load`` (no
    ``ready``), when it says where it listens (a ``serving_ready`` event with its ``url``);
    for a scenario-level load, when ``GET url + ready.path`` answers 200 or the system
    reports ``ready.event``, bounded by ``ready.timeout`` from launch. The run ends when the
    last request has (then the server's own counters, ``GET /v1/stats``, go on the timeline
    as ``serving_stats``), or when the server never became ready (a ``load_not_ready`` event
    saying why, which every serving check then reports)."""

    def __init__(self, load: Load, *, seed: int, timeline: Timeline, url: str | None = None,
                 ready: Ready | None = None, journal: Path | None = None) -> None:
        self.load = load
        self.journal = journal  # the server's journal file, checked against the clients
        # When each fsync of the journal returned, where the harness's lazy filesystem has
        # it (storage.lose_unsynced over its folder; the runner sets it): what proves a
        # token durable before a client was shown it.
        self.sync_history: Callable[[Path], dict[str, Any] | None] | None = None
        self.seed = seed
        self.timeline = timeline
        self.url = url
        self.ready = ready
        self.generator: LoadGenerator | None = None
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._deadline: float | None = None
        self._poller: threading.Thread | None = None
        self._not_ready: Event | None = None

    def observe(self, event: Event) -> None:
        if self.ready is None:
            url = event.fields.get("url")
            if event.event == SERVING_READY and isinstance(url, str):
                self._start(url)
            return
        if event.event == "launch" and event.source == "harness" and self._deadline is None:
            self._deadline = time.monotonic() + self.ready.timeout.total_seconds()
            path = self.ready.polled()
            if path is not None:
                self._poller = threading.Thread(target=self._poll, args=(path,),
                                                name="load-ready", daemon=True)
                self._poller.start()
        elif event.event == self.ready.event and event.source != "harness":
            self._start(self.url or "")

    def _start(self, url: str) -> None:
        with self._lock:
            if self.generator is not None or self._not_ready is not None:
                return
            self.generator = LoadGenerator(url, self.load, seed=self.seed,
                                           timeline=self.timeline)
            self.generator.start()

    def _give_up(self, why: str) -> None:
        with self._lock:
            if self.generator is None and self._not_ready is None:
                self._not_ready = self.timeline.emit(NOT_READY, source="client", error=why)

    def _poll(self, path: str) -> None:
        assert self.url is not None
        assert self._deadline is not None
        assert self.ready is not None
        last = "no answer yet"
        while not self._halt.is_set():
            status, last = _answer(self.url, path)
            if status == 200:
                self._start(self.url)
                return
            if time.monotonic() > self._deadline:
                break
            self._halt.wait(_READY_POLL_S)
        else:
            return
        self._give_up(f"the server never became ready: GET {self.url}{path} did not answer "
                      f"200 within {self.ready.timeout.total_seconds():g}s (last: {last})")

    def done(self) -> bool:
        if (self.ready is not None and self.ready.event is not None and self.generator is None
                and self._deadline is not None and time.monotonic() > self._deadline):
            self._give_up(f"the server never became ready: no `{self.ready.event}` event "
                          f"within {self.ready.timeout.total_seconds():g}s of launch")
        if self._not_ready is not None:
            return True
        return self.generator is not None and self.generator.done.is_set()

    def finish(self) -> Event | None:
        if self.generator is None:
            return self._not_ready
        if self.journal is not None:
            syncs = self.sync_history(self.journal) if self.sync_history is not None else None
            self.timeline.emit(JOURNAL_CHECKED, source="harness",
                               **check_journal(self.journal, self.generator.records, syncs))
        stats = fetch_json(self.generator.url, "/v1/stats")
        return self.timeline.emit("serving_stats", source="client", **serving_stats(stats))

    def stop(self) -> None:
        self._halt.set()
        if self._poller is not None:
            self._poller.join(5.0)
        if self.generator is not None:
            self.generator.stop()


_JOURNAL_LIMIT = 256 << 20  # bytes of a journal the harness reads


def check_journal(path: Path, records: list[dict[str, Any]],
                  syncs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the server's journal file holds of what its clients received
    (harness/oracle/serving_journal.py), read while the server still runs: every token a
    client saw was durable before it was sent, so it is there already. ``syncs``: the
    journal's fsyncs (``storage.sync_history``), where the harness's filesystem saw them."""
    from aftershock.harness.oracle.serving_journal import judge, parse

    try:
        with open(path, "rb") as handle:
            data = handle.read(_JOURNAL_LIMIT)
    except OSError as exc:
        return {"found": False, "path": str(path), "error": f"{type(exc).__name__}: {exc}"}
    return {"path": str(path), **judge(parse(data), list(records), syncs)}


def scenario_load_driver(load: ScenarioLoad, variables: dict[str, str], *, seed: int,
                         timeline: Timeline) -> LoadDriver:
    """The driver of a scenario-level load, its ``url`` expanded with the run's variables
    (``${port}``: the port the command got)."""
    url = load.url
    for name, value in variables.items():
        url = url.replace("${" + name + "}", value)
    return LoadDriver(load, seed=seed, timeline=timeline, url=url, ready=load.ready)


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
