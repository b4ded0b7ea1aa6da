"""The router <-> worker link: typed messages as JSON lines over one TCP socket per worker.

One socket per worker, and nothing else between them, so a fault on that socket
(``ss -K``, an nftables drop) is a fault on that worker's link and nothing more.
Every message is one line of compact JSON with an ``op`` naming its type. The
router fences tokens by the ``epoch`` of the assignment they belong to, so every
message about a request carries the epoch the router gave it.

Standard library only: the router never imports torch.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

MAX_LINE = 64 << 20  # a prompt of max_seq tokens is a few KiB; anything this big is garbage
# The engine's counters (EngineStats) a worker reports in its heartbeats.
ENGINE_COUNTERS = (
    "steps", "prompt_tokens", "prefix_hit_tokens", "computed_tokens", "recomputed_tokens",
    "checksum_failures", "evicted_blocks", "preemptions", "generated_tokens",
    "checksum_ms",  # CPU of the engine's thread in KV checksums (sealing, verifying)
    "cpu_ms",  # CPU time of the worker process since it said hello (not the engine's own)
)


# --- worker -> router ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message on a link: the engine is built and ready for work."""

    op: ClassVar[str] = "hello"
    worker: int  # worker index (the slot it fills), 0..workers-1
    generation: int  # process incarnation of that index: 0, then +1 per respawn
    pid: int
    model_id: str  # every worker must serve the same weights, or migration changes tokens
    block_size: int  # KV block size: the router's prefix-affinity key is the first block
    max_seq: int  # prompt + max_tokens must fit


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent from the worker's heartbeat thread, independent of the engine loop."""

    op: ClassVar[str] = "hb"
    steps: int  # engine steps completed: progress, for wedge detection
    busy: bool  # the engine holds requests
    running: int
    stats: dict[str, float]  # the engine's counters after its last step
    # The engine thread's scheduler account (/proc/self/task/TID/schedstat), cumulative
    # seconds: on a CPU, and runnable but waiting for one (a busy machine, a CPU quota).
    # None where the kernel does not keep it. Tells a starved step from a stuck one.
    engine_cpu_s: float | None = None
    engine_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class Outputs:
    """Tokens of one engine step: ``(request_id, epoch, index, token, digest, finished)``
    each; ``digest`` names the logits row the token was chosen from (``engine.logits_digest``).
    """

    op: ClassVar[str] = "out"
    items: tuple[tuple[str, int, int, int, str, bool], ...]


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused a request (``Engine.add`` raised ValueError)."""

    op: ClassVar[str] = "rejected"
    request_id: str
    epoch: int
    message: str


@dataclass(frozen=True, slots=True)
class XidReport:
    """The worker's GPU reported an Xid whose action is not ``none``; the worker exits next."""

    op: ClassVar[str] = "xid"
    code: int
    action: str


# --- router -> worker ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Add:
    """Run a request; ``emitted`` are its tokens already delivered (a migration)."""

    op: ClassVar[str] = "add"
    request_id: str
    epoch: int
    prompt: tuple[int, ...]
    max_tokens: int
    emitted: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    op: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True, slots=True)
class Reset:
    """The router gave this link up (heartbeats stopped, engine wedged): drop every request
    and reconnect as a fresh worker."""

    op: ClassVar[str] = "reset"
    reason: str


Message = Hello | Heartbeat | Outputs | Rejected | XidReport | Add | Abort | Reset
_TYPES: dict[str, type[Any]] = {
    t.op: t for t in (Hello, Heartbeat, Outputs, Rejected, XidReport, Add, Abort, Reset)
}
_TUPLES = {"prompt", "emitted"}


class ProtocolError(ValueError):
    """A line that is not a known message."""


def encode(message: Message) -> bytes:
    body = asdict(message)
    body["op"] = message.op
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> Message:
    try:
        body = json.loads(line)
        kind = _TYPES[body.pop("op")]
        names = {f.name for f in fields(kind)}
        if set(body) != names:
            raise ProtocolError(f"{kind.op}: fields {sorted(body)} != {sorted(names)}")
        for name in _TUPLES & names:
            body[name] = tuple(body[name])
        if kind is Outputs:
            body["items"] = tuple(tuple(item) for item in body["items"])
        message: Message = kind(**body)
        return message
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"bad message {line[:200]!r}: {exc}") from None


def read_messages(sock: socket.socket) -> Iterator[Message | None]:
    """Messages from ``sock`` until EOF. Connection errors propagate (OSError); a socket
    timeout only means "nothing yet" and is yielded as None, so the caller can look
    at its stop flag."""
    buffer = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            yield None
            continue
        if not chunk:
            return
        buffer += chunk
        if len(buffer) > MAX_LINE and b"\n" not in buffer:
            raise ProtocolError(f"line longer than {MAX_LINE} bytes")
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line:
                yield decode(line)
