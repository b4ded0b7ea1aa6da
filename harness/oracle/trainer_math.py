"""The reference trainer's math, restated from its specification alone: the independent oracle.

This module recomputes the final parameters of the reference trainer
(``reference: trainer``) from the seed, the configuration and the membership log, in one
process, with no process group and no recovery code. It imports nothing from
``reference_impl``: it is a second, independent statement of the same math (docs/trainer.md),
so a bug in the trainer (a wrong gradient average, a shuffled data order, a changed
initialisation) makes the two disagree instead of passing itself.

What is restated, and what the restatement must reproduce bit for bit:

- **Initialisation.** Every full-size weight is drawn from its own ``torch.Generator`` seeded
  with ``seed * 1_000_003 + index`` (index ``4*block`` for the column-parallel weight of
  ``block``, ``4*block + 1`` for its row-parallel weight, ``4*blocks`` for the head) and scaled
  by ``fan_in ** -0.5``; biases start at zero. A shard owns rows ``[s*H/S, (s+1)*H/S)`` of the
  first weight and the same columns of the second; ``b_out`` and the head are replicated.
- **Data.** Replica ``r`` at 0-based step ``k`` draws ``x ~ N(0, 1)`` of shape
  ``(batch, d_model)`` from a generator seeded with the top 63 bits of
  ``sha256("seed:k:r")``; the target is ``sin(3 x T)`` with a fixed teacher matrix ``T``.
- **Forward/backward of one replica.** Each block is
  ``x + TPsum_s(W_out,s · gelu(W_in,s x + b_in,s)) + b_out`` followed by a linear head and the
  mean squared error. The tensor-parallel (TP) sum is an all_reduce over the replica's shards:
  forward it sums the shards' partial products, backward it sums the shards' contributions to
  the block input's gradient. Each shard's own ops run separately, with the shapes a rank uses,
  so every kernel sees exactly the operands it sees in the trainer.
- **Data-parallel average.** The live replicas' gradients are summed (the DP all_reduce) and
  divided by the number of *live* replicas, as the membership log says, step by step.
- **Optimizer.** ``torch.optim.AdamW(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)``, state
  created at step 0. The optimizer is torch's, like the matmul kernels: the trainer's choice of
  it and of every hyperparameter is restated here, its implementation is not under test.

Supported layouts (``aftershock.harness.oracle.unsupported`` says why a layout is not): the bits of
a sum
depend on the order of its terms, and a sum of two floats is the same in either order
(``a + b == b + a`` in IEEE arithmetic) while a sum of three is not (Gloo's ring all_reduce
picks the order). So every collective sum must have at most two terms: ``shards`` in {1, 2}
and at most two live replicas in every generation, on the Gloo backend on CPU. NCCL's
reductions, and CUDA kernels, are out of reach of a CPU restatement; one NCCL rank
(1 replica x 1 shard: every sum has one term) is restated on the GPU itself, with the same
kernels (``"device": "cuda"`` in the request). Anything else is "not observed", never a
pass.

Run as ``python -m aftershock.harness.oracle.trainer_math`` with a JSON request on stdin (what
``aftershock.harness.oracle.trainer_digests`` sends): a fresh process, one thread, like a trainer
rank.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from aftershock.harness.oracle import Generation, unsupported

#: The reference trainer's fixed hyperparameters (TrainConfig defaults; scenarios cannot
#: change them). Restated, not imported: tests/test_oracle.py checks they still agree.
D_MODEL, HIDDEN, BLOCKS, D_OUT = 64, 256, 2, 8
BATCH_SIZE = 32
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.999), 1e-8, 0.0


@dataclass(frozen=True, slots=True)
class Shape:
    replicas: int  # configured data-parallel replicas (the full world)
    shards: int  # tensor-parallel shards per replica
    d_model: int = D_MODEL
    hidden: int = HIDDEN
    blocks: int = BLOCKS
    d_out: int = D_OUT
    batch_size: int = BATCH_SIZE


def _normal(seed: int, index: int, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    scale: float = float(fan_in) ** -0.5  # == fan_in ** -0.5: the int converts exactly
    return torch.randn(shape, generator=generator) * scale


def _stream_seed(seed: int, step: int, replica: int) -> int:
    text = f"{seed}:{step}:{replica}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def batch(shape: Shape, seed: int, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s examples at 0-based ``step``."""
    teacher = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    target_map = torch.randn((shape.d_model, shape.d_out), generator=teacher)
    target_map = target_map * shape.d_model**-0.5
    generator = torch.Generator().manual_seed(_stream_seed(seed, step, replica))
    x = torch.randn((shape.batch_size, shape.d_model), generator=generator)
    return x, torch.sin(3.0 * x @ target_map)


class _ToShards(torch.autograd.Function):
    """The block input, handed to every shard; backward, the TP sum of their gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shards: int) -> tuple[torch.Tensor, ...]:
        return tuple(x.clone() for _ in range(shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (_tp_sum(grads), None)


class _FromShards(torch.autograd.Function):
    """The TP sum of the shards' partial outputs; backward, the same gradient to each."""

    @staticmethod
    def forward(ctx: Any, *partials: torch.Tensor) -> torch.Tensor:
        return _tp_sum(partials)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(grad.clone() for _ in range(len(ctx.needs_input_grad)))


def _tp_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    # At most two terms (see the module docstring): their order cannot change the bits.
    total = parts[0].contiguous().clone()
    for part in parts[1:]:
        total += part
    return total


