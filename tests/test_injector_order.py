"""The run record lists its faults in the scenario's order, each naming the fault it is,
whatever order they were applied in: a target found for fault 1 a poll before fault 0
(a rank that appeared between two lookups) must not swap the two records."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import NAN_THEN_HANG

from aftershock.faults import ProcessRef
from aftershock.faults.contract import COMMANDS_ENV
from aftershock.faults.journal import Journal
from aftershock.harness.run.injector import Injector
from aftershock.harness.run.records import Event
from aftershock.harness.run.runner import NullObserver
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.load import parse_scenario

SCENARIO = """\
name: order
system:
  command: [python, job.py]
  world: 2
  in_process_probe: true
faults:
""" + NAN_THEN_HANG


class _Ranks:
    """A target whose rank 1 is a real process carrying the run's command file."""

    def __init__(self, ref: ProcessRef) -> None:
        self.ref = ref

    def rank_processes(self) -> dict[int, ProcessRef]:
        return {1: self.ref}


@pytest.fixture
def rank1(tmp_path: Path) -> Iterator[ProcessRef]:
    env = {**os.environ, COMMANDS_ENV: str(tmp_path / "commands.jsonl")}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        yield ref
    finally:
        proc.kill()
        proc.wait()


def test_records_follow_the_scenario_not_the_order_faults_were_applied(
    tmp_path: Path, rank1: ProcessRef,
) -> None:
    spec = parse_scenario(SCENARIO)
    timeline = Timeline(tmp_path / "events.jsonl")
    journal = Journal.create("order", tmp_path / "journal", folders=[tmp_path])
    t0 = time.monotonic()
    injector = Injector(spec.faults, target=_Ranks(rank1),  # type: ignore[arg-type]
                        journal=journal, timeline=timeline, observer=NullObserver(), seed=0,
                        t0=t0, root_of=lambda f: str(tmp_path), log_dir=tmp_path / "logs")
    try:
        # Fault 1 found its target first.
        assert injector.apply(1, arm_step=7)
        assert injector.apply(0, arm_step=4)
        # The probe reports both; the hang is healed after its duration.
        for fault, kind in ((0, "memory.nan"), (1, "collective.hang")):
            injector.observe(Event(t=time.monotonic(), event="fault_injected", source="rank1",
                                   fields={"fault": fault, "kind": kind, "rank": 1}))
        injector.heal_due(time.monotonic() + 2)
    finally:
        assert injector.heal_all() == []
        timeline.close()
        journal.close()

    nan, hang = injector.in_scenario_order()
    assert (nan.fault, nan.kind, nan.healed_at_s) == (0, "memory.nan", None)
    assert (hang.fault, hang.kind) == (1, "collective.hang")
    assert hang.injected_at_s is not None
    assert hang.healed_at_s is not None
