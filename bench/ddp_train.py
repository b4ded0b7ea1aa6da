"""Plain DDP peer: the reference model under ``torch.nn.parallel.DistributedDataParallel``.

Launch with torchrun, like the reference trainer::

    python -m torch.distributed.run --standalone --nproc-per-node=4 -m bench.ddp_train \\
        --replicas 2 --shards 2 --steps 200 [--checkpoint-every 20 --checkpoint-dir DIR]

Without ``--checkpoint-every`` this is the no-fault-tolerance baseline. With it, and torchrun's
``--max-restarts``, it is what torchrun users do today: ``torch.save`` every K steps, and on a
failure the agent restarts every rank, which resume from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from aftershock.harness import probe
from aftershock.reference_impl.model import (
    ModelConfig,
    ParallelMLP,
    build_layout,
    param_digest,
    synthetic_batch,
)
from aftershock.reference_impl.phases import Laps
from bench._worker import add_model_args, exit_on_sigterm, fail

COMMIT = "COMMIT"


def _latest(root: Path) -> Path | None:
    """Newest step folder that rank 0 marked complete (written after a barrier)."""
    done = sorted(p for p in root.glob("step_*") if (p / COMMIT).exists()) if root.is_dir() else []
    return done[-1] if done else None


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ddp_train")
    add_model_args(parser)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":  # as the reference trainer: one GPU per rank, before the group
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    try:
        timeout = timedelta(seconds=args.collective_timeout)
        layout = build_layout(args.replicas, args.shards, timeout)
        rank = layout.rank
        probe.hello(world=world, generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        exit_on_sigterm()
        cfg = ModelConfig(d_model=args.d_model, hidden=args.hidden, blocks=args.blocks)
        model = DistributedDataParallel(
            ParallelMLP(cfg, layout, args.seed).to(device), process_group=layout.dp_group,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        root = Path(args.checkpoint_dir)
        step = 0
        if args.checkpoint_every and (path := _latest(root)) is not None:
            state = torch.load(path / f"rank_{rank}.pt", weights_only=False,
                               map_location=device)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            probe.checkpoint_loaded(step, str(path))
        laps = Laps()  # the same phases as the reference trainer's, where they exist
        while step < args.steps:
            x, y = synthetic_batch(cfg, args.seed, step, layout.replica, args.batch_size)
            x, y = x.to(device), y.to(device)
            laps.lap("batch")
            loss = F.mse_loss(model(x), y)
            laps.lap("forward")
            optimizer.zero_grad(set_to_none=True)
            laps.lap("zero_grad")
            loss.backward()  # DDP all-reduces gradient buckets over the DP group here
            laps.lap("backward")
            optimizer.step()
            laps.lap("optimizer")
            step += 1
            probe.step(step, world=world)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                laps.lap("rest")
                folder = root / f"step_{step:06d}"
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".rank_{rank}.pt.tmp"
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, tmp)
                tmp.rename(folder / f"rank_{rank}.pt")
                dist.barrier(group=layout.world_group)  # every rank's file is in place
                if rank == 0:
                    (folder / COMMIT).touch()
                    probe.checkpoint_saved(step, str(folder))
                laps.lap("checkpoint")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            laps.step_done(step)
        # The bench holds every row's final parameters to the oracle's (bench/oracle.py).
        probe.params(param_digest(model.module.state_dict()), step=step)
    except RuntimeError as exc:  # Gloo: a peer died or a collective timed out
        fail(exc)
    probe.emit("exit", code=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
