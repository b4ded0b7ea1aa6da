"""Data-parallel training with torchrun that snapshots and resumes.

Written the way PyTorch's own DDP examples are: a ``Trainer`` that owns the model, saves a
snapshot every ``save_every`` epochs and, when torchrun restarts the workers after a
failure, resumes from the last snapshot. It knows nothing about Aftershock: the scenarios
beside it read its log lines.

    torchrun --nproc-per-node=2 train.py 40 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed random regression problem: the same for every rank and every restart."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 20, generator=g)
        self.y = self.x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def ddp_setup(timeout_s: float) -> None:
    # A short collective timeout: a rank that stops answering (frozen, partitioned) makes
    # the others fail, and torchrun then restarts the group from the last snapshot.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class Trainer:
    def __init__(self, model: torch.nn.Module,
                 train_data: DataLoader[tuple[torch.Tensor, torch.Tensor]],
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str,
                 epoch_sleep: float) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epoch_sleep = epoch_sleep
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[GPU{self.rank}] Resuming training from snapshot at Epoch {self.epochs_run}",
              flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epoch}
        # Whole or not at all: a rank killed while saving leaves the previous snapshot.
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> float:
        assert isinstance(self.train_data.sampler, DistributedSampler)
        self.train_data.sampler.set_epoch(epoch)
        loss = 0.0
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
        return loss

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            # One line per finished epoch, with the moment it finished (CLOCK_MONOTONIC):
            # what a log probe reads as a committed step.
            print(f"[GPU{self.rank}] Epoch {epoch + 1} | loss {loss:.5f} | "
                  f"t={time.monotonic():.6f}", flush=True)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)
            time.sleep(self.epoch_sleep)

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.module.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def load_train_objs(seed: int) -> tuple[Dataset[tuple[torch.Tensor, torch.Tensor]],
                                         torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    train_set = RandomRegression(256, seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def main(args: argparse.Namespace) -> None:
    ddp_setup(args.timeout_s)
    dataset, model, optimizer = load_train_objs(args.seed)
    train_data = DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                            sampler=DistributedSampler(dataset, seed=args.seed))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path,
                      args.epoch_sleep)
    trainer.train(args.total_epochs)
    print(f"[GPU{trainer.rank}] params sha256={trainer.digest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="distributed training job")
    parser.add_argument("total_epochs", type=int, help="total epochs to train the model")
    parser.add_argument("save_every", type=int, help="how often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="input batch size per rank")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--timeout_s", default=30.0, type=float,
                        help="how long a collective waits for a silent rank")
    parser.add_argument("--epoch_sleep", default=0.0, type=float,
                        help="pause after each epoch (slows a tiny job to a watchable pace)")
    main(parser.parse_args())
