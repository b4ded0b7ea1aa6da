"""Leaving a superseded generation without Gloo's help (``aftershock.reference_impl._leave``).

Real Gloo groups (two ranks on threads of one process) and a real star. A wait on a
generation's group gives up within a slice once a newer plan superseded the generation,
whatever its peer does; a collective that fails still fails as itself; the vote's star is
shut down. The end-to-end case, survivors waiting on a wedged live peer after another one
died, is the shipped scenario training/kill_rank_peer_hung_elastic
(tests/test_shipped_scenarios.py), which fails without this (the survivors leave only at the
peer's release, 3 s later).
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from tests._helpers import on_threads

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from aftershock.reference_impl._leave import SLICE_S, Abandonable, Leave, Left, build  # noqa: E402

TIMEOUT_S = 30.0  # what a wait would last without leaving


def _pair(name: str, timeout_s: float = TIMEOUT_S) -> list[Any]:
    store = dist.HashStore()
    groups = on_threads(2, lambda rank: dist.ProcessGroupGloo(
        dist.PrefixStore(f"{name}/", store), rank, 2, timedelta(seconds=timeout_s)))
    assert not any(isinstance(g, Exception) for g in groups), groups
    return groups


def _in_thread(body: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            body()
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc
        outcome["waited_s"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _blocked(body: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``body`` on a thread of its own, checked to be still waiting 0.3 s later."""
    thread, outcome = _in_thread(body)
    time.sleep(0.3)
    assert thread.is_alive(), outcome
    return thread, outcome


def _ended(thread: threading.Thread, outcome: dict[str, Any], error: type, what: str) -> None:
    """The blocked call returned within 10 s, failing with ``error``."""
    thread.join(10)
    assert not thread.is_alive(), f"{what} went on waiting"
    assert isinstance(outcome["error"], error), outcome


def test_a_wait_returns_as_the_groups_does_while_the_generation_stands() -> None:
    leave = Leave()
    groups = [Abandonable(g, leave, 3) for g in _pair("stands")]
    out = on_threads(2, lambda rank: groups[rank].allreduce([torch.full((4,), rank + 1.0)]))
    tensors = [torch.full((4,), rank + 1.0) for rank in range(2)]
    works = on_threads(2, lambda rank: groups[rank].allreduce([tensors[rank]]))
    assert all(w.wait() for w in works), works
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in tensors), tensors
    assert all(w.wait() for w in out)
    leave.supersede(3)  # a plan for the same generation supersedes nothing
    assert groups[0].allreduce([torch.ones(1)]) is not None
    assert leave.abandoned == []


def test_a_wait_on_a_silent_live_peer_gives_up_once_the_generation_is_superseded() -> None:
    """Rank 1 never enters the all_reduce (alive, holding its connections): without the
    plan, rank 0 would wait for the group's timeout."""
    leave = Leave()
    raw = _pair("silent")
    mine = Abandonable(raw[0], leave, 0)
    thread, outcome = _blocked(lambda: mine.allreduce([torch.ones(4)]).wait())

    leave.supersede(1)

    _ended(thread, outcome, Left, "the wait")
    assert outcome["waited_s"] < 0.3 + 10 * SLICE_S + 1, outcome
    assert len(leave.abandoned) == 1  # its tensors may still be written: kept, not reused


def test_a_failed_collective_fails_as_itself() -> None:
    """A peer that closes its group fails our wait with Gloo's own error, not a leave."""
    leave = Leave()
    raw = _pair("failed")
    mine = Abandonable(raw[0], leave, 0)
    thread, outcome = _blocked(lambda: mine.allreduce([torch.ones(4)]).wait())
    raw[1] = None  # the peer's group destroyed: its connections close
    _ended(thread, outcome, RuntimeError, "the wait")
    assert not isinstance(outcome["error"], Left), outcome
    assert leave.abandoned == []


