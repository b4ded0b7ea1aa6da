"""Fault-tolerant data-parallel training with torchft, in the style of torchft's own
train_ddp example: each replica group is its own torchrun (REPLICA_GROUP_ID set), the
groups meet through the lighthouse, and a group that fails rejoins by healing from a live
peer while the others go on. It knows nothing about Aftershock: it prints what torchft's
train_ddp.py prints (its loss line, and torchft's own log lines through Python's logging),
and Aftershock reads torchft's lines through the `torchft` preset.

    torchft_lighthouse --min_replicas 1 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 torchrun --nproc-per-node=1 train.py
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", 0))
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.1"))

logging.basicConfig(level=logging.INFO)  # as torchft's train_ddp.py: the Manager's lines


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{REPLICA_GROUP_ID}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    g = torch.Generator().manual_seed(REPLICA_GROUP_ID)
    while manager.current_step() < STEPS:
        x = torch.randn(32, 20, generator=g)
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()  # commits only if the quorum's allreduce succeeded
        print(f"[{manager.current_step()}] loss = {loss.item()}", flush=True)
        time.sleep(STEP_SLEEP)


if __name__ == "__main__":
    main()
