"""The rows of the benchmark: how to launch each system, and what it is.

Every row trains the same model (the reference trainer's ``ParallelMLP``, 2 data-parallel
replicas × 2 tensor-parallel shards = 4 ranks, Gloo on CPU) on the same data. A row is a list
of commands started together; to add a strategy, add a ``Peer``. ``python -m bench --gpu``
trains it as one rank (1 replica × 1 shard) with NCCL on one GPU instead (``GPU``): NCCL
refuses two ranks on one device, so a one-GPU machine runs only the rows one rank can.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPLICAS, SHARDS = 2, 2
WORLD = REPLICAS * SHARDS
CHECKPOINT_EVERY = 20  # steps between durable checkpoints for the restart-based rows
MAX_RESTARTS = 3


@dataclass(frozen=True, slots=True)
class Model:
    """The reference trainer's model flags and the layout it trains in, shared by every row."""

    d_model: int = 128
    hidden: int = 1024
    blocks: int = 2
    batch_size: int = 32
    replicas: int = REPLICAS
    shards: int = SHARDS
    backend: str = "gloo"  # nccl: every rank on its own GPU (cuda:LOCAL_RANK)

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    @property
    def kill_rank(self) -> int:
        """The rank a faulted job loses: the last (3: replica 1, shard 1, not rank 0, which
        hosts torchrun's store), or the only one."""
        return self.world - 1

    def describe(self) -> str:
        where = "NCCL on the GPU" if self.backend == "nccl" else "Gloo on CPU"
        return (f"reference ParallelMLP d_model={self.d_model} hidden={self.hidden} "
                f"blocks={self.blocks} ({self.parameters():,} parameters), batch "
                f"{self.batch_size} per replica, {self.replicas} replicas × {self.shards} "
                f"shards, {where}")

    def args(self) -> list[str]:
        return [
            f"--replicas={self.replicas}",
            f"--shards={self.shards}",
            f"--backend={self.backend}",
            f"--device={'cuda' if self.backend == 'nccl' else 'cpu'}",
            f"--d-model={self.d_model}",
            f"--hidden={self.hidden}",
            f"--blocks={self.blocks}",
            f"--batch-size={self.batch_size}",
        ]

    def parameters(self) -> int:
        per_block = 2 * self.d_model * self.hidden + self.hidden + self.d_model
        return self.blocks * per_block + 8 * self.d_model


@dataclass(frozen=True, slots=True)
class Context:
    """What a row's commands need to know about one job."""

    model: Model
    steps: int  # steps to run (a faulted job is stopped by the bench once it has recovered)
    workdir: Path  # fresh per job: checkpoints, logs
    lighthouse_port: int  # a free port, for rows that run a torchft lighthouse


@dataclass(frozen=True, slots=True)
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    name: str = "main"


@dataclass(frozen=True, slots=True)
class Peer:
    name: str
    group: str  # "baseline" (no fault tolerance), "ours", "peer"
    what: str  # one line for the table
    commands: Callable[[Context], list[Command]]
    fault: bool = True  # run the SIGKILL part (a system without fault tolerance cannot)
    requires: str | None = None  # a strategy the reference trainer must accept, else skipped
    default: bool = True  # part of a plain `make bench`; others run only when named in --only
    # A faulted job trains to a fixed step and its final parameters are checked. Not for
    # torchft: its survivors train on alone while the killed group restarts (~12 s), so
    # they would finish long before it is back; the bench stops those jobs once they are
    # at full strength again, and their parameters are not checked (torchft's own healing).
    fixed_end: bool = True
    # Runs as one NCCL rank on one GPU (`python -m bench --gpu`). A warm spare, a second
    # replica or a second torchft group would put a second rank on the same GPU, which NCCL
    # refuses ("Duplicate GPU detected"): those rows need a GPU per rank.
    one_rank: bool = False


def torchrun(nproc: int, max_restarts: int, module: str, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",  # torchrun's reaction to a dead worker is part of the cost
        "-m",
        module,
        *args,
    ]


GPU = Model(replicas=1, shards=1, backend="nccl")


def trainer(recovery: str, *, checkpoint_every: int, spares: int = 0,
            extra: tuple[str, ...] = ()) -> Callable[[Context], list[Command]]:
    def commands(ctx: Context) -> list[Command]:
        args = [
            *ctx.model.args(),
            f"--steps={ctx.steps}",
            f"--recovery={recovery}",
            f"--checkpoint-every={checkpoint_every}",
            f"--checkpoint-dir={ctx.workdir / 'checkpoints'}",
            *extra,
        ]
        nproc = ctx.model.world + spares
        return [Command(torchrun(nproc, MAX_RESTARTS, "aftershock.reference_impl.trainer", args))]

    return commands


