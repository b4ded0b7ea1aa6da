"""Metrics computed from a run's timeline. Definitions: docs/metrics.md.

Everything here is a pure function of the events, so a recorded run can be
re-checked (``aftershock report``) and every metric can be tested on
hand-written timelines.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from harness.records import Event


def first_fault_time(events: Sequence[Event]) -> float | None:
    return next((e.t for e in events if e.event == "fault_injected"), None)


def time_to_detect(events: Sequence[Event]) -> float | None:
    """Fault injected -> first event in which the system acknowledges a failure."""
    t_fault = first_fault_time(events)
    if t_fault is None:
        return None
    detected = next(
        (e.t for e in events if e.event == "failure_detected" and e.t >= t_fault), None
    )
    return None if detected is None else detected - t_fault


def full_world(events: Sequence[Event], configured: int | None) -> int | None:
    """Ranks at full strength: configured, else the ranks seen before the first fault."""
    if configured:
        return configured
    t_fault = first_fault_time(events)
    ranks = {
        e.rank
        for e in events
        if e.event == "step" and e.rank is not None and (t_fault is None or e.t < t_fault)
    }
    return len(ranks) or None


def time_to_recover(events: Sequence[Event], world: int | None) -> float | None:
    """Fault injected -> first step committed by every rank of the full world again.

    Only step reports after the system noticed the failure (or after the fault,
    if the system reports no detection) count, so a step the doomed generation
    finished just after the fault is not mistaken for recovery.
    """
    t_fault = first_fault_time(events)
    if t_fault is None or not world:
        return None
    detected = next(
        (e.t for e in events if e.event == "failure_detected" and e.t >= t_fault), None
    )
    t_from = detected if detected is not None else t_fault
    reporters: dict[int, set[int]] = defaultdict(set)
    for e in events:
        if e.event != "step" or e.t <= t_from:
            continue
        step = e.fields.get("step")
        if not isinstance(step, int):
            continue
        reporters[step].add(e.rank if e.rank is not None else 0)
        if len(reporters[step]) >= world:
            return e.t - t_fault
    return None


def lost_steps(events: Sequence[Event]) -> int:
    """Committed steps that had to be committed again (recomputed), worst rank.

    For each rank, a step reported when that rank had already reported the same
    or a later step is a recomputation.
    """
    best: dict[int, int] = {}
    redone: dict[int, set[int]] = defaultdict(set)
    for e in events:
        if e.event != "step":
            continue
        step = e.fields.get("step")
        if not isinstance(step, int):
            continue
        rank = e.rank if e.rank is not None else 0
        if rank in best and step <= best[rank]:
            redone[rank].add(step)
        best[rank] = max(best.get(rank, step), step)
    return max((len(s) for s in redone.values()), default=0)


def steps_committed(events: Sequence[Event]) -> int | None:
    steps = [e.fields["step"] for e in events
             if e.event == "step" and isinstance(e.fields.get("step"), int)]
    return max(steps) if steps else None


def final_digests(events: Sequence[Event]) -> dict[int, str]:
    """Each rank's last reported parameter digest."""
    digests: dict[int, str] = {}
    for e in events:
        if e.event == "params" and isinstance(e.fields.get("digest"), str):
            digests[e.rank if e.rank is not None else 0] = e.fields["digest"]
    return digests


def generations(events: Sequence[Event]) -> int:
    """New generations after the first: world restarts under `restart` (torchrun's
    restart count), membership changes under hot_spare and elastic."""
    seen = {e.fields.get("generation") for e in events if e.event == "hello"}
    seen.discard(None)
    return max(len(seen) - 1, 0)


def min_step_rate(events: Sequence[Event], window_s: float = 2.0) -> float | None:
    """The slowest progress of the run: the fewest steps committed (first report of each
    step number) in any window of ``window_s`` seconds, per second."""
    first: dict[int, float] = {}
    for e in events:
        step = e.fields.get("step")
        if e.event == "step" and isinstance(step, int) and step not in first:
            first[step] = e.t
    times = sorted(first.values())
    if len(times) < 2 or times[-1] - times[0] < window_s:
        return None
    slowest = None
    lo = 0
    start = times[0]
    while start + window_s <= times[-1]:
        while times[lo] < start:
            lo += 1
        hi = lo
        while hi < len(times) and times[hi] < start + window_s:
            hi += 1
        rate = (hi - lo) / window_s
        slowest = rate if slowest is None else min(slowest, rate)
        start += window_s / 4
    return slowest


