"""torchft 0.2.0 peer: the reference model in two torchft replica groups.

One replica group per torchrun (``--nproc-per-node=SHARDS --max-restarts=N``): inside a group
the shards form the ordinary tensor-parallel group (torchrun's default group); across groups
the gradients go through torchft's ``Manager.allreduce`` on a ``torchft.ProcessGroupGloo``,
with a quorum from the lighthouse every step (``use_async_quorum``, its default) and
``should_commit`` before the optimizer step, as ``torchft.optim.OptimizerWrapper`` does.

Why not ``torchft.ddp.DistributedDataParallel``: its comm hook asserts ``fut._fut`` on the
future ``Manager.allreduce`` returns, and when the peer replica dies mid-allreduce torchft
hands back a dummy future instead, so the survivor crashes with an ``AssertionError``
(bench/results/investigations-2026-12.md). That would turn "survivors go on" into
"survivors restart" and measure a bug, not the design. The flat-buffer all-reduce below is
one collective per step, like the reference trainer's, and errors are handled the torchft
way: reported to the manager, the step is discarded by ``should_commit`` and recorded as
``step_discarded``.

Environment: ``TORCHFT_LIGHTHOUSE`` (set by the bench), ``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchft import Manager, ProcessGroupGloo

from aftershock.harness import probe
from aftershock.reference_impl.model import (
    Layout,
    ModelConfig,
    ParallelMLP,
    param_digest,
    synthetic_batch,
)
from bench._worker import add_model_args, exit_on_sigterm, fail


def _grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient after backward (every parameter of the model has one)."""
    grad = param.grad
    assert grad is not None
    return grad


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torchft_train")
    add_model_args(parser)
    parser.add_argument("--timeout", type=float, default=60.0, help="Manager timeout, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group_id = int(os.environ["REPLICA_GROUP_ID"])
    # The replica group's own world: its tensor-parallel group, and the TCPStore that
    # torchft's Manager uses inside the group (MASTER_ADDR:MASTER_PORT).
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    shard = dist.get_rank()
    rank = group_id * args.shards + shard  # global rank, as in the reference layout
    layout = Layout(args.replicas, args.shards, rank, dist.group.WORLD, None, None)
    cfg = ModelConfig(d_model=args.d_model, hidden=args.hidden, blocks=args.blocks)
    model = ParallelMLP(cfg, layout, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        replica_id=f"bench_{group_id}",
    )
    probe.hello(
        world=args.replicas * args.shards,
        generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        rank=rank,
    )
    exit_on_sigterm()
    params = list(model.parameters())
    full = args.replicas
    detected = False
    try:
        while manager.current_step() < args.steps:
            optimizer.zero_grad(set_to_none=True)
            manager.start_quorum()
            step = manager.current_step()  # 0-based data position of this attempt
            x, y = synthetic_batch(cfg, args.seed, step, group_id, args.batch_size)
            loss = F.mse_loss(model(x), y)
            loss.backward()  # tensor-parallel collectives (plain Gloo) run in here
            flat = torch.cat([_grad(p).reshape(-1) for p in params])
            manager.allreduce(flat).wait()  # averages over the participating replicas
            participants = manager.num_participants()
            if not detected and (manager.errored() is not None or participants < full):
                detected = True
                error = manager.errored()
                cause = "torchft: allreduce error" if error else "torchft: quorum shrank"
                probe.detected(cause=cause, rank=rank, participants=participants)
            elif detected and participants >= full:
                detected = False
            offset = 0
            for p in params:
                _grad(p).copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            if manager.should_commit():
                optimizer.step()
                probe.step(
                    manager.current_step(), world=participants * args.shards, rank=rank
                )
            else:
                probe.emit("step_discarded", step=step + 1, rank=rank)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except RuntimeError as exc:  # the tensor-parallel group lost a member: restart the group
        fail(exc)
    # The bench holds every row's final parameters to the oracle's (bench/oracle.py).
    probe.params(param_digest(model.state_dict()), step=manager.current_step(), rank=rank)
    probe.emit("exit", code=0, rank=rank)
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's background threads may hold the interpreter otherwise


if __name__ == "__main__":
    raise SystemExit(main())
