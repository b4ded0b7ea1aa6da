"""Metrics and checks on hand-written timelines: each check shown passing and failing."""

from __future__ import annotations

from datetime import timedelta

import pytest

from harness import metrics
from harness.checks import Outcome, evaluate
from harness.records import Event, FaultRecord
from harness.spec import Budget, CountBudget, Expect


def ev(t: float, event: str, **fields: object) -> Event:
    return Event(t=t, event=event, source="test", fields=dict(fields))


def steps(t0: float, first: int, last: int, ranks: int = 2, dt: float = 0.1) -> list[Event]:
    out = []
    for i, n in enumerate(range(first, last + 1)):
        out += [ev(t0 + i * dt, "step", step=n, rank=r) for r in range(ranks)]
    return out


def restart_timeline() -> list[Event]:
    """Steps 1..10, fault at t=1.05, detection at 1.2, resume from 6, finish at 20."""
    return [
        *steps(0.0, 1, 10),
        ev(1.05, "fault_injected", rank=1),
        ev(1.2, "failure_detected", rank=0),
        *steps(3.0, 7, 20),
        ev(5.0, "params", rank=0, digest="aa"),
        ev(5.0, "params", rank=1, digest="bb"),
    ]


def test_time_to_detect() -> None:
    assert metrics.time_to_detect(restart_timeline()) == pytest.approx(0.15)


def test_time_to_detect_none_without_acknowledgement() -> None:
    events = [e for e in restart_timeline() if e.event != "failure_detected"]
    assert metrics.time_to_detect(events) is None


def test_time_to_recover_needs_every_rank() -> None:
    events = restart_timeline()
    assert metrics.time_to_recover(events, 2) == pytest.approx(3.0 - 1.05)
    # With one rank missing after the restart the world is never whole again.
    partial = [e for e in events if not (e.event == "step" and e.t >= 3.0 and e.rank == 1)]
    assert metrics.time_to_recover(partial, 2) is None


def test_steps_of_the_doomed_generation_are_not_recovery() -> None:
    # Both ranks report step 11 just after the fault but before detection.
    late = [ev(1.1, "step", step=11, rank=0), ev(1.1, "step", step=11, rank=1)]
    events = [*restart_timeline(), *late]
    events.sort(key=lambda e: e.t)
    assert metrics.time_to_recover(events, 2) == pytest.approx(3.0 - 1.05)


def test_lost_steps_counts_recomputed_steps() -> None:
    assert metrics.lost_steps(restart_timeline()) == 4  # steps 7, 8, 9, 10 ran twice
    assert metrics.lost_steps(steps(0.0, 1, 10)) == 0


def test_full_world_defaults_to_ranks_seen_before_the_fault() -> None:
    assert metrics.full_world(restart_timeline(), None) == 2


def test_final_digests_take_the_last_report() -> None:
    events = [*restart_timeline(), ev(6.0, "params", rank=0, digest="cc")]
    assert metrics.final_digests(events) == {0: "cc", 1: "bb"}


def run_checks(expect: Expect, *, exit_code: int = 0, digests: dict[int, str] | None = None,
               baseline: dict[int, str] | None = None, timed_out: bool = False):
    events = restart_timeline()
    return {
        c.name: c
        for c in evaluate(
            expect,
            outcome=Outcome(exit_code, timed_out, 6.0),
            metrics=metrics.compute(events, 2),
            faults=[FaultRecord("process.kill", "rank 1", 1.05, None)],
            digests=digests if digests is not None else metrics.final_digests(events),
            baseline=baseline,
        )
    }


def test_budget_checks_pass_and_fail() -> None:
    ok = run_checks(Expect(time_to_detect=Budget(max=timedelta(seconds=1)),
                           time_to_recover=Budget(max=timedelta(seconds=5)),
                           lost_steps=CountBudget(max=4)))
    assert all(c.passed for c in ok.values())
    bad = run_checks(Expect(time_to_detect=Budget(max=timedelta(milliseconds=100)),
                            time_to_recover=Budget(max=timedelta(seconds=1)),
                            lost_steps=CountBudget(max=3)))
    assert not bad["time_to_detect"].passed
    assert bad["time_to_detect"].observed == pytest.approx(0.15)
    assert "over <= 100ms" in bad["time_to_detect"].message
    assert not bad["time_to_recover"].passed
    assert not bad["lost_steps"].passed
    assert bad["lost_steps"].observed == 4


