"""expect.faults_landed on hand-written timelines: a file-triggered fault landed inside its
file's write only when the record shows a process of the run still writing it; anything
less is a miss or not observed, never a pass."""

from __future__ import annotations

from typing import Any

from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.scenario.spec import Expect
from aftershock.harness.verdict.checks import Outcome, evaluate


def injected(fault: int, **fields: Any) -> Event:
    return Event(t=5.0, event="fault_injected", source="harness",
                 fields={"kind": "process.kill", "fault": fault, "pid": 7, **fields})


def check(triggers: dict[int, str], events: list[Event]) -> CheckResult:
    (result,) = [r for r in evaluate(Expect(completes=False, faults_landed="in_window"),
                                     outcome=Outcome(0, False, 1.0), metrics={}, faults=[],
                                     digests={}, baseline=None, events=events,
                                     file_triggers=triggers)
                 if r.name == "faults_landed"]
    return result


HIT = {"file": "snapshot.pt", "file_size": 2048, "file_open": True, "file_writers": [7]}
MISS = {"file": "snapshot.pt", "file_size": 8192, "file_open": False, "file_writers": []}


def test_a_fault_while_the_writer_holds_the_file_landed() -> None:
    result = check({0: "modified"}, [injected(0, **HIT)])
    assert result.passed, result.message
    assert result.observed == "1/1"
    assert "snapshot.pt was 2048 bytes, still open for writing (pid 7)" in result.message


def test_a_fault_after_the_save_missed() -> None:
    result = check({0: "modified", 1: "opened"}, [injected(0, **HIT), injected(1, **MISS)])
    assert not result.passed
    assert result.observed == "1/2"
    assert result.message.startswith("fault 1 (opened) missed its window: snapshot.pt was "
                                     "8192 bytes, open for writing by no process of the run")


def test_without_evidence_it_is_not_observed() -> None:
    never = check({0: "created"}, [])
    assert not never.passed
    assert "fault 0 (created) was never injected: not observed" in never.message
    # A record of the file's name alone (a run from before the state was recorded, or an
    # in-process fault) says nothing about the moment.
    unread = check({0: "created"}, [injected(0, file="snapshot.pt")])
    assert not unread.passed
    assert "no record of its file at the fault's moment: not observed" in unread.message
    # A process of the run whose descriptors could not be read might have held it.
    unknown = check({0: "opened"}, [injected(0, file="snapshot.pt", file_size=10,
                                             file_open=None, file_writers=[],
                                             file_unreadable=[42])])
    assert not unknown.passed
    assert ("whether it was open is unknown (cannot read the descriptors of 42): not "
            "observed") in unknown.message
    # Only the harness's own record counts, not a line a job printed.
    forged = Event(t=5.0, event="fault_injected", source="log", fields={"fault": 0, **HIT})
    assert not check({0: "modified"}, [forged]).passed


def test_triggers_after_the_write_are_not_judged() -> None:
    result = check({0: "closed", 1: "modified"}, [injected(0, **MISS), injected(1, **HIT)])
    assert result.passed, result.message
    assert result.observed == "1/1"
    nothing = check({0: "deleted"}, [injected(0, **MISS)])
    assert not nothing.passed
    assert nothing.message.startswith("not observed")