# ------------------------------------------------------------------------------ serving


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the load generator, as its ``request_done``/``request_failed``
    event recorded it (times on the run's monotonic clock)."""

    id: str
    done: bool
    sent: float
    tokens: tuple[int, ...]
    times: tuple[float, ...]
    max_tokens: int
    duplicates: int
    # The server's digest of the logits row each token was chosen from; None where it sent
    # none (or the event predates digests).
    digests: tuple[str | None, ...] = ()

    @classmethod
    def of(cls, event: Event) -> RequestRecord | None:
        f = event.fields
        tokens, times = f.get("tokens"), f.get("times")
        if not isinstance(tokens, list) or not isinstance(times, list):
            return None
        given = f.get("digests")
        listed = given if isinstance(given, list) else []
        digests = tuple(d if isinstance(d, str) and d else None for d in listed[: len(tokens)])
        digests += (None,) * (len(tokens) - len(digests))
        return cls(str(f.get("request")), event.event == "request_done",
                   float(f.get("sent", event.t)), tuple(int(x) for x in tokens),
                   tuple(float(x) for x in times), int(f.get("max_tokens") or len(tokens)),
                   int(f.get("duplicates") or 0), digests)


def requests(events: Sequence[Event]) -> list[RequestRecord]:
    """Every request that ended, plus one empty failed record per request that was sent
    but never ended (the run stopped under it)."""
    ended: dict[str, RequestRecord] = {}
    sent: dict[str, float] = {}
    for e in events:
        if e.event == "request_sent" and e.source == "client":
            sent[str(e.fields.get("request"))] = e.t
        elif e.event in ("request_done", "request_failed") and e.source == "client":
            record = RequestRecord.of(e)
            if record is not None:
                ended[record.id] = record
    for rid, t in sent.items():
        if rid not in ended:
            ended[rid] = RequestRecord(rid, False, t, (), (), 0, 0, ())
    return sorted(ended.values(), key=lambda r: r.sent)


@dataclass(frozen=True, slots=True)
class Output:
    """What the client of one request received: its tokens and, per token, the server's
    digest of the logits row the token was chosen from (None where it sent none)."""

    tokens: tuple[int, ...]
    digests: tuple[str | None, ...]

    def to_json(self) -> dict[str, list[int] | list[str | None]]:
        return {"tokens": list(self.tokens), "digests": list(self.digests)}

    @classmethod
    def from_json(cls, data: object) -> Output:
        """Read ``to_json``'s form back; a bare token list (a baseline cached before digests
        existed) has unknown digests, which `outputs_match` refuses to take on trust."""
        if isinstance(data, list):
            return cls(tuple(int(t) for t in data), (None,) * len(data))
        if not isinstance(data, dict):
            raise ValueError(f"not a request's output: {data!r:.100}")
        tokens = tuple(int(t) for t in data.get("tokens") or ())
        digests = tuple(d if isinstance(d, str) and d else None
                        for d in data.get("digests") or ())
        return cls(tokens, (digests + (None,) * len(tokens))[: len(tokens)])


def outputs(events: Sequence[Event]) -> dict[str, Output]:
    """Request id -> what its client received (for `outputs_match`)."""
    return {r.id: Output(r.tokens, r.digests) for r in requests(events)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): an observed value, never an interpolation."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def serving_time_to_recover(records: Sequence[RequestRecord], t_fault: float | None
                            ) -> float | None:
    """Fault injected -> every request that was in flight at the fault streams again.

    A request hit by the fault stalls: its longest wait between tokens (or between being
    sent and its first token) that ends after the fault is the stall, and the token that
    ends it is its recovery. Tokens the dying worker had already sent can still arrive
    just after the fault; taking the end of the longest wait, not the first token after
    the fault, keeps them from passing for recovery. The slowest request counts; None if
    one of them never got another token, or if no request was in flight (then the fault
    hit nothing a client could see, and a budget on it would pass vacuously)."""
    if t_fault is None:
        return None
    worst: float | None = None
    for r in records:
        if r.sent >= t_fault:
            continue
        if r.done and r.times and r.times[-1] <= t_fault:
            continue  # finished before the fault
        points = (r.sent, *r.times)
        waits = [(b - a, b) for a, b in itertools.pairwise(points) if b > t_fault]
        if not waits:
            return None
        _, resumed = max(waits)
        worst = max(worst or 0.0, resumed - t_fault)
    return worst


def serving(events: Sequence[Event]) -> dict[str, float | int | None]:
    records = requests(events)
    t_fault = first_fault_time(events)
    ttft = [r.times[0] - r.sent for r in records if r.times]
    tpot = [b - a for r in records for a, b in itertools.pairwise(r.times)]
    stats = next((e.fields for e in reversed(events) if e.event == "serving_stats"), {})

    def stat(name: str) -> float | int | None:
        value = stats.get(name)
        return value if isinstance(value, int | float) else None

    lost = [r for r in records if not r.done or len(r.tokens) < r.max_tokens]
    return {
        "time_to_detect_s": time_to_detect(events),
        "time_to_recover_s": serving_time_to_recover(records, t_fault),
        "requests": len(records),
        "lost_requests": len(lost),
        "lost_tokens": sum(max(r.max_tokens - len(r.tokens), 0) for r in lost),
        "duplicated_tokens": sum(r.duplicates for r in records),
        "migrated_requests": sum(1 for e in events if e.event == "request_migrated"),
        "recomputed_tokens": stat("recomputed_tokens"),
        "prefix_hit_rate": stat("prefix_hit_rate"),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def is_serving(events: Sequence[Event]) -> bool:
    return any(e.event == "load_started" for e in events)


def compute(events: Sequence[Event], world: int | None) -> dict[str, float | int | None]:
    if is_serving(events):
        return serving(events)
    world = full_world(events, world)
    return {
        "time_to_detect_s": time_to_detect(events),
        "time_to_recover_s": time_to_recover(events, world),
        "lost_steps": lost_steps(events),
        "steps_committed": steps_committed(events),
        "generations": generations(events),
        "min_step_rate": min_step_rate(events),
    }