def test_completes_fails_on_nonzero_exit_and_timeout() -> None:
    assert not run_checks(Expect(), exit_code=1)["completes"].passed
    timed = run_checks(Expect(), timed_out=True)["completes"]
    assert not timed.passed
    assert timed.observed == "timed out"


def test_params_match_catches_a_differing_rank() -> None:
    expect = Expect(params_match="fault_free")
    assert run_checks(expect, baseline={0: "aa", 1: "bb"})["params_match"].passed
    bad = run_checks(expect, baseline={0: "aa", 1: "xx"})["params_match"]
    assert not bad.passed
    assert bad.observed == "1/2 ranks equal"
    assert "rank 1" in bad.message
    missing = run_checks(expect, digests={}, baseline={0: "aa"})["params_match"]
    assert not missing.passed
    assert "no final parameters" in missing.message


def test_a_fault_that_never_fired_fails_the_run() -> None:
    checks = evaluate(Expect(), outcome=Outcome(0, False, 1.0), metrics={},
                      faults=[FaultRecord("process.kill", "rank 1", None, None)],
                      digests={}, baseline=None)
    by_name = {c.name: c for c in checks}
    assert not by_name["faults_injected"].passed
    assert by_name["faults_injected"].observed == "0/1"


def test_min_step_rate_sees_the_slow_stretch() -> None:
    fast = steps(0.0, 1, 40, ranks=1, dt=0.1)  # 10 steps/s for 4 s
    slow = steps(4.0, 41, 44, ranks=1, dt=1.0)  # then 1 step/s for 4 s
    rate = metrics.min_step_rate([*fast, *slow])
    assert rate is not None
    assert rate <= 1.0
    assert metrics.min_step_rate(fast) == pytest.approx(10.0, abs=0.6)
    assert metrics.min_step_rate(steps(0.0, 1, 5, ranks=1)) is None  # under 2 s: unmeasured


def test_step_rate_and_straggler_checks() -> None:
    from harness.spec import RateFloor

    events = [*steps(0.0, 1, 40, ranks=1, dt=0.1), ev(2.0, "straggler_detected", slow_rank=1)]
    slowed = [FaultRecord("process.straggle", "rank 1", 1.0, None)]
    expect = Expect(step_rate=RateFloor(min=5), straggler_named=True)
    checks = {c.name: c for c in evaluate(
        expect, outcome=Outcome(0, False, 4.0), metrics=metrics.compute(events, 1),
        faults=slowed, digests={}, baseline=None, events=events)}
    assert checks["step_rate"].passed
    assert checks["straggler_named"].passed
    wrong = [*steps(0.0, 1, 40, ranks=1, dt=0.1), ev(2.0, "straggler_detected", slow_rank=0)]
    checks = {c.name: c for c in evaluate(
        Expect(step_rate=RateFloor(min=20), straggler_named=True),
        outcome=Outcome(0, False, 4.0), metrics=metrics.compute(wrong, 1),
        faults=slowed, digests={}, baseline=None, events=wrong)}
    assert not checks["step_rate"].passed
    assert not checks["straggler_named"].passed
    assert checks["straggler_named"].observed == "rank 0"


def test_xid_action_check_wants_nvidias_action() -> None:
    injected = ev(1.0, "fault_injected", kind="gpu.xid", rank=0, params={"code": 48})

    def check(*answers: Event):  # type: ignore[no-untyped-def]
        (result,) = evaluate(Expect(completes=False, xid_action=True),
                             outcome=Outcome(0, False, 1.0), metrics={}, faults=[],
                             digests={}, baseline=None, events=[injected, *answers])
        return result

    # Announced, and done: the process hit left its GPU (the harness saw it exit).
    assert check(ev(1.1, "xid_action", code=48, action="reset_gpu"),
                 ev(1.2, "target_exited", kind="gpu.xid")).passed
    # Announced only: tests/test_xid_effect.py.
    wrong = check(ev(1.1, "xid_action", code=48, action="restart_app"))
    assert not wrong.passed
    assert "expected reset_gpu, got restart_app" in wrong.message
    assert not check().passed  # a system that ignores the Xid fails
