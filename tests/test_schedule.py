"""The fault schedule on a hand-made clock: triggers, counts, repeats, failures."""

from __future__ import annotations

import pytest

from aftershock.harness.errors import SpecError
from aftershock.harness.run.schedule import Progress, Schedule
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import in_process


def schedule(*faults: str) -> Schedule:
    # hot_spare: its warm spare says hello as role spare, which `after` may wait for.
    text = "name: s\nsystem: {reference: trainer, recovery: hot_spare}\nfaults:\n" + "".join(
        f"  - {f}\n" for f in faults)
    spec = parse_scenario(text)
    return Schedule(spec.faults, [in_process(f) for f in spec.faults])


def at(now: float, step: int = -1, **seen: int) -> Progress:
    return Progress(now=now, elapsed=now, max_step=step, seen=seen)


KILL = "{kind: process.kill, target: {rank: 0}, "


def test_a_step_trigger_waits_for_the_committed_step() -> None:
    s = schedule(KILL + "at: {step: 5}}")
    assert s.due(at(1.0, step=4)) == []
    assert s.due(at(1.1, step=5)) == [0]
    s.fired(0, at(1.1, step=5))
    assert s.due(at(9.0, step=50)) == []
    assert s.never_fired() == []


def test_a_fault_not_applied_yet_stays_due_until_it_is() -> None:
    s = schedule(KILL + "at: {step: 5}}")
    # The target was not found on this tick: the runner reports nothing and asks again.
    assert s.due(at(1.0, step=6)) == [0]
    assert s.due(at(1.2, step=7)) == [0]
    assert s.never_fired() == [0]


def test_time_and_event_counts() -> None:
    s = schedule(KILL + "at: {time: 2s}}",
                 KILL + "at: {event: checkpoint_saved, count: 3}}")
    assert s.due(at(1.99, checkpoint_saved=2)) == []
    assert s.due(at(2.0, checkpoint_saved=2)) == [0]
    assert s.due(at(2.0, checkpoint_saved=3)) == [0, 1]


def test_a_file_trigger_counts_only_watched_files() -> None:
    s = schedule(KILL + "at: {file: 'step_*', count: 2}}")
    assert s.due(Progress(now=1, elapsed=1, file_hits={})) == []  # the watch is gone
    assert s.due(Progress(now=1, elapsed=1, file_hits={0: 1})) == []
    assert s.due(Progress(now=1, elapsed=1, file_hits={0: 2})) == [0]


def test_every_steps_counts_from_the_step_seen_when_it_fired() -> None:
    s = schedule(KILL + "at: {step: 10}, every: {steps: 20, times: 3}}")
    s.fired(0, at(1.0, step=12))  # the loop saw step 12 when it applied it
    assert s.due(at(2.0, step=31)) == []
    assert s.due(at(2.1, step=32)) == [0]
    s.fired(0, at(2.1, step=33))
    assert s.due(at(3.0, step=52)) == []
    assert s.due(at(3.1, step=53)) == [0]
    s.fired(0, at(3.1, step=53))
    assert s.finished(0)
    assert s.repetition(0) == 3
    assert s.due(at(9.0, step=500)) == []


def test_repeats_that_never_came_are_listed() -> None:
    # Three repetitions asked for; the run ended after the first: two never came. Listed
    # as never fired they are not (the fault did fire), so a run with 1 of 3 passed
    # faults_injected as "1/1".
    s = schedule(KILL + "at: {step: 10}, every: {steps: 20, times: 3}}",
                 KILL + "at: {step: 5}}")
    s.fired(0, at(1.0, step=12))
    s.fired(1, at(1.0, step=12))
    assert s.never_fired() == []
    assert s.missing_repeats() == [(0, 2, 3), (0, 3, 3)]
    s.fired(0, at(2.0, step=33))
    assert s.missing_repeats() == [(0, 3, 3)]
    s.fired(0, at(3.0, step=53))
    assert s.missing_repeats() == []
    # A fault that failed for good is not missing: its record says why.
    t = schedule(KILL + "at: {step: 10}, every: {steps: 20, times: 3}}")
    t.give_up(0)
    assert t.missing_repeats() == []


def test_every_time_counts_from_when_it_fired() -> None:
    s = schedule(KILL + "at: {event: checkpoint_saved}, every: {time: 5s, times: 2}}")
    assert s.due(at(3.0, checkpoint_saved=1)) == [0]
    s.fired(0, at(3.5, checkpoint_saved=1))
    assert s.due(at(8.4, checkpoint_saved=9)) == []
    assert s.due(at(8.5)) == [0]
    s.fired(0, at(8.5))
    assert s.finished(0)


def test_an_in_process_step_fault_is_armed_ahead_with_its_own_step_each_time() -> None:
    s = schedule("{kind: collective.error, target: {rank: 1}, at: {step: 10}, "
                 "every: {steps: 5, times: 3}}")
    # Armed before step 10 is reached: the probe waits for it.
    assert s.due(at(0.5)) == [0]
    assert s.arm_step(0) == 10
    s.fired(0, at(0.5))
    assert s.due(at(0.6)) == [0]  # the next repeat is armed at once ...
    assert s.arm_step(0) == 15  # ... for its own step
    s.fired(0, at(0.6))
    assert s.arm_step(0) == 20
    s.fired(0, at(0.7))
    assert s.finished(0)


def test_an_out_of_process_step_fault_is_armed_at_its_step() -> None:
    s = schedule(KILL + "at: {step: 10}, every: {steps: 5, times: 2}}")
    assert s.arm_step(0) == 10
    assert s.due(at(0.5)) == []


def test_give_up_ends_a_fault_and_it_does_not_count_as_never_reached() -> None:
    s = schedule(KILL + "at: {step: 1}, every: {steps: 1, times: 5}}", KILL + "at: {step: 99}}")
    s.give_up(0)
    assert s.due(at(1.0, step=50)) == []
    assert s.never_fired() == [1]


def test_a_trigger_with_after_waits_for_that_event_too() -> None:
    """``after``: the spare's hello came after step 20 (a loaded machine); the kill waits
    for it and lands at the first moment both hold, not at step 20 on a job without it."""
    s = schedule(KILL + "at: {step: 20, after: {event: hello, role: spare}}}",
                 KILL + "at: {time: 1s, after: {event: checkpoint_saved, count: 2}}}")

    def p(now: float, step: int, hellos: int, saves: int) -> Progress:
        return Progress(now=now, elapsed=now, max_step=step, awaited={0: hellos, 1: saves})

    assert s.due(p(2.0, 25, 0, 1)) == []  # past step 20 and 1 s, neither event yet
    assert s.due(p(2.1, 26, 1, 1)) == [0]
    assert s.due(p(2.2, 27, 1, 2)) == [0, 1]
    s.fired(0, p(2.2, 27, 1, 2))
    assert s.never_fired() == [1]


def test_after_is_refused_on_a_file_trigger() -> None:
    with pytest.raises(SpecError, match="`after` works with `step`, `time` or `event`"):
        schedule(KILL + "at: {file: 'step_*', after: {event: hello}}}")
