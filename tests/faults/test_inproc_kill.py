"""In-process triggers at a fault point: a process.kill that lands at an exact phase (a
checkpoint's `save`, a recovering rank's `restore`), and collective faults narrowed to the
calls after a phase. End to end: scenarios/faults/storage_crash_during_save.yaml,
scenarios/training/kill_during_recovery_*.yaml, scenarios/faults/collective_corrupt_nan.yaml."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import inproc
from aftershock.harness.errors import SpecError
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import in_process

pytestmark = pytest.mark.timeout(60)

# A stand-in for a rank: an engine on the run's command file, its events in a file, and the
# fault points of a checkpoint save. It must die at the armed point and nowhere else.
RANK = textwrap.dedent("""\
    import json, sys
    from aftershock.faults import inproc
    commands, events, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def emit(event, **fields):
        with open(events, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\\n")

    engine = inproc.Engine(inproc.Inbox(commands), rank=lambda: rank, emit=emit)
    for step, phase in [(20, "save"), (30, "forward"), (30, "save"), (40, "save")]:
        engine.at_point(step, phase)
        emit("passed", step=step, phase=phase)
""")


def _rank(tmp_path: Path, rank: int, run: int = 0) -> tuple[int, list[dict[str, Any]]]:
    events = tmp_path / f"events{rank}-{run}.jsonl"
    proc = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "commands.jsonl"),
                           str(events), str(rank)], capture_output=True, text=True, timeout=30)
    lines = events.read_text().splitlines() if events.exists() else []
    return proc.returncode, [json.loads(line) for line in lines]


def test_a_kill_at_a_phase_lands_exactly_there_and_only_once(tmp_path: Path) -> None:
    inproc.send(str(tmp_path / "commands.jsonl"), {
        "op": "arm", "id": "k1", "kind": "process.kill",
        "params": {"rank": 0, "at_step": 30, "phase": "save", "signal": "SIGKILL", "fault": 1}})

    code, events = _rank(tmp_path, 0)
    assert code == -signal.SIGKILL
    # Through step 30's forward, then the report, then nothing: it died at step 30's save.
    assert [(e["event"], e.get("step"), e.get("phase")) for e in events] == [
        ("passed", 20, "save"), ("passed", 30, "forward"),
        ("fault_injected", 30, "save")]
    assert events[-1]["kind"] == "process.kill"
    assert events[-1]["fault"] == 1

    # Another rank is not the target; the same rank restarted (a new process reading the same
    # command file) does not die again: the fault fired once.
    assert _rank(tmp_path, 1)[0] == 0
    code, events = _rank(tmp_path, 0, run=1)
    assert code == 0
    assert [e["event"] for e in events] == ["passed"] * 4


def test_a_spare_that_takes_the_rank_over_later_does_not_fire_its_fault_again(
    tmp_path: Path,
) -> None:
    """A warm spare reads the command file while it has no rank yet, then takes over the
    rank whose fault already fired. That fault fired once per rank per run: the spare must
    not fire it again. (A fault point reached before the spare had a rank consumed the
    'fired' line unread, and the spare hung rank 1's collective a second time.)"""
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "commands.jsonl")
    inproc.send(path, {"op": "arm", "id": "h1", "kind": "collective.error",
                       "params": {"rank": 1, "at_step": 5, "op": "all_reduce", "fault": 0}})
    inproc.send(path, {"op": "fired", "id": "h1", "rank": 1})  # the first rank 1's
    rank: list[int | None] = [None]
    events: list[dict[str, Any]] = []
    spare = inproc.Engine(inproc.Inbox(path), rank=lambda: rank[0],
                          emit=lambda event, **f: events.append({"event": event, **f}))
    spare.at_point(0, "join")  # before it has a rank: the command file is read here

    rank[0] = 1  # it took rank 1 over
    spare.at_point(7, "backward")
    spare.around("all_reduce", lambda tensor: None, (torch.ones(2),), {})
    assert not events


def test_a_collective_fault_with_a_phase_counts_only_calls_after_that_point(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "commands.jsonl")
    events: list[dict[str, Any]] = []
    engine = inproc.Engine(inproc.Inbox(path), rank=lambda: 1,
                           emit=lambda event, **f: events.append({"event": event, **f}))
    inproc.send(path, {"op": "arm", "id": "c1", "kind": "collective.corrupt",
                       "params": {"rank": 1, "at_step": 25, "phase": "backward",
                                  "op": "all_reduce", "mode": "nan", "index": 0, "fault": 0}})

    def all_reduce(tensor: Any) -> None:
        return None

    forward = torch.ones(4)
    engine.at_point(25, "forward")
    engine.around("all_reduce", all_reduce, (forward,), {})  # the forward pass's
    assert bool(torch.isfinite(forward).all())
    assert not events

    gradients = torch.ones(4)
    engine.at_point(25, "backward")
    engine.around("all_reduce", all_reduce, (gradients,), {})  # the gradient all_reduce
    assert torch.isnan(gradients[0])
    (hit,) = events
    assert (hit["step"], hit["phase"], hit["op"]) == (25, "backward", "all_reduce")


def _scenario(fault: str) -> str:
    return f"""\
name: s
system: {{reference: trainer}}
faults:
  - {fault}
"""


def test_phase_makes_a_kill_in_process_and_is_refused_where_it_means_nothing() -> None:
    kill = parse_scenario(_scenario("{kind: process.kill, target: {rank: 0}, "
                                    "at: {step: 30, phase: save}}")).faults[0]
    assert in_process(kill)
    outside = parse_scenario(_scenario("{kind: process.kill, target: {rank: 0}, "
                                       "at: {step: 30}}")).faults[0]
    assert not in_process(outside)
    restore = parse_scenario(_scenario("{kind: process.kill, target: {rank: 1}, "
                                       "at: {step: 1, phase: restore}}")).faults[0]
    assert in_process(restore)

    with pytest.raises(SpecError) as caught:
        parse_scenario(_scenario("{kind: process.freeze, target: {rank: 0}, "
                                 "at: {step: 30, phase: save}}"), "f.yaml")
    assert "f.yaml:4:5: faults.0:" in str(caught.value)
    assert "`at.phase` is for faults applied inside the target" in str(caught.value)
    assert "not process.freeze" in str(caught.value)