def ddp(*, checkpoint_every: int) -> Callable[[Context], list[Command]]:
    def commands(ctx: Context) -> list[Command]:
        args = [*ctx.model.args(), f"--steps={ctx.steps}"]
        if checkpoint_every:
            args += [
                f"--checkpoint-every={checkpoint_every}",
                f"--checkpoint-dir={ctx.workdir / 'checkpoints'}",
            ]
        restarts = MAX_RESTARTS if checkpoint_every else 0
        return [Command(torchrun(ctx.model.world, restarts, "bench.ddp_train", args))]

    return commands


def torchft(*, heartbeat_timeout_ms: int | None, timeout_s: float | None
            ) -> Callable[[Context], list[Command]]:
    def commands(ctx: Context) -> list[Command]:
        port = ctx.lighthouse_port
        lighthouse = [
            str(Path(sys.executable).with_name("torchft_lighthouse")),
            "--min_replicas=1",
            f"--bind=127.0.0.1:{port}",
        ]
        if heartbeat_timeout_ms is not None:
            lighthouse.append(f"--heartbeat_timeout_ms={heartbeat_timeout_ms}")
        args = [*ctx.model.args(), f"--steps={ctx.steps}"]
        if timeout_s is not None:
            args.append(f"--timeout={timeout_s:g}")
        env = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        groups = [
            Command(
                torchrun(ctx.model.shards, MAX_RESTARTS, "bench.torchft_train", args),
                {**env, "REPLICA_GROUP_ID": str(g)},
                f"group{g}",
            )
            for g in range(ctx.model.replicas)
        ]
        return [Command(lighthouse, {}, "lighthouse"), *groups]

    return commands


PEERS: tuple[Peer, ...] = (
    Peer("ddp", "baseline", "torch DDP, no checkpoints, no restarts", ddp(checkpoint_every=0),
         fault=False, one_rank=True),
    Peer("trainer_no_ckpt", "baseline",
         "reference trainer, checkpoints off (its loop without fault-tolerance work)",
         trainer("restart", checkpoint_every=0), fault=False, one_rank=True),
    Peer("restart", "ours",
         f"reference trainer `restart`: torchrun --max-restarts, checkpoint every "
         f"{CHECKPOINT_EVERY}", trainer("restart", checkpoint_every=CHECKPOINT_EVERY),
         one_rank=True),
    # Snapshots only matter when every replica of a shard is lost at once (a replacement
    # otherwise copies a live peer, losing nothing), so the default row takes one every 10
    # steps; `hot_spare_1` (with --only) shows what a snapshot every step costs on 2 cores.
    Peer("hot_spare", "ours",
         "reference trainer `hot_spare`: 1 warm spare, peer snapshot every 10 steps",
         trainer("hot_spare", checkpoint_every=0, spares=1,
                 extra=("--spares=1", "--snapshot-every=10")), requires="hot_spare"),
    Peer("hot_spare_1", "ours",
         "reference trainer `hot_spare`: 1 warm spare, peer snapshot every step",
         trainer("hot_spare", checkpoint_every=0, spares=1,
                 extra=("--spares=1", "--snapshot-every=1")), requires="hot_spare",
         default=False),
    # Ablations (with --only), for the breakdown of hot_spare's failure-free overhead: the
    # same row without its snapshots, without its fingerprints, and without both.
    Peer("hot_spare_nosnap", "ours", "`hot_spare` without peer snapshots",
         trainer("hot_spare", checkpoint_every=0, spares=1,
                 extra=("--spares=1", "--snapshot-every=0")), requires="hot_spare",
         default=False),
    Peer("hot_spare_nofp", "ours", "`hot_spare` without fingerprints (snapshot every 10)",
         trainer("hot_spare", checkpoint_every=0, spares=1,
                 extra=("--spares=1", "--snapshot-every=10", "--fingerprint-every=0")),
         requires="hot_spare", default=False),
    Peer("hot_spare_bare", "ours", "`hot_spare` without snapshots or fingerprints",
         trainer("hot_spare", checkpoint_every=0, spares=1,
                 extra=("--spares=1", "--snapshot-every=0", "--fingerprint-every=0")),
         requires="hot_spare", default=False),
    # A returning replica heals from a live peer, so elastic needs snapshots no more often
    # than hot_spare does.
    Peer("elastic", "ours",
         "reference trainer `elastic`: per-step membership, peer snapshot every 10 steps",
         trainer("elastic", checkpoint_every=0, extra=("--snapshot-every=10",)),
         requires="elastic"),
    Peer("torchrun_ddp", "peer",
         f"torch DDP + torch.save every {CHECKPOINT_EVERY} steps, torchrun --max-restarts",
         ddp(checkpoint_every=CHECKPOINT_EVERY), one_rank=True),
    Peer("torchft", "peer", "torchft 0.2.0 defaults (5 s heartbeat timeout, 60 s timeout)",
         torchft(heartbeat_timeout_ms=None, timeout_s=None), fixed_end=False),
    Peer("torchft_1s", "peer", "torchft 0.2.0, 1 s heartbeat timeout, 1 s timeout",
         torchft(heartbeat_timeout_ms=1000, timeout_s=1.0), fixed_end=False),
)