class Params:
    """One replica's state: per shard the sliced weights, and the replicated ones once."""

    def __init__(self, shape: Shape, seed: int, device: str = "cpu") -> None:
        self.shape = shape

        def _leaf(tensor: torch.Tensor) -> torch.Tensor:
            # Drawn on the CPU like the trainer's, then moved as its model is (`.to(device)`).
            return tensor.clone().contiguous().to(device).requires_grad_(True)

        part = shape.hidden // shape.shards
        self.w_in: list[list[torch.Tensor]] = []  # [block][shard]
        self.b_in: list[list[torch.Tensor]] = []
        self.w_out: list[list[torch.Tensor]] = []
        self.b_out: list[torch.Tensor] = []
        for block in range(shape.blocks):
            w_in = _normal(seed, 4 * block, (shape.hidden, shape.d_model), shape.d_model)
            w_out = _normal(seed, 4 * block + 1, (shape.d_model, shape.hidden), shape.hidden)
            cols = [slice(s * part, (s + 1) * part) for s in range(shape.shards)]
            self.w_in.append([_leaf(w_in[c]) for c in cols])
            self.b_in.append([_leaf(torch.zeros(shape.hidden)[c]) for c in cols])
            self.w_out.append([_leaf(w_out[:, c]) for c in cols])
            self.b_out.append(_leaf(torch.zeros(shape.d_model)))
        self.head = _leaf(_normal(seed, 4 * shape.blocks, (shape.d_out, shape.d_model),
                                  shape.d_model))

    def all(self) -> list[torch.Tensor]:
        found = [t for block in range(self.shape.blocks) for t in (
            *self.w_in[block], *self.b_in[block], *self.w_out[block], self.b_out[block])]
        return [*found, self.head]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shards = self.shape.shards
        for block in range(self.shape.blocks):
            inputs = _ToShards.apply(x, shards)  # type: ignore[no-untyped-call]
            partials = [
                F.linear(F.gelu(F.linear(inputs[s], self.w_in[block][s], self.b_in[block][s])),
                         self.w_out[block][s])
                for s in range(shards)
            ]
            summed = _FromShards.apply(*partials)  # type: ignore[no-untyped-call]
            x = x + summed + self.b_out[block]
        return F.mse_loss(F.linear(x, self.head), y)

    def state_dict(self, shard: int) -> dict[str, torch.Tensor]:
        """What rank ``replica * shards + shard`` holds, under the trainer's names."""
        state = {"head": self.head}
        for block in range(self.shape.blocks):
            state[f"blocks.{block}.w_in"] = self.w_in[block][shard]
            state[f"blocks.{block}.b_in"] = self.b_in[block][shard]
            state[f"blocks.{block}.w_out"] = self.w_out[block][shard]
            state[f"blocks.{block}.b_out"] = self.b_out[block]
        return state


def digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the bytes of every tensor in sorted key order (the trainer's ``params``)."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def final_digests(shape: Shape, seed: int, steps: int, schedule: list[Generation],
                  device: str = "cpu") -> dict[int, str]:
    """Each rank's final digest after ``steps`` steps of the membership ``schedule``.

    Only ranks of the replicas live at the end report parameters, as in the trainer. On
    ``device="cuda"`` (one NCCL rank) the same ops run on the GPU, with the kernels the
    trainer's rank runs there; data and initial weights are drawn on the CPU, as there."""
    why = unsupported(backend="nccl" if device == "cuda" else "gloo", replicas=shape.replicas,
                      shards=shape.shards, schedule=schedule)
    if why is not None:
        raise ValueError(why)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device here: the restatement of an NCCL rank runs on a GPU")
    torch.set_num_threads(1)  # one thread per rank: the kernels' reduction order
    params = Params(shape, seed, device)
    tensors = params.all()
    optimizer = torch.optim.AdamW(tensors, lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
    live = schedule[0].replicas
    for step in range(1, steps + 1):
        live = next(g.replicas for g in reversed(schedule) if g.first_step <= step)
        flats = []
        for replica in live:
            x, y = batch(shape, seed, step - 1, replica)
            x, y = x.to(device), y.to(device)
            grads = torch.autograd.grad(params.loss(x, y), tensors)
            flats.append(torch.cat([g.reshape(-1) for g in grads]))
        flat = _tp_sum(flats)  # the DP all_reduce: at most two terms as well
        flat /= len(live)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.grad = flat[offset : offset + n].view_as(t).clone()
            offset += n
        optimizer.step()
    with torch.no_grad():
        by_shard = [digest(params.state_dict(s)) for s in range(shape.shards)]
    return {replica * shape.shards + s: by_shard[s] for replica in live
            for s in range(shape.shards)}


def main() -> int:
    request = json.load(sys.stdin)
    # The trainer's shape by its world (replicas, shards), or a whole shape (the bench's model).
    shape = (Shape(**{k: int(v) for k, v in request["shape"].items()}) if "shape" in request
             else Shape(replicas=int(request["replicas"]), shards=int(request["shards"])))
    schedule = [Generation(int(first), tuple(int(r) for r in replicas))
                for first, replicas in request["schedule"]]
    device = str(request.get("device", "cpu"))
    if device == "cpu":
        # (On the GPU it would need cuBLAS's workspace changed, which could change the
        # kernels cuBLAS picks from the trainer's: the run-to-run determinism of one GPU
        # stream is what the restatement relies on there.)
        torch.use_deterministic_algorithms(True)
    result = final_digests(shape, int(request["seed"]), int(request["steps"]), schedule,
                           device)
    json.dump({"digests": {str(k): v for k, v in sorted(result.items())}}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