class _CompletesAsTheSliceRunsOut:
    """The moment a real wait cannot be made to hit on purpose: torch's ``Work.wait(timeout)``
    raises "Operation timed out!" for a slice that ran out, and the collective completes
    right after, before the waiter looks (seen in `make test-scenarios`: the node scenario's
    rank failed at its first step with that message)."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.done


def test_a_slice_that_runs_out_as_the_collective_completes_is_no_failure() -> None:
    class Group:
        def allreduce(self, tensors: list[Any]) -> Any:
            return _CompletesAsTheSliceRunsOut()

    assert Abandonable(Group(), Leave(), 0).allreduce([torch.ones(1)]).wait() is True


def test_both_ranks_leave_at_once_whenever_the_plan_comes() -> None:
    """Both ranks run all_reduces back to back; the plan comes at a random moment. Every
    time, both are out within a second. (Shutting their connections down instead left one
    side waiting out Gloo's timeout in 25 of 60 tries:
    gloo_close_race.py in bench/results/profiles-2026.md.)"""
    rng = random.Random(7)
    for trial in range(8):
        leave = Leave()
        # Gloo's own timeout, 3 s: what a rank left waiting would wait.
        groups = [Abandonable(g, leave, 0) for g in _pair(f"loop{trial}", timeout_s=3)]
        ended: dict[int, tuple[float, BaseException]] = {}
        threads = [threading.Thread(target=_loop, args=(groups[r], r, ended), daemon=True)
                   for r in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(0.02, 0.1))
        planned = time.monotonic()
        leave.supersede(1)
        for thread in threads:
            thread.join(5)
        assert sorted(ended) == [0, 1], f"trial {trial}: a rank never left"
        for rank, (when, exc) in ended.items():
            assert isinstance(exc, Left), (trial, rank, exc)
            assert when - planned < 1.0, f"trial {trial}: rank {rank} left after " \
                f"{when - planned:.2f} s"
        # An abandoned op's group waits for it in its destructor: dropped off the way, as
        # Worker.close_groups does.
        threading.Thread(target=groups.clear, daemon=True).start()


def _loop(group: Any, rank: int, ended: dict[int, tuple[float, BaseException]]) -> None:
    """All_reduces back to back until one fails; when and how, into ``ended``."""
    tensor = torch.ones(64)
    try:
        while True:
            group.allreduce([tensor]).wait()
    except RuntimeError as exc:
        ended[rank] = (time.monotonic(), exc)


def test_the_vote_is_shut_down_when_the_generation_is_superseded() -> None:
    from aftershock.reference_impl._star import Star, StarError

    store = dist.HashStore()
    stars = on_threads(2, lambda rank: Star.connect(store, rank, 2, TIMEOUT_S))
    assert not any(isinstance(s, Exception) for s in stars), stars
    leave = Leave()
    leave.enter(4, stars[1])
    thread, outcome = _blocked(lambda: stars[1].sum(torch.ones(1, dtype=torch.float64)))
    leave.supersede(4)  # the same generation: nothing happens
    time.sleep(0.1)
    assert thread.is_alive(), outcome

    leave.supersede(5)

    _ended(thread, outcome, StarError, "the vote")
    # Its peer learns at once too: rank 0's next vote fails (rank 1's value of this one
    # had gone out before the shutdown).
    stars[0].sum(torch.ones(1, dtype=torch.float64))
    started = time.monotonic()
    with pytest.raises(StarError):
        stars[0].sum(torch.ones(1, dtype=torch.float64))
    assert time.monotonic() - started < 5
    stars[0].close()


def test_a_plan_that_came_while_the_generation_was_built_shuts_its_vote_at_once() -> None:
    from aftershock.reference_impl._star import Star, StarError

    store = dist.HashStore()
    stars = on_threads(2, lambda rank: Star.connect(store, rank, 2, TIMEOUT_S))
    leave = Leave()
    leave.supersede(1)
    leave.enter(0, stars[0])
    with pytest.raises(StarError):
        stars[0].sum(torch.ones(1, dtype=torch.float64))
    # A forgotten star is never touched again, and a newer generation is not superseded.
    later = Leave()
    later.enter(2, stars[1])
    later.forget()
    later.supersede(9)
    assert stars[1].socks, "a forgotten star was shut down"
    assert not leave.superseded(1)
    assert leave.superseded(0)
    for star in stars:
        star.close()


def test_a_build_waiting_for_a_dead_member_gives_up_once_the_generation_is_superseded() -> None:
    """Gloo's group constructor waits for every member's address until its timeout, and
    nothing interrupts it: a member killed after the start line held the others there for
    the whole collective timeout (kill_rank_while_joining_hot_spare). Built through
    ``build``, the wait ends within a slice of the next plan."""
    leave = Leave()
    store = dist.HashStore()
    # Rank 1 of the pair never comes: the constructor would wait 30 s.
    make = lambda: dist.ProcessGroupGloo(  # noqa: E731
        dist.PrefixStore("dead/", store), 0, 2, timedelta(seconds=TIMEOUT_S))
    thread, outcome = _blocked(lambda: build(make, leave, 2))

    leave.supersede(3)

    _ended(thread, outcome, Left, "the build")
    assert outcome["waited_s"] < 0.3 + 10 * SLICE_S + 1, outcome


def test_a_build_returns_what_it_built_or_fails_as_itself() -> None:
    leave = Leave()
    store = dist.HashStore()
    groups = on_threads(2, lambda rank: build(lambda: dist.ProcessGroupGloo(
        dist.PrefixStore("built/", store), rank, 2, timedelta(seconds=TIMEOUT_S)), leave, 0))
    assert all(isinstance(g, dist.ProcessGroupGloo) for g in groups), groups
    assert groups[0].size() == 2

    def broken() -> Any:
        raise RuntimeError("Connection refused")

    with pytest.raises(RuntimeError, match="Connection refused"):
        build(broken, leave, 0)
    leave.supersede(1)  # superseded before the build: given up at once, not built
    started = time.monotonic()
    with pytest.raises(Left):
        build(lambda: time.sleep(5), leave, 0)
    assert time.monotonic() - started < 1
