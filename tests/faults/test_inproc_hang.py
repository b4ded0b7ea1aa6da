"""process.hang: the probe blocks the target's loop at a fault point, and only that thread,
until the fault is released. End to end (a wedged serving worker caught by the router's
progress check): scenarios/serving/wedged_worker.yaml."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from aftershock.faults import inproc


def test_a_hang_blocks_only_the_loop_that_reaches_its_point(tmp_path: Path) -> None:
    path = str(tmp_path / "commands.jsonl")
    events: list[dict[str, Any]] = []
    engine = inproc.Engine(inproc.Inbox(path), rank=lambda: 0,
                           emit=lambda event, **f: events.append({"event": event, **f}))
    inproc.send(path, {"op": "arm", "id": "h1", "kind": "process.hang",
                       "params": {"rank": 0, "at_step": 3, "phase": "decode", "fault": 0}})
    engine.at_point(2, "decode")  # before its step
    engine.at_point(3, "forward")  # another phase
    assert not events

    done = threading.Event()
    loop = threading.Thread(target=lambda: (engine.at_point(3, "decode"), done.set()))
    loop.start()
    beats = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # the process's other threads run on meanwhile
        beats += 1
        time.sleep(0.01)
    assert not done.is_set()
    assert beats > 20
    (fired,) = events
    assert (fired["event"], fired["kind"], fired["step"], fired["phase"]) == (
        "fault_injected", "process.hang", 3, "decode")

    inproc.release({"commands": path, "id": "h1"})
    assert done.wait(2.0)
    loop.join()
    engine.at_point(4, "decode")  # fired once: never again
    assert len(events) == 1
