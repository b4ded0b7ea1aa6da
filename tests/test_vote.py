"""The hot_spare/elastic vote: three flags over the world in one element.

A 4-rank Gloo all_reduce costs ~0.6 ms of wall time and ~30 µs of the transport's CPU per
rank with one element, ~2 ms and ~400 µs with three (bench/results/investigations-2026-12.md,
"The three-float vote"): the vote is one element, each flag a digit of base world + 1 (a
flag's sum over the world is at most the world's size), summed exactly in float64."""

from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any

import pytest

from tests._helpers import on_threads

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("world", [1, 2, 4, 7, 1000, 100_000])
def test_every_mix_of_flags_over_the_world_decodes_to_their_or(world: int) -> None:
    from aftershock.reference_impl.resilient import decode_vote, encode_vote

    ranks = range(min(world, 4))
    for flags in itertools.product([False, True], repeat=3 * len(ranks)):
        per_rank = [flags[3 * r : 3 * r + 3] for r in ranks]
        total = sum(encode_vote(f, world) for f in per_rank)  # what SUM computes
        assert total.shape == (1,)
        assert total.dtype == torch.float64
        ored = tuple(any(f[i] for f in per_rank) for i in range(3))
        assert decode_vote(total, world) == ored, (per_rank, float(total))
    # Every rank raising every flag: the largest sum, still exact.
    full = encode_vote((True, True, True), world) * world
    assert decode_vote(full, world) == (True, True, True)


def test_a_corrupted_vote_decodes_as_the_three_float_vote_did() -> None:
    """``collective.corrupt`` can hit the vote itself: NaN raised no flag and +inf every one
    in the three-float vote (each compared ``> 0``), and so here."""
    from aftershock.reference_impl.resilient import decode_vote

    assert decode_vote(torch.tensor([math.nan], dtype=torch.float64), 4) == (False,) * 3
    assert decode_vote(torch.tensor([math.inf], dtype=torch.float64), 4) == (True,) * 3
    assert decode_vote(torch.tensor([-math.inf], dtype=torch.float64), 4) == (False,) * 3
    assert decode_vote(torch.tensor([0.0], dtype=torch.float64), 4) == (False,) * 3


def _gloo_world(size: int, timeout_s: float = 30.0) -> list[Any]:
    """``size`` real Gloo groups over loopback, one per rank, built in threads (Gloo's
    calls release the GIL) around one in-memory store."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    groups: list[Any] = [None] * size

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    return groups


def _star(group: Any, rank: int, size: int, value: Any) -> None:
    from aftershock.reference_impl.model import sum_through_root

    sum_through_root(value, rank, size, send=lambda t, peer: group.send([t], peer, 0),
                     recv=lambda t, peer: group.recv([t], peer, 0))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_vote_through_rank_0_gives_every_rank_the_exact_sum(size: int) -> None:
    """The vote's sum goes through rank 0 over real Gloo point-to-point calls; every rank ends
    with the same exact sum, for every mix of flags, call after call on the same groups."""
    from aftershock.reference_impl.resilient import decode_vote, encode_vote

    groups = _gloo_world(size)
    mixes = list(itertools.product([False, True], repeat=3))
    for flags_of in ([mixes[(r + k) % 8] for r in range(size)] for k in range(8)):
        def vote(rank: int, flags_of: list[Any] = flags_of) -> float:
            value = encode_vote(flags_of[rank], size)
            _star(groups[rank], rank, size, value)
            return float(value[0])

        totals = on_threads(size, vote)
        want = float(sum(encode_vote(f, size) for f in flags_of)[0])
        assert totals == [want] * size, (flags_of, totals)
        assert decode_vote(torch.tensor([want], dtype=torch.float64), size) == tuple(
            any(f[i] for f in flags_of) for i in range(3))


@pytest.mark.parametrize("gone", [0, 3])
def test_a_rank_that_drops_its_group_fails_every_other_rank_at_once(gone: int) -> None:
    """The resilient worker drops its groups on a failure so that its peers' pending calls
    fail at once rather than at the timeout. Each rank here does the same; a dropped rank
    must then fail every other rank's vote within seconds, not at the 30 s timeout: rank 0
    at its receive from a dropped rank, the others at their receive from rank 0 once it
    failed (or was the one dropped)."""
    import gc

    size = 4
    groups = _gloo_world(size, timeout_s=30.0)

    def vote(rank: int) -> float:
        if rank == gone:
            time.sleep(0.3)  # the others are waiting in the vote by now
            groups[rank] = None
            gc.collect()  # what closes a Gloo group's sockets in torch 2.13 (resilient.py)
            return -1.0
        value = torch.tensor([1.0], dtype=torch.float64)
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            _star(groups[rank], rank, size, value)
        failed = time.monotonic() - started
        groups[rank] = None  # as the worker does on a failure: its own peers fail now
        gc.collect()
        return failed

    waited = [w for rank, w in enumerate(on_threads(size, vote)) if rank != gone]
    assert all(isinstance(w, float) for w in waited), waited
    assert max(waited) < 3.0, waited


# ---------------------------------------------------------------------------------------------
# Fingerprints ride in the vote after the step they fingerprint (hot_spare, elastic)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fingerprints_ride_in_the_vote_and_every_rank_reads_every_one(size: int) -> None:
    """Each rank adds its 64-bit fingerprint (any sign, any bits) to its own two slots of
    the vote; after the sum through rank 0 over real Gloo groups, every rank reads every
    rank's fingerprint exactly, and the flags as before."""
    import random

    from aftershock.reference_impl.resilient import (
        decode_fingerprints,
        decode_vote,
        encode_fingerprint,
        encode_vote,
    )

    rng = random.Random(7)
    groups = _gloo_world(size)
    for _ in range(5):
        fps = [rng.choice([-(2**63), 2**63 - 1, 0, -1, rng.getrandbits(64) - 2**63])
               for _ in range(size)]
        flags = [(rng.random() < 0.3, False, rng.random() < 0.3) for _ in range(size)]

        def vote(rank: int, fps: list[int] = fps, flags: list[Any] = flags) -> Any:
            value = torch.cat([encode_vote(flags[rank], size),
                               encode_fingerprint(fps[rank], rank, size)])
            _star(groups[rank], rank, size, value)
            return decode_vote(value[:1], size), decode_fingerprints(value[1:], size)

        want = tuple(any(f[i] for f in flags) for i in range(3))
        assert on_threads(size, vote) == [(want, fps)] * size


