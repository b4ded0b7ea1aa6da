"""``python bench/results/profiles/adam_views.py D_MODEL HIDDEN``: AdamW's step alone, on
one thread, with each gradient a tensor of its own and with each a view of one flat buffer
(the trainer's loops, ``GradBuffer``), for one tensor-parallel shard (of 2) of the bench's
model shape. Three rounds of 300 steps a side, alternating; the main thread's CPU per step."""

from __future__ import annotations

import sys
import time

import torch

SHARDS = 2


def shapes(d_model: int, hidden: int) -> list[tuple[int, ...]]:
    """One shard's parameters of ``ParallelMLP`` with 2 blocks, in its order (d_out 8)."""
    per_shard = hidden // SHARDS
    block = [(per_shard, d_model), (per_shard,), (d_model, per_shard), (d_model,)]
    return [(8, d_model), *block, *block]


def run(views: bool, sizes: list[tuple[int, ...]], steps: int = 300) -> float:
    """CPU milliseconds per ``optimizer.step()``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size)) for size in sizes]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    grads = [torch.randn(p.shape) * 1e-3 for p in params]
    flat = torch.empty(sum(p.numel() for p in params) + 1)
    spent = 0.0
    for _ in range(steps):
        for p in params:
            p.grad = None
        if views:
            torch.cat([g.reshape(-1) for g in grads] + [torch.zeros(1)], out=flat)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.grad = flat[offset : offset + g.numel()].view_as(p)
                offset += g.numel()
        else:
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        began = time.thread_time()
        optimizer.step()
        spent += time.thread_time() - began
    return spent / steps * 1e3


def main(d_model: int, hidden: int) -> None:
    torch.set_num_threads(1)
    sizes = shapes(d_model, hidden)
    for _ in range(3):
        for views in (False, True):
            side = "views of one buffer" if views else "tensors of their own"
            print(f"{side}: {run(views, sizes):.3f} ms a step")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
