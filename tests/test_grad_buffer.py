"""The training loops' flat gradient buffer, reused step after step.

A fresh 1-2 MB buffer per step cost each rank ~0.2-0.3 ms of CPU (its allocation, page faults
and, when the last gradient view was dropped, its release): docs/benchmarks.md. Reusing one
must not change a single bit, and must never overwrite gradients still in use.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")


def _parts(seed: int) -> list[object]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen),
            torch.randn(1, generator=gen)]


def test_the_buffer_holds_what_a_fresh_concatenation_holds_step_after_step() -> None:
    from aftershock.reference_impl.model import GradBuffer

    buffer = GradBuffer()
    first = buffer.flatten(_parts(0))
    address = first.data_ptr()
    assert torch.equal(first, torch.cat([t.reshape(-1) for t in _parts(0)]))
    del first
    second = buffer.flatten(_parts(1))
    assert torch.equal(second, torch.cat([t.reshape(-1) for t in _parts(1)]))
    assert second.data_ptr() == address, "a new buffer was allocated for the same shapes"


def test_a_change_of_size_or_dtype_gets_a_new_buffer() -> None:
    from aftershock.reference_impl.model import GradBuffer

    buffer = GradBuffer()
    buffer.flatten(_parts(0))
    bigger = [*_parts(1), torch.ones(3)]
    assert torch.equal(buffer.flatten(bigger), torch.cat([t.reshape(-1) for t in bigger]))
    doubles = [t.double() for t in _parts(2)]
    out = buffer.flatten(doubles)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in doubles]))
    # Mixed dtypes promote as torch.cat does.
    mixed = [torch.ones(2, dtype=torch.float32), torch.ones(2, dtype=torch.float64)]
    assert buffer.flatten(mixed).dtype == torch.cat(mixed).dtype


def test_gradients_still_viewing_the_buffer_are_never_overwritten() -> None:
    """The loops drop the previous step's gradient views (``zero_grad(set_to_none=True)``)
    before the next backward. A view still read as an input must fail the step loudly, not
    be overwritten while it is read."""
    from aftershock.reference_impl.model import GradBuffer

    buffer = GradBuffer()
    flat = buffer.flatten(_parts(0))
    stale = flat[:12].view(4, 3)  # as p.grad after the loop's scatter
    with pytest.raises(RuntimeError, match="single memory location"):
        buffer.flatten([stale, torch.zeros(5), torch.zeros(1)])


def test_the_trainer_reuses_one_buffer_and_ends_bitwise_where_it_did(tmp_path: object) -> None:
    """average_gradients on a 1-rank world, two steps: the second step's gradients live in the
    first step's buffer, and equal a fresh concatenation's average bit for bit."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from aftershock.reference_impl import trainer
    from aftershock.reference_impl._star import Star
    from aftershock.reference_impl.model import GradBuffer, ModelConfig, ParallelMLP, build_layout

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        layout = dataclasses.replace(build_layout(1, 1, timedelta(seconds=30)),
                                     star=Star(0, 1, {}, 30.0))
        model = ParallelMLP(ModelConfig(d_model=8, hidden=16, blocks=1), layout, 0)
        buffer = GradBuffer()
        addresses = []
        for step in range(2):
            model.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            loss.backward()
            want = [p.grad.clone() for p in model.parameters()]
            flags = torch.zeros(2, dtype=torch.float64)
            global_loss, finite = trainer.average_gradients(model, loss, layout, buffer, flags)
            assert finite
            assert global_loss == float(loss.detach())
            for p, g in zip(model.parameters(), want, strict=True):
                assert torch.equal(p.grad, g)  # one replica: the average is the gradient
            addresses.append(next(model.parameters()).grad.data_ptr())
        assert addresses[0] == addresses[1]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_all_finite_finds_one_nan_or_infinity_wherever_it_is(dtype: str) -> None:
    """The loops skip a step on ``all_finite``'s word; a non-finite element it missed would be
    applied. One pass finds both bounds (``torch.aminmax``): checked here against
    ``torch.isfinite(...).all()`` for each special value at the edges, inside a vectorised
    stretch and in its tail, and for sizes around the vector widths."""
    from aftershock.reference_impl.model import all_finite

    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    for size in (1, 2, 7, 8, 9, 63, 64, 65, 1000, 263_809):
        clean = torch.randn(size, generator=gen).to(kind)
        assert all_finite(clean)
        for value in (float("nan"), float("inf"), -float("inf")):
            for index in sorted({0, size // 2, size - 1, max(size - 3, 0)}):
                bad = clean.clone()
                bad[index] = value
                assert not all_finite(bad), (size, value, index)
                assert bool(torch.isfinite(bad).all()) is False
    # The largest finite values are finite (no overflow of a sum, no false alarm).
    big = torch.full((100,), torch.finfo(kind).max, dtype=kind)
    big[::2] = -torch.finfo(kind).max
    assert all_finite(big)
