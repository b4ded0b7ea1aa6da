"""A small tensor-parallel MLP and the process groups of a replicas × shards world.

Layout: ``rank = replica * shards + shard``. The ``shards`` consecutive ranks of one replica
form its tensor-parallel (TP) group and hold one slice each of every block; the ranks with the
same shard index across replicas form a data-parallel (DP) group and hold identical slices.

Each block is Megatron-style: a column-parallel Linear (each shard owns ``hidden / shards``
output features), GELU, then a row-parallel Linear whose partial outputs are summed over the
TP group, plus a residual. Weights are cut from one full-size tensor drawn from a seeded
generator, so the model a 2-shard world trains is exactly the slicing of a 1-shard one.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelConfig:
    d_model: int = 64  # width of the residual stream and of the synthetic inputs
    hidden: int = 256  # MLP width of the full (unsharded) block; split evenly over shards
    blocks: int = 2  # number of residual MLP blocks
    d_out: int = 8  # regression targets per example


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this rank sits in the replicas × shards grid, and its groups."""

    replicas: int
    shards: int
    rank: int
    tp_group: Any  # dist.ProcessGroup of this rank's replica (its `shards` ranks)
    dp_group: Any  # dist.ProcessGroup of this rank's shard index across replicas
    world_group: Any  # the whole world, with the short collective timeout
    star: Any = None  # the vote's connections (reference_impl._star.Star); the trainer's own

    @property
    def replica(self) -> int:
        return self.rank // self.shards

    @property
    def shard(self) -> int:
        return self.rank % self.shards


def build_layout(replicas: int, shards: int, timeout: Any) -> Layout:
    """Create the TP, DP and world groups and return this rank's layout.

    ``new_group`` is a collective over the default group: every rank must create every
    group, in the same order, even the groups it is not a member of.
    """
    rank = dist.get_rank()
    tp_group = dp_group = None
    for replica in range(replicas):
        ranks = [replica * shards + s for s in range(shards)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            tp_group = group
    for shard in range(shards):
        ranks = [shard + k * shards for k in range(replicas)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = group
    # The default group was created with a generous timeout so that slow process start-up
    # (4 torch imports on 2 cores) does not fail rendezvous; all steady-state collectives
    # use this copy of the world, which carries the short failure-detection timeout.
    world_group = dist.new_group(list(range(replicas * shards)), timeout=timeout)
    return Layout(replicas, shards, rank, tp_group, dp_group, world_group)


# Seconds this process has spent inside the model's tensor-parallel all_reduces (waiting for
# peers included). The trainer subtracts it from forward+backward wall time to get its own
# compute time, which is what tells a straggler from the peers that wait for it.
comm_seconds = [0.0]


def all_reduce(tensor: torch.Tensor, group: Any) -> None:
    """Sum ``tensor`` in place over ``group``.

    ``group`` is either a group registered with torch.distributed (``dist.new_group``, the
    restart strategy) or a bare ``ProcessGroupGloo`` built per membership generation by
    ``aftershock.reference_impl.resilient``, which torch.distributed's functions do not know about.
    Both run the same Gloo algorithm, so the bits do not depend on which one is used.
    """
    started = time.perf_counter()
    if group in dist.distributed_c10d._world.pg_group_ranks:
        dist.all_reduce(tensor, group=group)
    else:
        group.allreduce([tensor]).wait()
    comm_seconds[0] += time.perf_counter() - started


def sum_through_root(value: torch.Tensor, rank: int, size: int,
                     send: Callable[[torch.Tensor, int], Any],
                     recv: Callable[[torch.Tensor, int], Any]) -> None:
    """Sum a small ``value`` in place over ``size`` ranks, through rank 0: every other rank
    sends its value to rank 0, which adds them in rank order and sends the total back. Every
    rank ends with the same bits; integers below 2**53 in float64 add up exactly.

    ``send(tensor, peer)`` and ``recv(tensor, peer)`` are point-to-point calls by group
    rank: a Gloo group's (each returns a ``Work`` to wait for) or a star's
    (``aftershock.reference_impl._star``, what the trainer's votes use; they return None, done).
    They
    fail as a collective does: at the timeout, or at once when the peer's connection closes,
    so a rank that completes has heard from every rank (rank 0 from all, the others from
    rank 0 after it heard from all). 2 (size - 1) messages in two hops: for one float64 over
    4 ranks on 2 cores, over Gloo's calls ~40% less wall time and CPU than Gloo's all_reduce,
    and over a star ~4x less again (``python -m bench.allreduce_sizes``, docs/benchmarks.md).
    """
    if size == 1:
        return
    if rank == 0:
        parts = [torch.empty_like(value) for _ in range(1, size)]
        works = [recv(part, peer) for peer, part in enumerate(parts, start=1)]
        for work in works:
            if work is not None:
                work.wait()
        for part in parts:
            value += part
        works = [send(value, peer) for peer in range(1, size)]
        for work in works:
            if work is not None:
                work.wait()
        return
    for call in (send, recv):
        work = call(value, 0)
        if work is not None:
            work.wait()


class _CopyToTP(torch.autograd.Function):
    """Input of a column-parallel layer: identity forward, all_reduce of the gradient backward.

    Every shard sees the full input, but each contributes only its slice's share of the
    input's gradient, so the shares are summed over the TP group.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Output of a row-parallel layer: all_reduce forward, identity backward.

    Each shard computes a partial product over its slice of the hidden features; the sum is
    the full output, and its gradient is already the same on every shard.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _full_init(seed: int, index: int, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """Draw a full-size tensor from a generator keyed by (seed, parameter index).

    One generator per parameter keeps each tensor independent of how many others exist
    and of the shard count; the caller slices it.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=generator) * (fan_in**-0.5)


class ParallelBlock(nn.Module):
    """x + RowParallel(GELU(ColumnParallel(x))), for one shard of the TP group."""

    tp_group: Any  # dist.ProcessGroup of this rank's replica; None once its groups are gone

    def __init__(self, cfg: ModelConfig, layout: Layout, seed: int, index: int) -> None:
        super().__init__()
        if cfg.hidden % layout.shards:
            raise ValueError(f"hidden={cfg.hidden} is not divisible by shards={layout.shards}")
        self.tp_group = layout.tp_group
        part = cfg.hidden // layout.shards
        cols = slice(layout.shard * part, (layout.shard + 1) * part)
        # nn.Linear stores weight as (out, in): the column-parallel layer owns rows of the
        # full (hidden, d_model) weight, the row-parallel layer owns columns of (d_model, hidden).
        w_in = _full_init(seed, 4 * index, (cfg.hidden, cfg.d_model), cfg.d_model)
        w_out = _full_init(seed, 4 * index + 1, (cfg.d_model, cfg.hidden), cfg.hidden)
        self.w_in = nn.Parameter(w_in[cols].clone())
        self.b_in = nn.Parameter(torch.zeros(cfg.hidden)[cols].clone())
        self.w_out = nn.Parameter(w_out[:, cols].clone())
        # Replicated on every shard and added once, after the TP sum.
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToTP.apply(x, self.tp_group), self.w_in, self.b_in))
        partial = F.linear(h, self.w_out)
        return x + _ReduceFromTP.apply(partial, self.tp_group) + self.b_out


