"""When each fault of a scenario is due: its trigger, its repeats, their clocks. No I/O.

The run loop tells the schedule what the run has shown so far (:class:`Progress`: the
time, the highest committed step, how often each event was seen, how many times each
watched file matched) and asks which faults are due; it reports back whether each one
was applied (:meth:`Schedule.fired`), could not be yet (nothing to do: it stays due), or
failed for good (:meth:`Schedule.give_up`). Being pure, it is tested with a hand-made
clock (tests/test_schedule.py).

Repeats (``every``) count from when a fault was applied: ``every: {steps: N}`` is due N
committed steps after the step seen when it fired, ``every: {time: D}`` D seconds after.
An in-process fault triggered by a step is armed at once, before its step, and the probe
waits for the step; so its repeat k is armed right after repeat k-1 with its own step,
``at.step + k × N`` (:meth:`Schedule.arm_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``next_step`` of an in-process repeat: due at once (it carries its own step).
_AT_ONCE = -1


@dataclass(frozen=True, slots=True)
class Progress:
    """What the run has shown so far."""

    now: float  # monotonic seconds
    elapsed: float  # seconds since launch
    max_step: int = -1  # the highest committed step seen; -1 before the first
    seen: Mapping[str, int] = field(default_factory=dict)  # event -> occurrences (the system's)
    file_hits: Mapping[int, int] = field(default_factory=dict)  # fault -> matches (watched only)
    # fault -> events matching its `at.after` so far (faults with one only)
    awaited: Mapping[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _State:
    times: int = 0  # how often it was applied (or armed)
    done: bool = False  # no more applications: its repeats are over, or it failed
    next_step: int | None = None  # a repeat is due once this step is committed
    next_time: float | None = None  # a repeat is due at this monotonic time


class Schedule:
    """The triggers of a scenario's faults (``at``, ``every``) and where each one stands.

    ``faults`` are the scenario's fault models (anything with ``at`` and ``every``);
    ``inside[i]`` says whether fault ``i`` is applied by the in-process probe, which is
    handed a step-triggered fault ahead of time.
    """

    def __init__(self, faults: Sequence[Any], inside: Sequence[bool]) -> None:
        if len(faults) != len(inside):
            raise ValueError("one `inside` flag per fault")
        self._faults = list(faults)
        self._inside = list(inside)
        self._state = [_State() for _ in faults]

    def __len__(self) -> int:
        return len(self._faults)

    def due(self, progress: Progress) -> list[int]:
        """The faults to apply now, in scenario order."""
        return [i for i in range(len(self._faults)) if self._due(i, progress)]

    def _due(self, index: int, p: Progress) -> bool:
        state = self._state[index]
        if state.done:
            return False
        if state.times:  # a repeat of an `every` fault
            return ((state.next_step is not None and p.max_step >= state.next_step)
                    or (state.next_time is not None and p.now >= state.next_time))
        at = self._faults[index].at
        after = getattr(at, "after", None)
        if after is not None and p.awaited.get(index, 0) < after.count:
            return False  # the state the fault is meant for is not there yet
        if at.step is not None:
            return self._inside[index] or p.max_step >= int(at.step)
        if at.time is not None:
            return p.elapsed >= float(at.time.total_seconds())
        if at.event is not None:
            return p.seen.get(at.event, 0) >= int(at.count)
        if at.file is not None:
            return index in p.file_hits and p.file_hits[index] >= at.count
        return False

    def arm_step(self, index: int) -> int | None:
        """The step an in-process fault is armed for on its next application: repetition k of
        ``every: {steps: N}`` lands k × N steps after ``at.step``."""
        fault = self._faults[index]
        step: int | None = fault.at.step
        every = fault.every
        if step is not None and every is not None and every.steps is not None:
            step += self._state[index].times * every.steps
        return step

    def repetition(self, index: int) -> int:
        """How many times fault ``index`` was applied so far (0: not yet)."""
        return self._state[index].times

    def fired(self, index: int, progress: Progress) -> None:
        """Fault ``index`` was applied (or armed): plan its next repeat, or finish it."""
        state = self._state[index]
        state.times += 1
        state.next_step = state.next_time = None
        fault = self._faults[index]
        every = fault.every
        if every is None or state.times >= every.times:
            state.done = True
        elif every.steps is not None and self._inside[index] and fault.at.step is not None:
            state.next_step = _AT_ONCE  # armed now with its own later step (arm_step)
        elif every.steps is not None:
            state.next_step = max(progress.max_step, 0) + every.steps
        else:
            state.next_time = progress.now + every.time.total_seconds()

    def give_up(self, index: int) -> None:
        """Fault ``index`` cannot be applied (its record says why): no more attempts, and it
        counts as tried, not as a trigger never reached."""
        state = self._state[index]
        state.done = True
        state.times = max(state.times, 1)

    def finished(self, index: int) -> bool:
        return self._state[index].done

    def missing_repeats(self) -> list[tuple[int, int, int]]:
        """(fault, repetition, of how many) for each repetition of a fault that fired at
        least once whose later repetitions never came (the run ended first)."""
        out = []
        for i, s in enumerate(self._state):
            every = self._faults[i].every
            if s.done or not s.times or every is None:
                continue
            out += [(i, k, every.times) for k in range(s.times + 1, every.times + 1)]
        return out

    def never_fired(self) -> list[int]:
        """Faults whose trigger never came (or whose target never appeared)."""
        return [i for i, s in enumerate(self._state) if not s.done and not s.times]