def test_a_fingerprint_a_corrupted_vote_cannot_hold_is_read_as_none() -> None:
    from aftershock.reference_impl.resilient import decode_fingerprints, encode_fingerprint

    total = encode_fingerprint(-5, 0, 3) + encode_fingerprint(12345, 1, 3) \
        + encode_fingerprint(2**40, 2, 3)
    assert decode_fingerprints(total, 3) == [-5, 12345, 2**40]
    for bad in (math.nan, math.inf, -1.0, 0.5, float(2**32)):
        poisoned = total.clone()
        poisoned[3] = bad
        assert decode_fingerprints(poisoned, 3) == [-5, None, 2**40], bad


def test_the_odd_replicas_are_outside_the_majority_and_unreadable_ones_never_agree() -> None:
    from aftershock.reference_impl.resilient import disagreeing_shards

    # 3 replicas x 2 shards: ranks 0..5, shard = rank % 2, replica = rank // 2.
    members = [0, 1, 2, 3, 4, 5]
    assert disagreeing_shards([7, 9, 7, 9, 7, 9], members, 2) == {}
    assert disagreeing_shards([7, 9, 8, 9, 7, 9], members, 2) == {0: [1]}
    assert disagreeing_shards([7, 9, 8, 9, 6, 9], members, 2) == {0: [0, 1, 2]}
    assert disagreeing_shards([7, 9, 7, None, 7, 9], members, 2) == {1: [1]}
    # Two replicas that differ: no majority, both odd. One replica alone: nothing to compare.
    assert disagreeing_shards([1, 2], [0, 2], 2) == {0: [0, 1]}
    assert disagreeing_shards([1], [0], 1) == {}
    # A lone unreadable fingerprint agrees with nothing either.
    assert disagreeing_shards([None], [0], 1) == {0: [0]}
    # Members after a loss: ranks 1, 2, 3 left of 4 (shard 1 has replicas 0 and 1).
    assert disagreeing_shards([5, 6, 4], [1, 2, 3], 2) == {1: [0, 1]}


def test_a_kept_buffer_is_reused_only_once_nothing_holds_it() -> None:
    """The snapshot sender may still be sending a kept state when the loop takes its next
    copy: that copy must go to another buffer, or the snapshot would be torn."""
    from aftershock.reference_impl.resilient import KeptStates

    kept = KeptStates()
    state = [torch.arange(4, dtype=torch.float32), torch.ones(2)]
    first = kept.copy(state)
    assert first.tolist() == [0, 1, 2, 3, 1, 1]
    kept.hold(first)  # the sender takes it
    kept.drop(first)  # the loop is done with it
    second = kept.copy([t * 2 for t in state])
    assert second.data_ptr() != first.data_ptr()
    assert first.tolist() == [0, 1, 2, 3, 1, 1]  # untouched while the sender reads it
    kept.drop(first)  # sent
    third = kept.copy([t * 3 for t in state])
    assert third.data_ptr() == first.data_ptr()  # reused, nothing held it
    assert third.tolist() == [0, 3, 6, 9, 3, 3]
    assert kept.held() == 2  # second and third
    # A buffer of another size is never handed out for this one; one the pool did not make
    # is left alone.
    kept.drop(second)
    other = kept.copy([torch.ones(3)])
    assert other.numel() == 3
    assert other.data_ptr() != second.data_ptr()
    stranger = torch.zeros(6)
    kept.drop(stranger)
    kept.hold(stranger)
    assert kept.held() == 2


