"""A failed generation's teardown in the ``hot_spare``/``elastic`` loops (``Worker.close_groups``):
the groups are destroyed, so a peer blocked on one fails now rather than at its timeout, and
the teardown is over when it returns: no thread of it is left running into the next
generation. Real Gloo groups and a real star, two ranks on threads of one process."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from tests._helpers import on_threads

torch = pytest.importorskip("torch")

TIMEOUT_S = 60.0  # what a peer would wait if the groups were left open


def _generation(store: Any, rank: int) -> Any:
    import torch.distributed as dist

    from aftershock.reference_impl._star import Star
    from aftershock.reference_impl.resilient import Groups

    def group(name: str) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(f"gen0/{name}/", store), rank, 2,
                                     timedelta(seconds=TIMEOUT_S))

    world, tp, dp = group("world"), group("tp"), group("dp")
    star = Star.connect(dist.PrefixStore("gen0/", store), rank, 2, TIMEOUT_S)
    return Groups(0, rank, [0, 1], [0, 1], world, tp, dp, [0, 1], star)


@pytest.mark.parametrize("blocked_on", ["dp", "tp", "world"])
def test_closing_a_generation_fails_a_blocked_peer_at_once_and_leaves_no_thread(
        blocked_on: str) -> None:
    import torch.distributed as dist

    from aftershock.reference_impl._leave import Leave
    from aftershock.reference_impl.resilient import Worker

    store = dist.HashStore()
    groups = on_threads(2, lambda rank: _generation(store, rank))
    assert not any(isinstance(g, Exception) for g in groups), groups
    mine = SimpleNamespace(groups=groups[0], model=None, leave=Leave())
    peer = groups[1]
    del groups
    outcome: dict[str, Any] = {}

    def wait_on_us() -> None:
        started = time.monotonic()
        try:
            getattr(peer, blocked_on).allreduce([torch.ones(4)]).wait()
            outcome["error"] = None
        except RuntimeError as exc:
            outcome["error"] = str(exc)
        outcome["waited_s"] = time.monotonic() - started

    waiter = threading.Thread(target=wait_on_us, daemon=True)
    waiter.start()
    time.sleep(0.3)  # the peer is inside its collective, waiting for us
    assert waiter.is_alive(), outcome

    Worker.close_groups(mine)  # type: ignore[arg-type]

    assert mine.groups is None
    assert [t.name for t in threading.enumerate() if t.name == "close_group"] == [], \
        "the teardown returned while a group was still being destroyed"
    waiter.join(15)
    assert not waiter.is_alive(), f"the peer still waits on our closed {blocked_on} group"
    assert outcome["error"], outcome
    assert outcome["waited_s"] < 15 < TIMEOUT_S, outcome
    peer.star.close()


def test_closing_nothing_is_a_no_op() -> None:
    from aftershock.reference_impl._leave import Leave
    from aftershock.reference_impl.resilient import Worker

    idle = SimpleNamespace(groups=None, model=None, leave=Leave())
    Worker.close_groups(idle)  # type: ignore[arg-type]
    assert idle.groups is None
