"""Metrics computed from a run's timeline. Definitions: docs/metrics.md.

Everything here is a pure function of the events, so a recorded run can be
re-checked (``aftershock report``) and every metric can be tested on
hand-written timelines.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

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


def compute(events: Sequence[Event], world: int | None) -> dict[str, float | int | None]:
    world = full_world(events, world)
    return {
        "time_to_detect_s": time_to_detect(events),
        "time_to_recover_s": time_to_recover(events, world),
        "lost_steps": lost_steps(events),
        "steps_committed": steps_committed(events),
        "generations": generations(events),
        "min_step_rate": min_step_rate(events),
    }
