"""A memory fault on a gradient with no fault point poisons step N's gradient, not the one
left over from step N-1: at step N's `forward` point the gradients there are the previous
step's, which the trainer drops (`zero_grad`) before its backward, so a NaN put there hits
nothing and no recovery could be asked to see it (a shipped explore space drew exactly that
and reported a correct trainer as failing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import inproc

torch = pytest.importorskip("torch")


def _engine(tmp_path: Path) -> tuple[inproc.Engine, list[dict[str, Any]], str, Any]:
    path = str(tmp_path / "commands.jsonl")
    events: list[dict[str, Any]] = []
    engine = inproc.Engine(inproc.Inbox(path), rank=lambda: 0,
                           emit=lambda event, **fields: events.append({"event": event, **fields}))
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()  # step N-1's gradient, still there
    engine.watch(model)
    return engine, events, path, model


def test_a_gradient_fault_without_a_point_waits_for_the_steps_own_gradient(
    tmp_path: Path,
) -> None:
    engine, events, path, model = _engine(tmp_path)
    inproc.send(path, {"op": "arm", "id": "c0", "kind": "memory.nan",
                       "params": {"rank": 0, "fault": 0, "tensor": "grad:*", "at_step": 5}})
    engine.at_point(5, "forward")
    assert not events, "poisoned the previous step's gradient"
    model.zero_grad(set_to_none=True)  # the trainer drops it, then computes step 5's
    model(torch.ones(1, 2)).sum().backward()
    engine.at_point(5, "backward")
    (fired,) = events
    assert (fired["step"], fired["phase"]) == (5, "backward")
    assert any(torch.isnan(p.grad).any() for p in model.parameters())


def test_a_parameter_fault_without_a_point_still_lands_at_the_first_one(
    tmp_path: Path,
) -> None:
    engine, events, path, _model = _engine(tmp_path)
    inproc.send(path, {"op": "arm", "id": "c0", "kind": "memory.nan",
                       "params": {"rank": 0, "fault": 0, "tensor": "param:*", "at_step": 5}})
    engine.at_point(5, "forward")
    (fired,) = events
    assert (fired["step"], fired["phase"]) == (5, "forward")


def test_a_gradient_fault_asked_at_forward_is_taken_at_its_word(tmp_path: Path) -> None:
    engine, events, path, _model = _engine(tmp_path)
    inproc.send(path, {"op": "arm", "id": "c0", "kind": "memory.nan",
                       "params": {"rank": 0, "fault": 0, "tensor": "grad:*", "at_step": 5,
                                  "phase": "forward"}})
    engine.at_point(5, "forward")
    assert [e["phase"] for e in events] == ["forward"]