class ParallelMLP(nn.Module):
    """Residual TP blocks and a small replicated regression head."""

    def __init__(self, cfg: ModelConfig, layout: Layout, seed: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ParallelBlock(cfg, layout, seed, index) for index in range(cfg.blocks)
        )
        # The head is replicated across the TP group: its input (the residual stream after a
        # TP sum) is bitwise equal on every shard, so its gradients are too.
        head = _full_init(seed, 4 * cfg.blocks, (cfg.d_out, cfg.d_model), cfg.d_model)
        self.head = nn.Parameter(head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.head)


def shard_numels(cfg: ModelConfig, shards: int) -> list[int]:
    """The element count of each of one shard's parameters, in ``parameters()`` order,
    without building the model (every shard's are the same; tests/test_model.py holds this to
    the model itself)."""
    part = cfg.hidden // shards
    block = [part * cfg.d_model, part, cfg.d_model * part, cfg.d_model]
    return [cfg.d_out * cfg.d_model] + block * cfg.blocks  # the head is the model's own


def _mix(*values: int) -> int:
    """A stable 63-bit seed from integers (``hash()`` of a tuple may change across Pythons)."""
    text = ":".join(str(v) for v in values).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def synthetic_batch(
    cfg: ModelConfig, seed: int, step: int, replica: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that replica ``replica`` trains on at 0-based ``step``.

    A pure function of (seed, step, replica): a resumed run sees exactly the data the lost
    run would have, and the shards of one replica all draw the same batch.
    """
    teacher = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    target_map = torch.randn((cfg.d_model, cfg.d_out), generator=teacher) * cfg.d_model**-0.5
    generator = torch.Generator().manual_seed(_mix(seed, step, replica))
    x = torch.randn((batch_size, cfg.d_model), generator=generator)
    return x, torch.sin(3.0 * x @ target_map)


class GradBuffer:
    """One flat buffer for a step's gradients (and the loss), reused step after step.

    The loops average their gradients in one flat all_reduce and then make each gradient a
    view of its slice (DDP's ``gradient_as_bucket_view``). A fresh buffer every step cost
    each rank ~0.2-0.3 ms of CPU for 1-2 MB: its allocation and page faults, and its release
    when ``zero_grad(set_to_none=True)`` dropped the last view (docs/benchmarks.md). The
    values are those of ``torch.cat``, bit for bit. The loops drop the previous step's views
    before the next backward; a view still passed in as an input makes ``torch.cat`` refuse
    (the input and its output would share memory) rather than overwrite it while it is read.
    """

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def flatten(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat`` of the parts, flattened, into the buffer (a new one when their total
        size, dtype or device changed)."""
        dtype = parts[0].dtype
        for part in parts[1:]:
            dtype = torch.promote_types(dtype, part.dtype)
        size = sum(part.numel() for part in parts)
        flat = self._flat
        if (flat is None or flat.numel() != size or flat.dtype != dtype
                or flat.device != parts[0].device):
            flat = self._flat = torch.empty(size, dtype=dtype, device=parts[0].device)
        return torch.cat([part.reshape(-1) for part in parts], out=flat)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, from the tensor's largest and smallest element.

    Exact: a NaN anywhere makes both NaN (min and max propagate NaN), +inf shows in the max,
    -inf in the min. One pass for both (``torch.aminmax``), without an intermediate tensor:
    ~19 µs for the bench's 264,000-element gradient buffer on one CPU thread, against ~32 µs
    for ``amax`` then ``amin`` and ~1.8 ms for ``torch.isfinite(t).all()`` (several passes
    and a bool tensor: 5% of a training step, per rank, per step).
    """
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def param_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over the exact bytes of every tensor, in sorted key order."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(state_dict[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
