"""The hot_spare/elastic vote: three flags over the world in one element.

A 4-rank Gloo all_reduce costs ~0.6 ms of wall time and ~30 µs of the transport's CPU per
rank with one element, ~2 ms and ~400 µs with three (docs/benchmarks.md): the vote is one
element, each flag a digit of base world + 1 (a flag's sum over the world is at most the
world's size), summed exactly in float64."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("world", [1, 2, 4, 7, 1000, 100_000])
def test_every_mix_of_flags_over_the_world_decodes_to_their_or(world: int) -> None:
    from reference_impl.resilient import decode_vote, encode_vote

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
    from reference_impl.resilient import decode_vote

    assert decode_vote(torch.tensor([math.nan], dtype=torch.float64), 4) == (False,) * 3
    assert decode_vote(torch.tensor([math.inf], dtype=torch.float64), 4) == (True,) * 3
    assert decode_vote(torch.tensor([-math.inf], dtype=torch.float64), 4) == (False,) * 3
    assert decode_vote(torch.tensor([0.0], dtype=torch.float64), 4) == (False,) * 3
