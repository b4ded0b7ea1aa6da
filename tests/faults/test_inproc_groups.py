"""Collective faults on process-group objects: the probe's wrapper around a group a program
calls directly (``group.allreduce(...)``, as the reference trainer's hot_spare and elastic
strategies do), on a real one-rank Gloo group in this process. End to end on a hot_spare
world: tests/test_inproc_faults.py and scenarios/faults/collective_*_hot_spare.yaml,
collective_*_elastic.yaml."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import inproc
from aftershock.harness import probe

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


class Target:
    """One rank's engine reading a command file, and the events it reports."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = str(tmp_path / "commands.jsonl")
        self.events: list[dict[str, Any]] = []
        self.engine = inproc.Engine(
            inproc.Inbox(self.path), rank=lambda: 0,
            emit=lambda event, **fields: self.events.append({"event": event, **fields}))

    def arm(self, kind: str, **params: Any) -> str:
        command_id = f"c{len(self.events)}-{kind}"
        inproc.send(self.path, {"op": "arm", "id": command_id, "kind": kind,
                                "params": {"rank": 0, "fault": 0, **params}})
        return command_id


def gloo() -> Any:
    """A real Gloo group of one rank: its collectives run, with nobody else to wait for."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))


@pytest.fixture
def target(tmp_path: Path) -> Target:
    return Target(tmp_path)


@pytest.fixture
def patched_dist(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed's functions as they were, once the test ends: the engine under test
    routes them through itself, and no later test may inherit that."""
    import torch.distributed.distributed_c10d as c10d

    for name in inproc.COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))


def test_the_kth_matching_call_on_a_wrapped_group_fails(target: Target) -> None:
    target.arm("collective.error", op="all_reduce", call=2, at_step=3)
    group = inproc.wrap_group(gloo(), target.engine)
    one = torch.ones(2)
    target.engine.at_point(2, "forward")
    group.allreduce([one]).wait()  # before its step
    target.engine.at_point(3, "forward")
    group.allreduce([one]).wait()  # the 1st matching call
    group.allgather([[torch.zeros(2)]], [one]).wait()  # another op: not counted
    assert not target.events
    with pytest.raises(inproc.InjectedCollectiveError, match="all_reduce call 3 on rank 0"):
        group.allreduce([one])
    (fired,) = target.events
    assert (fired["event"], fired["kind"], fired["op"], fired["step"]) == (
        "fault_injected", "collective.error", "all_reduce", 3)
    group.allreduce([one]).wait()  # fired once: never again
    assert len(target.events) == 1


def test_a_wrapped_group_is_the_group_for_everything_else(target: Target) -> None:
    inner = gloo()
    group = inproc.wrap_group(inner, target.engine)
    assert inproc.wrap_group(group, target.engine) is group  # wrapped once
    assert group.wrapped is inner
    assert (group.rank(), group.size()) == (0, 1)
    out = [[torch.zeros(3)]]
    group.allgather(out, [torch.arange(3.0)]).wait()
    assert out[0][0].tolist() == [0.0, 1.0, 2.0]
    assert group.allreduce.__name__ == "allreduce"


def test_dropping_the_wrapper_drops_the_group(target: Target) -> None:
    """The resilient trainer closes a generation's Gloo sockets by dropping its groups, so
    the wrapper must hold no reference anywhere else (the engine keeps none)."""
    inner = gloo()
    alive = weakref.ref(inner)
    group = inproc.wrap_group(inner, target.engine)
    group.allreduce([torch.ones(1)]).wait()
    del inner, group
    gc.collect()
    assert alive() is None


def test_corrupt_poisons_the_result_after_the_work_completes(target: Target) -> None:
    target.arm("collective.corrupt", op="all_gather", mode="nan", index=1)
    group = inproc.wrap_group(gloo(), target.engine)
    out = [[torch.zeros(3)]]
    work = group.allgather(out, [torch.ones(3)])
    work.wait()
    assert [str(v) for v in out[0][0].tolist()] == ["1.0", "nan", "1.0"]
    (fired,) = target.events
    assert fired["op"] == "all_gather"


def test_a_hang_on_a_wrapped_group_holds_until_released(target: Target) -> None:
    command = target.arm("collective.hang", op="broadcast")
    group = inproc.wrap_group(gloo(), target.engine)
    tensor = torch.full((2,), 7.0)
    done = threading.Event()

    def call() -> None:
        group.broadcast([tensor]).wait()
        done.set()

    thread = threading.Thread(target=call)
    thread.start()
    assert not done.wait(0.3)
    assert [e["op"] for e in target.events] == ["broadcast"]
    inproc.release({"commands": target.path, "id": command})
    assert done.wait(5.0)
    thread.join()
    assert tensor.tolist() == [7.0, 7.0]  # the collective itself ran, once released


def test_a_delay_starts_the_call_late(target: Target) -> None:
    target.arm("collective.delay", op="barrier", delay=0.3)
    group = inproc.wrap_group(gloo(), target.engine)
    started = time.monotonic()
    group.barrier().wait()
    assert time.monotonic() - started >= 0.3
    assert [e["op"] for e in target.events] == ["barrier"]


def test_a_wrapped_group_through_torch_distributed_counts_once(
    target: Target, patched_dist: None
) -> None:
    """torch.distributed's function calls the wrapped group's method: one call, one count,
    whichever entry point saw it first."""
    inproc.install_collectives(target.engine)
    target.arm("collective.error", op="all_reduce", call=2)
    group = inproc.wrap_group(gloo(), target.engine)
    tensor = torch.ones(2)
    dist.all_reduce(tensor, group=group)
    assert not target.events
    with pytest.raises(inproc.InjectedCollectiveError):
        dist.all_reduce(tensor, group=group)
    assert [e["op"] for e in target.events] == ["all_reduce"]


def test_probe_wrap_group_is_a_no_op_outside_the_harness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(probe.EVENTS_ENV, raising=False)
    monkeypatch.setattr(probe, "_engine", None)
    inner = gloo()
    assert probe.wrap_group(inner) is inner


def test_probe_wrap_group_starts_the_engine_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patched_dist: None
) -> None:
    """A trainer may build its groups before it names any tensor (install): the first
    wrap_group starts the engine, and its faults reach the group from then on."""
    commands = tmp_path / "commands.jsonl"
    monkeypatch.setenv(probe.EVENTS_ENV, str(tmp_path / "events.jsonl"))
    monkeypatch.setenv(probe.COMMANDS_ENV, str(commands))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(probe, "_engine", None)
    monkeypatch.setattr(probe, "_fd", None)  # the events file this test's probe opens
    monkeypatch.setattr(probe, "_fd_path", None)
    group = probe.wrap_group(gloo())
    assert isinstance(group, inproc.FaultyGroup)
    inproc.send(str(commands), {"op": "arm", "id": "e1", "kind": "collective.error",
                                "params": {"rank": 0, "fault": 0}})
    with pytest.raises(inproc.InjectedCollectiveError):
        group.allreduce([torch.ones(1)])
    assert probe.install() is True  # the same engine: install adds only tensors
    assert group._engine is probe._engine
    assert probe._fd is not None
    os.close(probe._fd)