def _judge(tmp_path: Any, monkeypatch: Any, fingerprints: list[int | None]) -> Any:
    """A worker of replica 0, shard 0 (the snapshotter), 2 replicas x 1 shard, whose step-10
    state awaits the fingerprints the vote just brought; the step-0 state is the rollback's."""
    import queue
    from types import SimpleNamespace

    from aftershock.harness.probe import EVENTS_ENV
    from aftershock.reference_impl.resilient import Groups, KeptStates, Worker

    monkeypatch.setenv(EVENTS_ENV, str(tmp_path / "events.jsonl"))
    worker = Worker.__new__(Worker)  # no store, no threads: the decision alone
    worker.cfg = SimpleNamespace(shards=1, snapshot_every=10)
    worker.kept = KeptStates()
    worker.snapshots = queue.Queue(1)
    worker.mismatch = False
    worker.verified = (0, worker.kept.copy([torch.zeros(3)]))
    worker.candidate = (10, worker.kept.copy([torch.ones(3)]))
    g = Groups(gen=0, rank=0, members=[0, 1], replicas=[0, 1], world=None, tp=None, dp=None,
               dp_ranks=[0, 1], star=None)
    worker.judge_fingerprints(g, 10, fingerprints, snapshotter=True)
    return worker


def test_agreed_fingerprints_keep_the_state_and_send_its_snapshot(tmp_path: Any,
                                                                   monkeypatch: Any) -> None:
    worker = _judge(tmp_path, monkeypatch, [5, 5])
    assert not worker.mismatch
    assert worker.candidate is None
    step, state = worker.verified
    assert (step, state.tolist()) == (10, [1.0, 1.0, 1.0])
    sent_step, _, sent = worker.snapshots.get_nowait()
    assert sent_step == 10
    assert sent is state
    # The loop's next copy cannot land in the buffer being sent or the one kept; the old
    # rollback state's buffer is free again.
    assert worker.kept.held() == 1
    nxt = worker.kept.copy([torch.full((3,), 2.0)])
    assert nxt.data_ptr() != state.data_ptr()
    # Even once the loop lets go of it (a later agreement replaced it), the sender's hold
    # keeps the buffer from the next copies until it was sent.
    worker.kept.drop(state)
    later = [worker.kept.copy([torch.full((3,), 3.0)]) for _ in range(2)]
    assert state.data_ptr() not in {t.data_ptr() for t in later}
    assert state.tolist() == [1.0, 1.0, 1.0]
    assert not (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize("fingerprints", [[5, 6], [5, None]])
def test_differing_fingerprints_send_nothing_and_keep_the_last_agreed_state(
    tmp_path: Any, monkeypatch: Any, fingerprints: list[int | None],
) -> None:
    import json

    worker = _judge(tmp_path, monkeypatch, fingerprints)
    assert worker.mismatch
    assert worker.candidate is None
    step, state = worker.verified
    assert (step, state.tolist()) == (0, [0.0, 0.0, 0.0])
    assert worker.snapshots.empty()
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["cause"], event["step"], event["shard"]) == (
        "failure_detected", "fingerprint_mismatch", 10, 0)
    assert event["replicas"] == [0, 1]


def test_every_flipped_bit_of_the_parameters_changes_the_fingerprint() -> None:
    """A fingerprint must tell apart replicas whose parameters differ by one bit, wherever it
    is, and only the parameters count (the optimizer state after them in the flat copy may
    differ between two equal replicas' copies taken at different moments: it does not); the
    value fits the vote's signed 64-bit slots."""
    from aftershock.reference_impl.resilient import Worker

    worker = Worker.__new__(Worker)  # the fingerprint alone: no store, no threads
    worker.model = torch.nn.Linear(16, 8)
    params = torch.cat([p.detach().reshape(-1) for p in worker.model.parameters()])
    flat = torch.cat([params, torch.randn(50)])  # and AdamW's state after them
    base = worker.fingerprint(flat)
    assert -(2**63) <= base < 2**63
    words = flat.view(torch.int32)
    seen = set()
    for index in range(params.numel()):
        for bit in range(32):
            flipped = words.clone()
            flipped[index] ^= (1 << bit) if bit < 31 else -(2**31)
            value = worker.fingerprint(flipped.view(torch.float32))
            assert value != base, (index, bit)
            seen.add(value)
    assert len(seen) == 32 * params.numel()  # no two flips collide either
    tail = words.clone()
    tail[params.numel():] ^= 1
    assert worker.fingerprint(tail.view(torch.float32)) == base
