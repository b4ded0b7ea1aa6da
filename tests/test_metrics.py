"""Metrics and checks on hand-written timelines: each check shown passing and failing."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from aftershock.harness.run.records import Event, FaultRecord
from aftershock.harness.scenario.spec import Budget, CountBudget, Expect, LogProbe
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import Outcome, evaluate


def ev(t: float, event: str, **fields: object) -> Event:
    return Event(t=t, event=event, source="test", fields=dict(fields))


def step(t: float, n: int, rank: int, gen: object = 0, **fields: object) -> Event:
    """Step ``n`` committed by ``rank`` in world ``gen``, stamped by the probe (its own clock)."""
    return ev(t, "step", step=n, rank=rank, generation=gen, **fields)


def steps(t0: float, first: int, last: int, ranks: int | list[int] = 2, dt: float = 0.1,
          gen: object = 0) -> list[Event]:
    who = range(ranks) if isinstance(ranks, int) else ranks
    out = []
    for i, n in enumerate(range(first, last + 1)):
        out += [step(t0 + i * dt, n, r, gen) for r in who]
    return out


def log_step(t: float, n: int, rank: int, clock: str | None, gen: object = 0) -> Event:
    """A step read from a log line: ``clock: line`` when ``t`` was parsed from the line,
    ``read`` (or absent, as in timelines recorded before) when ``t`` is the read time."""
    fields: dict[str, object] = {"step": n, "rank": rank, "generation": gen}
    if clock is not None:
        fields["clock"] = clock
    return Event(t=t, event="step", source="log", fields=fields)


def timeline(*parts: Event | list[Event]) -> list[Event]:
    flat = [e for p in parts for e in (p if isinstance(p, list) else [p])]
    return sorted(flat, key=lambda e: e.t)


def restart_timeline() -> list[Event]:
    """Generation 0 commits steps 1..10; fault at t=1.05, detection at 1.2; generation 1
    loads the checkpoint of step 6 and commits 7..20."""
    return timeline(
        steps(0.0, 1, 10),
        ev(1.05, "fault_injected", rank=1),
        ev(1.2, "failure_detected", rank=0, generation=0),
        [ev(2.9, "hello", rank=r, generation=1) for r in range(2)],
        [ev(2.95, "checkpoint_loaded", rank=r, step=6, generation=1) for r in range(2)],
        steps(3.0, 7, 20, gen=1),
        ev(5.0, "params", rank=0, digest="aa", generation=1),
        ev(5.0, "params", rank=1, digest="bb", generation=1),
    )


def without_identity(events: list[Event]) -> list[Event]:
    return [Event(e.t, e.event, e.source, {k: v for k, v in e.fields.items()
                                           if k != "generation"}) for e in events]


def test_time_to_detect() -> None:
    assert metrics.time_to_detect(restart_timeline()) == pytest.approx(0.15)


def test_time_to_detect_none_without_acknowledgement() -> None:
    events = [e for e in restart_timeline() if e.event != "failure_detected"]
    assert metrics.time_to_detect(events) is None


# ------------------------------------------------------------------- time_to_recover


def test_time_to_recover_needs_every_rank() -> None:
    events = restart_timeline()
    assert metrics.time_to_recover(events, 2) == pytest.approx(3.0 - 1.05)
    # With one rank missing after the restart the world is never whole again.
    partial = [e for e in events if not (e.event == "step" and e.t >= 3.0 and e.rank == 1)]
    assert metrics.time_to_recover(partial, 2) is None
    assert "rank 1" in metrics.recovery(partial, 2).reason


def test_a_frozen_rank_that_never_commits_again_is_not_recovery() -> None:
    # Rank 1 is frozen after step 10 and never thawed; rank 0 finishes the step it was in.
    events = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1),
                      step(1.08, 11, 0))
    found = metrics.recovery(events, 2)
    assert found.seconds is None
    assert "rank 1" in found.reason


def test_a_step_after_the_run_timed_out_proves_nothing() -> None:
    # The frozen rank is thawed by the harness's teardown (it heals every fault, and thaws
    # stopped processes before it kills them) and finishes its step: not recovery.
    events = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1), step(1.08, 11, 0),
                      ev(25.0, "timeout", after_s=25.0), ev(25.01, "fault_healed"),
                      step(25.02, 11, 1), ev(25.5, "run_end", exit_code=None, timed_out=True))
    assert metrics.time_to_recover(events, 2) is None


def test_read_time_never_proves_a_step_came_after_the_fault() -> None:
    # torchrun --tee batches output: both ranks' lines of step 11, written before the
    # freeze, are read 50 ms after it. Read time is only an upper bound on when a line was
    # written: it cannot prove anything came after the fault.
    before = [log_step(0.1 * n, n, r, "line") for n in range(1, 11) for r in range(2)]
    fault = ev(1.05, "fault_injected", rank=1)
    for clock in ("read", None):  # None: a timeline recorded before lines had a clock
        late = [log_step(1.1, 11, r, clock) for r in range(2)]
        found = metrics.recovery(timeline(before, fault, late), 2)
        assert found.seconds is None
        assert "time" in found.reason
    # The same lines carrying their own time (written 22 ms before the freeze): not recovery.
    written = [log_step(1.028, 11, r, "line") for r in range(2)]
    assert metrics.time_to_recover(timeline(before, fault, written), 2) is None
    # Lines whose own time is after the fault do prove it, at that time (not the read time).
    resumed = [log_step(1.5, 11, 0, "line"), log_step(1.6, 11, 1, "line")]
    assert metrics.time_to_recover(timeline(before, fault, resumed), 2) == pytest.approx(0.55)


def test_a_step_committed_while_the_fault_was_being_applied_proves_nothing() -> None:
    # The fault's moment is when applying it began (t=1.05); SIGSTOP landed by 1.06. Both
    # ranks committed step 11 in between, then the world never committed again.
    events = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1, applied_at=1.06),
                      step(1.055, 11, 0), step(1.056, 11, 1))
    assert metrics.time_to_recover(events, 2) is None
    # Steps after it had landed prove recovery, timed from the fault's moment.
    events = timeline(events, step(1.1, 12, 0), step(1.2, 12, 1))
    assert metrics.time_to_recover(events, 2) == pytest.approx(0.15)


def test_steps_of_the_doomed_generation_are_not_recovery() -> None:
    # Both ranks commit step 11 just after the fault; the world is then replaced anyway.
    late = [step(1.1, 11, 0), step(1.1, 11, 1)]
    events = timeline(restart_timeline(), late)
    assert metrics.time_to_recover(events, 2) == pytest.approx(3.0 - 1.05)
    # Even when the system reports no detection at all (net_reset on a loaded machine).
    quiet = [e for e in events if e.event != "failure_detected"]
    assert metrics.time_to_recover(quiet, 2) == pytest.approx(3.0 - 1.05)


def test_a_world_that_failed_did_not_recover() -> None:
    late = [step(1.1, 11, 0), step(1.1, 11, 1)]
    base = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1), late)
    # Its own members report the failure after the step...
    failed = timeline(base, ev(1.3, "failure_detected", rank=0, generation=0))
    assert metrics.time_to_recover(failed, 2) is None
    # ... or the run ends in failure with that world last.
    crashed = timeline(base, ev(1.4, "run_end", exit_code=1, timed_out=False))
    assert metrics.time_to_recover(crashed, 2) is None
    # A fault the world rides through (nothing replaced it, the run succeeded): recovered.
    fine = timeline(base, ev(1.4, "run_end", exit_code=0, timed_out=False))
    assert metrics.time_to_recover(fine, 2) == pytest.approx(0.05)


def test_recovery_is_from_every_fault_not_only_the_first() -> None:
    # Killed at 1.05, the world restarts and is whole at step 7 in generation 1 (t=3.0);
    # at 4.0 a second fault freezes rank 1 for good. Nothing replaces generation 1 and it
    # reports no failure: it just stops. Whole once between the faults is no recovery from
    # the second: recovery was not observed.
    frozen = [e for e in restart_timeline() if e.t < 4.0 or e.event != "step"]
    events = timeline(frozen, ev(4.0, "fault_injected", rank=1, applied_at=4.01),
                      step(4.05, 17, 0, gen=1), ev(30.0, "timeout", after_s=30.0))
    found = metrics.recovery(events, 2)
    assert found.seconds is None, found
    assert "after the last fault" in found.reason
    # The second freeze thawed, every rank commits again: recovered from both, timed from
    # the first fault (the world was whole at step 17 in between; what counts is after).
    thawed = timeline(events[:-1], step(5.0, 17, 1, gen=1), step(5.1, 18, 0, gen=1),
                      step(5.1, 18, 1, gen=1))
    assert metrics.time_to_recover(thawed, 2) == pytest.approx(5.0 - 1.05)


def test_step_rate_needs_progress_after_the_fault() -> None:
    from aftershock.harness.scenario.spec import RateFloor

    # 10 steps/s for 4 s, then the fault, and the job exits in failure without another
    # step. Its windows end at its last step, before the fault: "10 steps/s" would describe
    # the run before the fault only.
    events = timeline(steps(0.0, 1, 40, ranks=1, dt=0.1), ev(4.0, "fault_injected", rank=0),
                      ev(4.2, "run_end", exit_code=1, timed_out=False))
    expect = Expect(completes=False, step_rate=RateFloor(min=1))
    check = run_checks(expect, events=events)["step_rate"]
    assert not check.passed, check
    assert check.message.startswith("not observed: no step was committed after the fault")
    # Steps after the fault: measured as before.
    went_on = timeline(events[:-1], steps(4.3, 41, 60, ranks=1, dt=0.1),
                       ev(6.5, "run_end", exit_code=0, timed_out=False))
    assert run_checks(expect, events=went_on)["step_rate"].passed


def test_steps_without_world_identity_prove_nothing() -> None:
    found = metrics.recovery(without_identity(restart_timeline()), 2)
    assert found.seconds is None
    assert "world" in found.reason


def test_a_step_belongs_to_the_world_its_process_last_declared() -> None:
    # Probe events without `generation` (timelines recorded before the probe stamped it):
    # the generation of the process's last hello (same pid) is theirs.
    def probe_event(t: float, event: str, rank: int, pid: int, **fields: object) -> Event:
        return Event(t, event, f"rank{rank}", {"rank": rank, "pid": pid, **fields})

    events = timeline(
        [probe_event(0.0, "hello", r, 10 + r, generation=0) for r in range(2)],
        [probe_event(0.1 * n, "step", r, 10 + r, step=n) for n in range(1, 11) for r in (0, 1)],
        ev(1.05, "fault_injected", rank=1),
        [probe_event(2.9, "hello", r, 20 + r, generation=1) for r in range(2)],
        [probe_event(3.0 + 0.1 * i, "step", r, 20 + r, step=n)
         for i, n in enumerate(range(7, 21)) for r in (0, 1)],
    )
    found = metrics.recovery(events, 2)
    assert found.seconds == pytest.approx(3.0 - 1.05)
    assert found.generation == 1


def test_a_world_with_a_member_missing_does_not_count() -> None:
    # Elastic: replica 0 (ranks 0, 1) is dropped; ranks 2, 3 go on alone in generation 1;
    # the world is whole again only when generation 2 brings replica 0 back.
    events = timeline(
        steps(0.0, 1, 10, ranks=4),
        ev(1.05, "fault_injected", rank=1),
        steps(1.5, 11, 20, ranks=[2, 3], gen=1),
        [ev(2.45, "recovery_done", rank=r, step=20, generation=2) for r in range(4)],
        steps(2.5, 21, 30, ranks=4, gen=2),
    )
    assert metrics.time_to_recover(events, 4) == pytest.approx(2.5 - 1.05)
    assert metrics.skipped_steps(events) == 0  # ranks 0, 1 caught up from their peers
    assert metrics.lost_steps(events) == 0


# ----------------------------------------------------------------- split brain, lost steps


def split_brain(zombie: bool) -> list[Event]:
    """Ranks 0 and 1 are one replica group each. Group 1 is frozen after step 25; group 0
    goes on alone in world "q2" (steps 26..79); group 1 is thawed and redoes 26..79 alone,
    in a world of its own ("q3") or, as a zombie, still in the old world "q1"."""
    return timeline(
        steps(0.0, 1, 25, gen="q1", dt=0.05),
        ev(1.26, "fault_injected", rank=1),
        steps(5.0, 26, 79, ranks=[0], gen="q2"),
        steps(20.0, 26, 79, ranks=[1], gen="q1" if zombie else "q3"),
    )


@pytest.mark.parametrize("zombie", [False, True])
def test_a_split_brain_is_no_recovery_and_its_duplicated_work_is_lost(zombie: bool) -> None:
    events = split_brain(zombie)
    assert metrics.time_to_recover(events, 2) is None
    assert metrics.forked_steps(events) == 54
    assert metrics.lost_steps(events) == 54  # 54 steps were computed twice


def test_a_rollback_is_not_a_split_brain() -> None:
    late = [step(1.1, 11, 0), step(1.1, 11, 1)]  # the doomed world's last step
    events = timeline(restart_timeline(), late)
    assert metrics.forked_steps(events) == 0
    assert metrics.lost_steps(events) == 5  # 7..11 committed again by generation 1


def test_a_zombie_world_that_later_rejoins_still_forked() -> None:
    # Group 1 thaws and commits 26, 27 in the old world while group 0's world "q2" has
    # already committed them; then it rejoins ("q4", both groups). The final history is
    # consistent, but two worlds made progress on the same steps at the same time.
    events = timeline(
        steps(0.0, 1, 25, gen="q1", dt=0.05),
        ev(1.26, "fault_injected", rank=1),
        steps(5.0, 26, 30, ranks=[0], gen="q2"),
        steps(6.0, 26, 27, ranks=[1], gen="q1"),
        steps(8.0, 31, 40, gen="q4"),
    )
    assert metrics.forked_steps(events) == 2
    assert metrics.time_to_recover(events, 2) == pytest.approx(8.0 - 1.26)


def test_single_history_cannot_be_proven_without_world_identity() -> None:
    assert metrics.forked_steps(without_identity(split_brain(False))) is None
    assert metrics.forked_steps(steps(0.0, 1, 10)) == 0  # no fault: one history


def test_lost_steps_counts_recomputed_steps() -> None:
    assert metrics.lost_steps(restart_timeline()) == 4  # steps 7, 8, 9, 10 ran twice
    assert metrics.lost_steps(steps(0.0, 1, 10)) == 0
    # Rolled back within one world (e.g. to the last matching fingerprints): 8..10 again.
    assert metrics.lost_steps(timeline(steps(0.0, 1, 10), steps(1.1, 8, 12))) == 3
    # Without world identity each rank's own repeats still count.
    assert metrics.lost_steps(without_identity(restart_timeline())) == 4


# ------------------------------------------------------------------------ skipped steps


def test_skipped_steps() -> None:
    assert metrics.skipped_steps(restart_timeline()) == 0
    # Generation 1 loaded the checkpoint of step 6 but its first step is 8: 7 was skipped.
    jumped = [e for e in restart_timeline() if not (e.event == "step" and e.fields["step"] == 7
                                                    and e.t > 2)]
    assert metrics.skipped_steps(jumped) == 1
    # No resume point reported: generation 1 starts at 12 although nobody committed 11.
    no_ckpt = [e for e in restart_timeline() if e.event != "checkpoint_loaded"]
    late_start = [e for e in no_ckpt if not (e.event == "step" and e.t > 2
                                             and e.fields["step"] <= 11)]
    assert metrics.skipped_steps(late_start) == 1
    # Within one world the ranks jump from 10 to 12.
    assert metrics.skipped_steps(timeline(steps(0.0, 1, 10), steps(1.0, 12, 20))) == 1
    # One rank's report of step 5 is missing (two ranks' log lines ran together and only
    # the first matched) while its world committed it: no skip.
    lost_line = [e for e in steps(0.0, 1, 10) if (e.fields["step"], e.rank) != (5, 1)]
    assert metrics.skipped_steps(lost_line) == 0


def test_skipped_steps_are_unobservable_when_not_every_step_is_reported() -> None:
    sparse = [step(0.1 * n, n, r) for n in range(10, 101, 10) for r in range(2)]
    assert metrics.skipped_steps(sparse) is None
    assert metrics.skipped_steps([]) is None


# -------------------------------------------------------------------------- final params


def test_final_digests_take_the_last_report() -> None:
    events = [*restart_timeline(), ev(6.0, "params", rank=0, digest="cc", generation=1)]
    assert metrics.final_digests(events) == {0: "cc", 1: "bb"}


def test_final_digests_come_from_the_final_world_only() -> None:
    # A survivor of generation 0 reports a digest as it crashes; generation 1 hangs and
    # only rank 1 reports. Rank 0's generation-0 digest is not the run's result.
    events = timeline(
        [e for e in restart_timeline() if not (e.event == "params" and e.rank == 0)],
        ev(1.3, "params", rank=0, digest="aa", generation=0),
    )
    assert metrics.final_digests(events) == {1: "bb"}
    (check,) = [c for c in evaluate(Expect(completes=False, params_match="fault_free"),
                                    outcome=Outcome(None, True, 6.0), metrics={}, faults=[],
                                    digests=metrics.final_digests(events),
                                    baseline={0: "aa", 1: "bb"}, events=events, world=2)
                if c.name == "params_match"]
    assert not check.passed
    assert check.observed == "1/2 ranks reported"
    assert "rank 0" in check.message


def run_checks(expect: Expect, *, exit_code: int = 0, digests: dict[int, str] | None = None,
               baseline: dict[int, str] | None = None, timed_out: bool = False,
               events: list[Event] | None = None):
    events = restart_timeline() if events is None else events
    return {
        c.name: c
        for c in evaluate(
            expect,
            outcome=Outcome(exit_code, timed_out, 6.0),
            metrics=metrics.compute(events, 2),
            faults=[FaultRecord("process.kill", "rank 1", 1.05, None)],
            digests=digests if digests is not None else metrics.final_digests(events),
            baseline=baseline,
            events=events,
            world=2,
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


def test_time_to_detect_needs_every_fault_detected() -> None:
    # Killed at 1.05 and detected at 1.2; the restarted world is frozen at 4.0 and the
    # system never says so. A budget met by the first detection alone is not met by the run.
    budget = Expect(completes=False, time_to_detect=Budget(max=timedelta(seconds=1)))
    before = [e for e in restart_timeline() if e.t < 4.0 or e.event != "step"]
    frozen = timeline(before, ev(4.0, "fault_injected", rank=1))
    check = run_checks(budget, events=frozen)["time_to_detect"]
    assert not check.passed, check
    assert "not observed: fault 2 of 2 was never followed by a failure_detected, and the " \
        "system did not ride through it" in check.message
    # A fault the system rode through needs no detection: a 1 s hang under its timeout,
    # after which every rank of the same world committed again.
    rode = timeline(restart_timeline(), ev(4.0, "fault_injected", rank=1))
    check = run_checks(budget, events=rode)["time_to_detect"]
    assert check.passed, check
    assert "rode through fault 2" in check.message
    # ... also when it came first: it does not take the later fault's detection as its own
    # (first fault at 0.25). Two kills a moment apart (1.05 and 1.06), one detection after
    # both: it answers both.
    for first_at, first_rank in ((0.25, 1), (1.06, 0)):
        events = timeline(steps(0.0, 1, 10), ev(first_at, "fault_injected", rank=first_rank),
                          ev(1.05, "fault_injected", rank=1),
                          ev(1.2, "failure_detected", rank=0, generation=0))
        check = run_checks(budget, events=events)["time_to_detect"]
        assert check.passed, (first_at, check)
        assert check.observed == pytest.approx(0.15)  # the slowest: from 1.05
    # A system that rode through everything detected nothing: not observed.
    quiet = timeline(steps(0.0, 1, 30), ev(0.25, "fault_injected", rank=1),
                     ev(1.05, "fault_injected", rank=1))
    check = run_checks(budget, events=quiet)["time_to_detect"]
    assert not check.passed
    assert "rode through every fault" in check.message
    # Detected 0.5 s later: the slowest detection is what the budget judges.
    seen = timeline(frozen, ev(4.5, "failure_detected", rank=0, generation=1))
    check = run_checks(budget, events=seen)["time_to_detect"]
    assert check.passed, check
    assert check.observed == pytest.approx(0.5)
    slow = run_checks(Expect(completes=False,
                             time_to_detect=Budget(max=timedelta(milliseconds=300))),
                      events=seen)["time_to_detect"]
    assert not slow.passed
    assert "fault 2 of 2" in slow.message
    # Each fault must be caught by the mechanism named: the second by a slower fallback fails.
    from aftershock.harness.scenario.spec import DetectBudget

    causes = timeline(frozen, ev(4.5, "failure_detected", rank=0, cause="wedged"))
    causes = [Event(e.t, e.event, e.source, {**e.fields, "cause": "heartbeat"})
              if e.event == "failure_detected" and e.t < 2 else e for e in causes]
    by = Expect(completes=False, time_to_detect=DetectBudget(max=timedelta(seconds=1),
                                                             cause=["heartbeat"]))
    check = run_checks(by, events=causes)["time_to_detect"]
    assert not check.passed, check
    assert "fault 2 of 2 was detected by wedged after 500ms, not by heartbeat" in check.message
    fixed = [Event(e.t, e.event, e.source, {**e.fields, "cause": "heartbeat"})
             if e.event == "failure_detected" else e for e in causes]
    assert run_checks(by, events=fixed)["time_to_detect"].passed


def test_lost_steps_is_not_observed_without_a_step_after_the_fault() -> None:
    # The job committed steps 1..10, the fault hit, and nothing was ever committed again (a
    # trainer that swallowed the error and exited 0, say): no step was done twice, but no
    # recovery happened either, so "at most N steps lost" proves nothing about one.
    stopped = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1),
                       ev(1.2, "failure_detected", rank=0, generation=0))
    check = run_checks(Expect(lost_steps=CountBudget(max=0)), events=stopped)["lost_steps"]
    assert not check.passed, check
    assert check.message.startswith("not observed: no step was committed after the fault")
    # Nothing committed at all: nothing to count either.
    check = run_checks(Expect(lost_steps=CountBudget(max=0)),
                       events=[ev(1.05, "fault_injected", rank=1)])["lost_steps"]
    assert not check.passed, check
    assert check.message.startswith("not observed: no step was committed")
    # A step committed after the fault is the evidence: then the count is the verdict.
    resumed = timeline(stopped, steps(3.0, 11, 12, gen=0))
    assert run_checks(Expect(lost_steps=CountBudget(max=0)), events=resumed)["lost_steps"].passed
    # So are the final parameters: a kill on the way out, after the job reported them,
    # found its work done (scenarios/explore/found/kill_on_exit_hot_spare.yaml), and what
    # it redid afterwards is the count.
    finished = timeline(steps(0.0, 1, 10), ev(1.01, "params", rank=0, digest="aa"),
                        ev(1.05, "fault_injected", rank=1))
    check = run_checks(Expect(lost_steps=CountBudget(max=0)), events=finished)["lost_steps"]
    assert check.passed, check
    redone = timeline(finished, steps(3.0, 1, 10, gen=1))
    assert not run_checks(Expect(lost_steps=CountBudget(max=0)),
                          events=redone)["lost_steps"].passed


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


def test_min_step_rate_counts_a_stall_the_harness_had_to_stop() -> None:
    # 10 steps/s for 4 s, then nothing until the harness's timeout 30 s later: the slowest
    # progress of that run was none at all, not the 10 steps/s it made before it hung.
    fast = steps(0.0, 1, 40, ranks=1, dt=0.1)
    hung = [*fast, ev(34.0, "timeout", after_s=34.0), ev(34.5, "run_end")]
    assert metrics.min_step_rate(hung) == 0.0
    # A run that ended by itself stops being measured at its last step: what follows is its
    # way out, not training.
    assert metrics.min_step_rate([*fast, ev(34.5, "run_end")]) == pytest.approx(10.0, abs=0.6)


def test_step_rate_and_straggler_checks() -> None:
    from aftershock.harness.scenario.spec import RateFloor

    straggle = ev(1.0, "fault_injected", kind="process.straggle", rank=1)
    events = [*steps(0.0, 1, 40, ranks=1, dt=0.1), straggle,
              ev(2.0, "straggler_detected", slow_rank=1)]
    slowed = [FaultRecord("process.straggle", "rank 1", 1.0, None)]
    expect = Expect(step_rate=RateFloor(min=5), straggler_named=True)
    checks = {c.name: c for c in evaluate(
        expect, outcome=Outcome(0, False, 4.0), metrics=metrics.compute(events, 1),
        faults=slowed, digests={}, baseline=None, events=events)}
    assert checks["step_rate"].passed
    assert checks["straggler_named"].passed
    wrong = [*steps(0.0, 1, 40, ranks=1, dt=0.1), straggle,
             ev(2.0, "straggler_detected", slow_rank=0)]
    checks = {c.name: c for c in evaluate(
        Expect(step_rate=RateFloor(min=20), straggler_named=True),
        outcome=Outcome(0, False, 4.0), metrics=metrics.compute(wrong, 1),
        faults=slowed, digests={}, baseline=None, events=wrong)}
    assert not checks["step_rate"].passed
    assert not checks["straggler_named"].passed
    assert checks["straggler_named"].observed == "rank 0"


@pytest.mark.parametrize("named", ["before", "everyone"])
def test_straggler_named_only_by_a_naming_that_singles_it_out(named: str) -> None:
    # Naming rank 1 before it was slowed proves nothing about the slowdown; naming every
    # rank names the slowed one too, and singles out nobody.
    straggle = ev(1.0, "fault_injected", kind="process.straggle", rank=1)
    named_at = {"before": [(0.5, 1)], "everyone": [(2.0, 0), (2.0, 1), (2.1, 2)]}[named]
    events = timeline(steps(0.0, 1, 40, ranks=3, dt=0.1), straggle,
                      [ev(t, "straggler_detected", slow_rank=r) for t, r in named_at])
    slowed = [FaultRecord("process.straggle", "rank 1", 1.0, None)]
    check = next(c for c in evaluate(Expect(completes=False, straggler_named=True),
                                     outcome=Outcome(0, False, 4.0), metrics={}, faults=slowed,
                                     digests={}, baseline=None, events=events)
                 if c.name == "straggler_named")
    assert not check.passed, check
    assert {"before": "before it was slowed", "everyone": "ranks 0, 2, which were not "
            "slowed"}[named] in check.message


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


def test_each_xid_needs_its_own_answer() -> None:
    # Xid 63 (row remapping: action none) twice on one process, 50 ms apart, answered once
    # after both: the one answer must not count for both.
    xids = [ev(t, "fault_injected", kind="gpu.xid", rank=0, pid=7, params={"code": 63})
            for t in (1.0, 1.05)]
    answer = ev(1.1, "xid_action", code=63, action="none", pid=7)
    went_on = [ev(t, "step", step=n, rank=0, pid=7) for n, t in enumerate((1.5, 2.5, 3.0))]

    def check(*events: Event):  # type: ignore[no-untyped-def]
        (result,) = evaluate(Expect(completes=False, xid_action=True),
                             outcome=Outcome(0, False, 1.0), metrics={}, faults=[],
                             digests={}, baseline=None,
                             events=timeline(*xids, *events, *went_on))
        return result

    once = check(answer)
    assert not once.passed, once
    assert "Xid 63: expected none, got none reported" in once.message
    assert check(answer, ev(1.2, "xid_action", code=63, action="none", pid=7)).passed


def test_single_history_check_fails_a_split_brain() -> None:
    expect = Expect(completes=False, single_history=True)
    assert run_checks(expect)["single_history"].passed
    split = run_checks(expect, events=split_brain(False))["single_history"]
    assert not split.passed
    assert split.observed == 54
    assert "q2" in split.message
    assert "q3" in split.message
    blind = run_checks(expect, events=without_identity(split_brain(False)))["single_history"]
    assert not blind.passed
    assert "not observed" in blind.message


def test_history_checks_are_not_observed_without_a_step_after_the_fault() -> None:
    # Nothing committed after the fault: no second world could fork, no step could be
    # jumped over, because nothing went on at all. Neither check may pass for that.
    stopped = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1))
    expect = Expect(completes=False, single_history=True,
                    skipped_steps=CountBudget(max=0))
    checks = run_checks(expect, events=stopped)
    for name in ("single_history", "skipped_steps"):
        assert not checks[name].passed, checks[name]
        assert checks[name].message.startswith(
            "not observed: no step was committed after the fault"), checks[name]
    # single_history needs the fault itself too: one the run never injected proves nothing.
    unfaulted = run_checks(expect, events=steps(0.0, 1, 10))["single_history"]
    assert not unfaulted.passed
    assert unfaulted.message.startswith("not observed: no fault was injected")
    # The restart timeline goes on after its fault: both are measured, and hold.
    resumed = run_checks(expect)
    assert resumed["single_history"].passed
    assert resumed["skipped_steps"].passed


def test_skipped_steps_check() -> None:
    expect = Expect(completes=False, skipped_steps=CountBudget(max=0))
    assert run_checks(expect)["skipped_steps"].passed
    jumped = timeline(steps(0.0, 1, 10), steps(1.0, 12, 20))
    bad = run_checks(expect, events=jumped)["skipped_steps"]
    assert not bad.passed
    assert bad.observed == 1
    sparse = [step(0.1 * n, n, r) for n in range(10, 101, 10) for r in range(2)]
    blind = run_checks(expect, events=sparse)["skipped_steps"]
    assert not blind.passed
    assert "not observed" in blind.message


def test_time_to_recover_check_says_why_recovery_was_not_observed() -> None:
    expect = Expect(completes=False, time_to_recover=Budget(max=timedelta(seconds=60)))
    events = timeline(steps(0.0, 1, 10), ev(1.05, "fault_injected", rank=1),
                      [log_step(1.1, 11, r, "read") for r in range(2)])
    check = run_checks(expect, events=events)["time_to_recover"]
    assert not check.passed
    assert check.observed is None
    assert "not observed" in check.message
    assert "time" in check.message


# ----------------------------------------------------------------- log lines and their time


def log_event(pattern: str, line: str, *, read_t: float = 101.0, offset: float = 1.7e9,
              started: float = 50.0, clock: str = "monotonic") -> Event:
    from aftershock.harness.run.logprobe import log_event as make

    spec = LogProbe(pattern=pattern, event="step", clock=clock)  # type: ignore[arg-type]
    match = re.search(spec.pattern, line)
    assert match is not None
    return make(spec, match, line, read_t=read_t, clock_offset=offset, started=started)


TIMED = r"\[rank (?P<rank>\d+)\] gen (?P<generation>\w+) step (?P<step>\d+) t=(?P<time>[\d.]+)"


def test_a_log_line_carries_its_own_monotonic_time() -> None:
    e = log_event(TIMED, "[rank 1] gen 2 step 7 t=100.500")
    assert e.t == pytest.approx(100.5)
    assert e.fields["clock"] == "line"
    assert e.fields["read_t"] == pytest.approx(101.0)
    assert (e.rank, e.fields["step"], e.fields["generation"]) == (1, 7, 2)
    assert "time" not in e.fields
    # World identities need not be numbers (a quorum id).
    assert log_event(TIMED, "[rank 1] gen q7 step 7 t=100.5").fields["generation"] == "q7"
    # Rounded up in print, a hair past the moment it was read: the read time bounds it.
    assert log_event(TIMED, "[rank 1] gen 0 step 7 t=101.0004").t == pytest.approx(101.0)


def test_a_log_line_may_carry_unix_time() -> None:
    e = log_event(TIMED, "[rank 1] gen 0 step 7 t=1700000100.25", clock="unix")
    assert e.t == pytest.approx(100.25)  # minus the offset the harness recorded at launch
    assert e.fields["clock"] == "line"


def test_a_log_time_on_the_wrong_clock_is_not_evidence() -> None:
    # Unix time read as monotonic lies far after the read time; monotonic time read as
    # Unix time lies before the launch. Either way the line proves nothing: read time only.
    for line, clock in (("[rank 1] gen 0 step 7 t=1700000100.25", "monotonic"),
                        ("[rank 1] gen 0 step 7 t=100.25", "unix")):
        e = log_event(TIMED, line, clock=clock)
        assert e.t == pytest.approx(101.0)
        assert e.fields["clock"] == "read"
        assert "time_rejected" in e.fields
    nan = log_event(r"step (?P<step>\d+) t=(?P<time>\S+)", "step 7 t=nan")
    assert (nan.t, nan.fields["clock"]) == (pytest.approx(101.0), "read")


def test_a_log_line_without_time_is_stamped_when_read() -> None:
    e = log_event(r"\[rank (?P<rank>\d+)\] step (?P<step>\d+)", "[rank 0] step 3")
    assert e.t == pytest.approx(101.0)
    assert e.fields["clock"] == "read"


def test_log_probe_groups_are_checked() -> None:
    with pytest.raises(ValidationError, match="generation"):
        LogProbe(pattern=r"step (?P<step>\d+) world (?P<world>\d+)", event="step")
    with pytest.raises(ValidationError, match="time"):
        LogProbe(pattern=r"step (?P<step>\d+)", event="step", clock="unix")


def test_the_probe_stamps_the_world_of_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aftershock.harness import probe

    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(probe.EVENTS_ENV, str(path))
    monkeypatch.setattr(probe, "_generation", None)
    monkeypatch.setattr(probe, "_fd", None)
    monkeypatch.setattr(probe, "_fd_path", None)
    probe.emit("exit", code=0)  # before any hello: no world to name
    probe.hello(world=2, generation=3)
    probe.step(1, world=2)
    probe.step(2, world=2, generation=4)  # a survivor names its new world in its steps
    probe.params("ab")
    probe.detected("peer died", generation=7)  # an explicit generation is kept, not adopted
    probe.params("cd")
    assert probe._fd is not None
    os.close(probe._fd)
    found = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e.get("generation") for e in found] == [None, 3, 3, 4, 4, 7, 4]
