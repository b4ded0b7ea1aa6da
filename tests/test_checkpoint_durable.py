"""expect.checkpoint_durable on hand-written timelines: a checkpoint the system called
committed before the fault must be what it resumes from (or something newer), whole."""

from __future__ import annotations

import pytest

from aftershock.harness.errors import SpecError
from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import Expect
from aftershock.harness.verdict.checks import Outcome, evaluate


def ev(t: float, event: str, rank: int | None = None, **fields: object) -> Event:
    if rank is not None:
        fields["rank"] = rank
    return Event(t=t, event=event, source="test" if rank is None else f"rank{rank}",
                 fields=dict(fields))


def check(events: list[Event]) -> CheckResult:
    (result,) = [r for r in evaluate(Expect(completes=False, checkpoint_durable=True),
                                     outcome=Outcome(0, False, 1.0), metrics={}, faults=[],
                                     digests={}, baseline=None, events=events)
                 if r.name == "checkpoint_durable"]
    return result


SAVED = [ev(1.0, "checkpoint_saved", 0, step=10), ev(2.0, "checkpoint_saved", 0, step=20),
         ev(3.0, "checkpoint_saved", 0, step=30)]
FAULT = ev(3.5, "fault_injected", kind="storage.lose_unsynced")


def test_resuming_from_the_last_saved_checkpoint_passes() -> None:
    result = check([*SAVED, FAULT, ev(9.0, "checkpoint_loaded", 0, step=30),
                    ev(9.0, "checkpoint_loaded", 1, step=30)])
    assert result.passed, result.message
    assert result.observed == "resumed from step 30"
    assert result.expected == "resume from step >= 30, none rejected"


def test_a_save_that_finished_after_the_fault_may_be_resumed_from() -> None:
    result = check([*SAVED, FAULT, ev(3.6, "checkpoint_saved", 0, step=40),
                    ev(9.0, "checkpoint_loaded", 0, step=40)])
    assert result.passed, result.message


def test_resuming_from_an_older_checkpoint_fails() -> None:
    result = check([*SAVED, FAULT, ev(9.0, "checkpoint_loaded", 0, step=30),
                    ev(9.0, "checkpoint_loaded", 1, step=20)])
    assert not result.passed
    assert "rank 1 resumed from step 20, older than step 30" in result.message
    assert "did not survive" in result.message


def test_each_fault_must_keep_what_was_saved_before_it() -> None:
    # Killed at 3.5, the job resumes from 30 and saves 40 and 50; killed again at 6.5, it
    # resumes from 40: step 50, saved before the second fault, did not survive it. Judged
    # by the first fault alone (resume from >= 30) this passed.
    second = [ev(4.0, "checkpoint_loaded", 0, step=30),
              ev(5.0, "checkpoint_saved", 0, step=40), ev(6.0, "checkpoint_saved", 0, step=50),
              ev(6.5, "fault_injected", kind="process.kill")]
    result = check([*SAVED, FAULT, *second, ev(8.0, "checkpoint_loaded", 0, step=40)])
    assert not result.passed, result
    assert "rank 0 resumed from step 40, older than step 50" in result.message
    assert check([*SAVED, FAULT, *second, ev(8.0, "checkpoint_loaded", 0, step=50)]).passed
    # A second kill inside the restore, before anything new was saved: 30 still stands.
    restore = [ev(3.8, "fault_injected", kind="process.kill"),
               ev(8.0, "checkpoint_loaded", 0, step=30)]
    assert check([*SAVED, FAULT, *restore]).passed


@pytest.mark.parametrize(("events", "says"), [
    ([*SAVED, FAULT], "reported no checkpoint_loaded after the fault"),
    ([*SAVED, ev(9.0, "checkpoint_loaded", 0, step=30)], "no fault landed"),
    ([ev(0.5, "fault_injected", kind="process.kill"), *SAVED,
      ev(9.0, "checkpoint_loaded", 0, step=30)], "no checkpoint saved before"),
])
def test_what_cannot_be_proved_fails_as_not_observed(events: list[Event], says: str) -> None:
    result = check(events)
    assert not result.passed
    assert "not observed" in result.message
    assert says in result.message


