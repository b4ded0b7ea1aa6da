"""`lost_steps` with `snapshot_interval`: the limit follows the snapshot interval the run
recorded, per restore from snapshots, on hand-written timelines (no processes).

The scenarios that show it on the real trainer: scenarios/training/
kill_shard_between_snapshots_elastic.yaml (tests/test_trainer_broken_recovery.py, against a
restore that goes back further than the newest complete snapshot).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aftershock.harness.run.records import CheckResult, Event, FaultRecord
from aftershock.harness.scenario.spec import CountBudget, Expect
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import Outcome, evaluate

pytestmark = pytest.mark.timeout(60)


def ev(t: float, event: str, **fields: object) -> Event:
    return Event(t=t, event=event, source="test", fields=dict(fields))


def steps(t0: float, first: int, last: int, gen: int) -> list[Event]:
    return [ev(t0 + i * 0.1, "step", step=n, rank=r, generation=gen)
            for i, n in enumerate(range(first, last + 1)) for r in range(2)]


def restored(t: float, gen: int, step: int, interval: int | None) -> list[Event]:
    """Generation ``gen`` is planned (``membership``, with the interval when recorded) and
    both ranks load the snapshots of ``step``."""
    plan = {"snapshot_every": interval} if interval is not None else {}
    return [ev(t, "membership", generation=gen, source="controller", **plan),
            *[ev(t + 0.01, "checkpoint_loaded", rank=r, step=step, generation=gen,
                 path=f"peer-memory snapshot of shard {r}") for r in range(2)]]


def timeline(interval: int | None, *, restores: int = 1) -> list[Event]:
    """Steps 1..10, a fault, then ``restores`` restores, each back to step 6 once step 10
    was committed again (4 steps done again each time), and steps on to 20."""
    events = [*restored(-1.0, 0, 0, interval)[:1], *steps(0.0, 1, 10, 0),
              ev(1.05, "fault_injected", rank=1)]
    newest, t = 10, 2.0
    for gen in range(1, restores + 1):
        events += restored(t, gen, newest - 4, interval)
        events += steps(t + 0.1, newest - 3, newest, gen)
        t += 1.0
    events += steps(t, newest + 1, 20, restores)
    return sorted(events, key=lambda e: e.t)


def lost(events: list[Event], budget: CountBudget) -> CheckResult:
    (check,) = [c for c in evaluate(
        Expect(lost_steps=budget), outcome=Outcome(0, False, 6.0),
        metrics=metrics.compute(events, 2), faults=[FaultRecord("process.kill", "rank 1", 1.05,
                                                                None)],
        digests={}, baseline=None, events=events, world=2) if c.name == "lost_steps"]
    return check


def test_the_limit_grows_with_the_recorded_interval() -> None:
    events = timeline(3)  # one restore losing 4 steps (7..10)
    assert metrics.lost_steps(events) == 4
    assert not lost(events, CountBudget(max=2)).passed  # the plain budget: 4 > 2
    check = lost(events, CountBudget(max=2, snapshot_interval=True))
    assert check.passed, check  # 1 x (2 + 3 - 1)
    assert check.expected.startswith("<= 4 (1 restore(s) from snapshots x (2 + interval 3"), \
        check.expected
    check = lost(events, CountBudget(max=1, snapshot_interval=True))
    assert not check.passed, check
    assert "at most 3" in check.message, check.message
    # Every step snapshotted: the interval adds nothing.
    assert not lost(timeline(1), CountBudget(max=3, snapshot_interval=True)).passed


def test_each_restore_may_lose_an_interval() -> None:
    events = timeline(3, restores=2)  # 4 + 4 steps done again
    assert metrics.lost_steps(events) == 8
    assert not lost(events, CountBudget(max=1, snapshot_interval=True)).passed  # 2 x (1 + 2)
    assert lost(events, CountBudget(max=2, snapshot_interval=True)).passed  # 2 x (2 + 2)
    # Each restore counted once, though both ranks reported it.
    assert "2 restore(s)" in lost(events, CountBudget(max=2, snapshot_interval=True)).expected


def test_without_a_restore_the_budget_is_max() -> None:
    events = [e for e in timeline(3) if e.event != "checkpoint_loaded"]
    check = lost(events, CountBudget(max=4, snapshot_interval=True))
    assert check.passed, check
    assert check.expected.startswith("<= 4 (0 restore(s)"), check.expected
    assert not lost(events, CountBudget(max=3, snapshot_interval=True)).passed


def test_a_run_that_recorded_no_interval_is_not_observed() -> None:
    check = lost(timeline(None), CountBudget(max=9, snapshot_interval=True))
    assert not check.passed
    assert check.message.startswith("not observed: the run recorded no snapshot interval")


def test_the_interval_is_for_lost_steps_only() -> None:
    with pytest.raises(ValidationError, match="applies to `lost_steps` only"):
        Expect(skipped_steps=CountBudget(max=0, snapshot_interval=True))
