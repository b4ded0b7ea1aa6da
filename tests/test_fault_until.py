"""A fault held ``until`` an event (``duration: {until: {event, rank, count}, max}``): healed
when the timeline shows that event after the fault's moment, at ``max`` at the latest, and
the run says which (``fault_healed``'s ``until_seen``), so a scenario's freeze lasts as long
as the recovery it is meant to provoke however loaded the machine is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import ProcessRef
from aftershock.faults.journal import Journal
from aftershock.harness.errors import SpecError
from aftershock.harness.run.injector import Injector, fault_params
from aftershock.harness.run.records import Event
from aftershock.harness.run.runner import NullObserver
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import HealWhen


def _scenario(duration: str, kind: str = "process.freeze") -> str:
    return f"""\
name: until
system:
  command: [python, job.py]
  world: 2
faults:
  - kind: {kind}
    target: {{rank: 1}}
    at: {{step: 3}}
    duration: {duration}
"""


def test_the_until_form_parses_and_reaches_the_kind_as_held_to_the_end() -> None:
    (fault,) = parse_scenario(_scenario("{until: {event: hello, rank: 1}, max: 60s}")).faults
    held = fault.duration  # type: ignore[attr-defined]
    assert isinstance(held, HealWhen)
    assert (held.until.event, held.until.rank, held.until.count) == ("hello", 1, 1)
    assert held.max.total_seconds() == 60
    # The harness heals it: the kind is told nothing of a time to thaw.
    assert "duration" not in fault_params(fault)
    (plain,) = parse_scenario(_scenario("7s")).faults
    assert fault_params(plain)["duration"] == 7.0


@pytest.mark.parametrize(("duration", "message"), [
    ("{until: {event: hello}, max: 0s}", "s.yaml:9:44: faults.0.duration.max: `max` must be more "
     "than 0"),
    ("{until: {event: Hello}, max: 5s}", "faults.0.duration.until.event: String should match"),
    ("{max: 5s}", "faults.0.duration.until: required key is missing"),
    ("{until: {event: hello}}", "faults.0.duration.max: required key is missing"),
    ("{until: {event: hello}, max: 5s, after: 1s}", "faults.0.duration.after: unknown key "
     "'after' (allowed: max, until)"),
    ("{until: {event: hello, step: 3}, max: 5s}", "faults.0.duration.until.step: unknown key"),
    ("soon", "faults.0.duration: expected a duration like 500ms"),
])
def test_a_bad_until_form_is_named_where_it_is(duration: str, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_scenario(_scenario(duration), "s.yaml")
    assert message in str(caught.value), str(caught.value)


def test_a_kind_that_is_not_healed_by_the_harness_takes_no_until() -> None:
    # process.term takes no `duration` at all: nothing to hold.
    with pytest.raises(SpecError, match="unknown key 'duration'"):
        parse_scenario(_scenario("{until: {event: hello}, max: 5s}", kind="process.term"))


class _Ranks:
    """A target whose rank 1 is a real process."""

    def __init__(self, ref: ProcessRef) -> None:
        self.ref = ref

    def rank_processes(self) -> dict[int, ProcessRef]:
        return {1: self.ref}


@pytest.fixture
def rank1() -> Iterator[ProcessRef]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=dict(os.environ))
    try:
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        yield ref
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def _stopped(pid: int) -> bool:
    """Whether the process is stopped, once the signal sent to it has taken effect (the
    kernel stops it when it next runs, which a loaded machine delays)."""
    deadline = time.monotonic() + 30
    while _state(pid) not in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) in ("T", "t")


def _running(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while _state(pid) in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) not in ("T", "t")


def _healed(path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in events if e["event"] == "fault_healed"]


class _Run:
    def __init__(self, tmp_path: Path, ref: ProcessRef, duration: str) -> None:
        spec = parse_scenario(_scenario(duration))
        self.events = tmp_path / "events.jsonl"
        self.timeline = Timeline(self.events)
        self.journal = Journal.create("until", tmp_path / "journal", folders=[tmp_path])
        self.injector = Injector(spec.faults, target=_Ranks(ref),  # type: ignore[arg-type]
                                 journal=self.journal, timeline=self.timeline,
                                 observer=NullObserver(), seed=0, t0=time.monotonic(),
                                 root_of=lambda f: str(tmp_path), log_dir=tmp_path / "logs")

    def hello(self, rank: int, t: float | None = None) -> None:
        self.injector.observe(Event(t=time.monotonic() if t is None else t, event="hello",
                                    source=f"rank{rank}", fields={"rank": rank}))

    def close(self) -> None:
        self.injector.heal_all()
        self.timeline.close()
        self.journal.close()


def test_held_until_the_event_then_healed_and_said_seen(
        tmp_path: Path, rank1: ProcessRef) -> None:
    run = _Run(tmp_path, rank1, "{until: {event: hello, rank: 1}, max: 60s}")
    try:
        before = time.monotonic()
        assert run.injector.apply(0)
        assert _stopped(rank1.pid)
        run.hello(1, t=before)  # before the fault's moment: not what it waits for
        run.hello(0)  # another rank's
        run.injector.heal_due(time.monotonic() + 30)  # long past a fixed freeze, under max
        assert _stopped(rank1.pid)
        assert _healed(run.events) == []
        run.hello(1)
        run.injector.heal_due(time.monotonic())
        assert _running(rank1.pid)
    finally:
        run.close()
    (healed,) = _healed(run.events)
    assert (healed["until"], healed["until_seen"]) == ("hello of rank 1", True), healed
    (record,) = run.injector.records
    assert record.healed_at_s is not None
    assert "held until hello of rank 1, seen at" in record.detail


def test_max_heals_it_and_says_not_observed(tmp_path: Path, rank1: ProcessRef) -> None:
    run = _Run(tmp_path, rank1, "{until: {event: hello, count: 2}, max: 2s}")
    try:
        assert run.injector.apply(0)
        run.hello(1)  # one of the two it waits for
        run.injector.heal_due(time.monotonic())
        assert _stopped(rank1.pid)
        run.injector.heal_due(time.monotonic() + 3)
        assert _running(rank1.pid)
    finally:
        run.close()
    (healed,) = _healed(run.events)
    assert (healed["until"], healed["until_seen"]) == ("hello #2", False), healed
    (record,) = run.injector.records
    assert "hello #2 not observed while it held (at most 2s)" in record.detail


def test_a_run_that_ends_first_says_not_observed(tmp_path: Path, rank1: ProcessRef) -> None:
    run = _Run(tmp_path, rank1, "{until: {event: recovery_done}, max: 60s}")
    assert run.injector.apply(0)
    run.close()
    assert _running(rank1.pid)
    (healed,) = _healed(run.events)
    assert healed["until_seen"] is False, healed


def test_the_heal_is_on_the_timeline_before_what_the_thawed_process_does(
        tmp_path: Path) -> None:
    # What a thawed process does can come before the revert returns (an engine's unpause
    # returns after the node runs again): `fault_healed` is dated when the heal began, as
    # `fault_injected` is, so nothing the heal caused precedes it on the timeline.
    woke = tmp_path / "woke"
    child = ("import signal, sys, time\n"
             "def cont(*_):\n"
             f"    open({str(woke)!r}, 'a').write(f'{{time.monotonic()}}\\n')\n"
             "signal.signal(signal.SIGCONT, cont)\n"
             "while True:\n"
             "    time.sleep(0.001)\n")
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        time.sleep(0.5)  # its handler is in place
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        run = _Run(tmp_path, ref, "{until: {event: hello, rank: 1}, max: 60s}")
        try:
            assert run.injector.apply(0)
            assert _stopped(proc.pid)
            run.hello(1)
            run.injector.heal_due(time.monotonic())
            deadline = time.monotonic() + 30
            while not woke.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            run.close()
    finally:
        proc.kill()
        proc.wait()
    (healed,) = _healed(run.events)
    assert healed["t"] < float(woke.read_text().split()[0])