def test_a_checkpoint_the_loader_had_to_reject_fails() -> None:
    """The loader's checksums may save the run, but the writer published something that
    was not whole: that is the bug this check is for."""
    result = check([*SAVED, FAULT,
                    ev(8.0, "checkpoint_skipped", 1, path="step_000040/rank_1.pt",
                       reason="unreadable: FileNotFoundError"),
                    ev(9.0, "checkpoint_loaded", 0, step=30)])
    assert not result.passed
    assert "rank 1 had to reject step_000040/rank_1.pt (unreadable" in result.message


def test_a_rejection_before_the_fault_does_not_count() -> None:
    result = check([ev(0.5, "checkpoint_skipped", 0, path="old", reason="x"), *SAVED, FAULT,
                    ev(9.0, "checkpoint_loaded", 0, step=30)])
    assert result.passed, result.message


def test_the_scenario_format_guards_the_check() -> None:
    base = "name: x\nsystem: {command: [/bin/true]}\n"
    with pytest.raises(SpecError, match="checkpoint_durable needs at least one fault"):
        parse_scenario(base + "expect: {checkpoint_durable: true}\n")
    fault = "faults: [{kind: process.kill, target: {rank: 0}, at: {time: 1s}}]\n"
    with pytest.raises(SpecError, match=r"event: checkpoint_saved.*event: checkpoint_loaded"):
        parse_scenario(base + fault + "expect: {checkpoint_durable: true}\n")
    with pytest.raises(SpecError, match="needs a training system"):
        parse_scenario("name: x\nsystem: {reference: server}\n" + fault
                       + "expect: {checkpoint_durable: true}\n")


def test_a_resume_from_a_checkpoint_saved_again_after_the_fault_proves_nothing() -> None:
    """Seen on a loaded CI machine with PyTorch's DDP tutorial: the power loss took its
    snapshot, every rank started over (no resume) and saved epochs 0 and 5 again; a later
    failure then restarted it "from snapshot at Epoch 5", the new one. That resume passed
    the check, though the snapshot saved before the fault was lost."""
    before = [ev(1.0, "checkpoint_saved", 0, step=0), ev(2.0, "checkpoint_saved", 0, step=5)]
    fault = ev(2.5, "fault_injected", kind="storage.lose_unsynced")
    again = [ev(4.0, "checkpoint_saved", 0, step=0), ev(5.0, "checkpoint_saved", 0, step=5)]
    result = check([*before, fault, *again, ev(7.0, "checkpoint_loaded", 0, step=5),
                    ev(7.0, "checkpoint_loaded", 1, step=5)])
    assert not result.passed, result
    assert "rank 0 saved step 0 again, before any resume" in result.message
    assert "it started over" in result.message
    # The same step saved again with nothing older: not proof of a loss, nor of survival.
    result = check([*before, fault, again[1], ev(7.0, "checkpoint_loaded", 0, step=5)])
    assert not result.passed, result
    assert result.message.startswith("not observed: 2.50s after the fault")
    # A resume first, then the same step saved again (a save on resume): that passes.
    assert check([*before, fault, ev(3.0, "checkpoint_loaded", 0, step=5), again[1]]).passed
    # A peer's report of the same save, read just after the fault, is no save again.
    assert check([*before, fault, ev(2.6, "checkpoint_saved", 1, step=5),
                  ev(7.0, "checkpoint_loaded", 0, step=5)]).passed
    # A new step saved after the fault (a save in flight) is no step trained again.
    assert check([*before, fault, ev(2.6, "checkpoint_saved", 0, step=10),
                  ev(7.0, "checkpoint_loaded", 0, step=10)]).passed
