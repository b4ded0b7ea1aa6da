"""The reference fault-tolerant trainer: hybrid data × tensor parallel, restart recovery.

Launch with torchrun (all ranks on one host, Gloo on CPU)::

    python -m torch.distributed.run --standalone --nproc-per-node=4 --max-restarts=3 \\
        -m reference_impl.trainer --replicas 2 --shards 2 --steps 200 --checkpoint-every 20

Training is deterministic: data, initialisation and reduction order depend only on the seed
and the step, so a fault-free run is a golden trajectory and a run that was killed and resumed
from a checkpoint must end with bitwise identical parameters.

Recovery strategy ``restart`` (the only one in v0): every collective runs with a short
timeout; when one fails, the rank that noticed reports it, ends the local world and exits
non-zero, and torchrun restarts every rank, which resume from the newest checkpoint that all
ranks can verify.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import probe
from reference_impl import checkpoint
from reference_impl.model import Layout, ModelConfig, ParallelMLP, build_layout, param_digest
from reference_impl.model import synthetic_batch as make_batch

RECOVERY_STRATEGIES = ("restart", "hot_spare", "elastic")


@dataclass
class TrainConfig:
    # world: replicas × shards must equal WORLD_SIZE; rank = replica * shards + shard
    replicas: int = 0  # data-parallel replicas; 0 means WORLD_SIZE // shards
    shards: int = 2  # tensor-parallel shards per replica (consecutive ranks)
    # training
    steps: int = 200  # optimizer steps to reach (a resumed run counts the restored ones)
    seed: int = 0  # the only source of randomness: init, data, everything
    batch_size: int = 32  # examples per replica per step
    lr: float = 3e-3  # AdamW learning rate
    step_sleep: float = 0.0  # seconds to sleep after each step, so faults can land mid-run
    # model
    d_model: int = 64  # residual width
    hidden: int = 256  # full MLP width, split across shards
    blocks: int = 2  # residual MLP blocks
    # checkpoints
    checkpoint_every: int = 20  # save every N steps; 0 disables saving (loading still happens)
    checkpoint_dir: str = "checkpoints"  # shared by all ranks; step_NNNNNN/ folders inside
    keep_checkpoints: int = 3  # committed checkpoints to keep; older ones are deleted
    # failure handling
    collective_timeout: float = 10.0  # seconds before a stuck collective counts as a failure
    recovery: str = "restart"  # restart | hot_spare | elastic (see reference_impl.resilient)
    spares: int = 0  # hot_spare: warm standby processes; WORLD_SIZE = replicas × shards + spares
    snapshot_every: int = 1  # hot_spare/elastic: peer-memory snapshot interval; 0 disables
    fingerprint_every: int = 10  # cross-replica parameter fingerprint interval; 0 disables
    heartbeat_timeout: float = 0.0  # a silent member is fenced after this; 0: collective_timeout
    replay: str = ""  # elastic: membership.jsonl of an earlier run to replay deterministically
    debug_stale_snapshot: bool = False  # test hook: a replacement loads a one-step-old state
    # runtime
    backend: str = "gloo"  # torch.distributed backend: gloo (CPU) or nccl (CUDA)
    device: str = "cpu"  # cpu, or cuda (each rank uses cuda:LOCAL_RANK)
    out: str | None = None  # folder for final params; default $AFTERSHOCK_OUTPUT_DIR

    def model_config(self) -> ModelConfig:
        return ModelConfig(d_model=self.d_model, hidden=self.hidden, blocks=self.blocks)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this run (not steps or timing)."""
        keys = ("replicas", "shards", "seed", "batch_size", "lr", "d_model", "hidden", "blocks")
        return {key: getattr(self, key) for key in keys}


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Command line → TrainConfig: one ``--flag-name`` per field, typed by its default."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m reference_impl.trainer", description=__doc__)
    for name, default in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name == "out":
            parser.add_argument(flag, default=probe.output_dir(), metavar="DIR")
        elif name == "recovery":
            parser.add_argument(flag, default=default, choices=RECOVERY_STRATEGIES)
        elif name == "backend":
            parser.add_argument(flag, default=default, choices=("gloo", "nccl"))
        elif name == "device":
            parser.add_argument(flag, default=default, choices=("cpu", "cuda"))
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, default=default, type=type(default))
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    numbers = ("steps", "checkpoint_every", "step_sleep", "keep_checkpoints", "spares",
               "snapshot_every", "fingerprint_every", "heartbeat_timeout")
    for name in numbers:
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.collective_timeout <= 0 or cfg.shards < 1 or cfg.replicas < 0:
        parser.error("--collective-timeout and --shards must be positive, --replicas >= 0")
    return cfg


# ---------------------------------------------------------------------------------------------
# Failure handling


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (field 22 of /proc/PID/stat), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are plain.
    return stat.rsplit(")", 1)[-1].split()[19]


def _describe(exc: BaseException) -> tuple[str, str]:
    """(cause, first line of the error) for a failed collective."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else type(exc).__name__
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "collective_timeout", first
    return f"collective_error: {first}", first


def _end_local_world(peers: list[tuple[str, int, str | None]]) -> None:
    """SIGKILL every other rank of this run that lives on this host.

    torchrun stops a failed worker group with SIGTERM and waits 30 s before SIGKILL, and a
    frozen (SIGSTOPped) rank never acts on SIGTERM, so without this a hang would cost 30+ s
    before the restart. Ranks on other hosts are out of reach; there the agent's own timeout
    does this job. Every step is guarded: a peer may already be gone, or its pid reused.
    """
    host, me = socket.gethostname(), os.getpid()
    for peer_host, pid, started in peers:
        if peer_host != host or pid == me or _start_time(pid) != started:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _fail(exc: BaseException, peers: list[tuple[str, int, str | None]]) -> NoReturn:
    # Kill first, report second: a SIGKILL costs microseconds, and a peer that detects the
    # same failure at the same moment may kill this rank at any point from here on. Of the
    # ranks that kill each other this way, the last one alive always finishes its loop.
    _end_local_world(peers)
    cause, first = _describe(exc)
    probe.detected(cause=cause, error=first, kind=type(exc).__name__)
    print(f"[rank {os.environ.get('RANK')}] failure detected: {cause}", file=sys.stderr)
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    # os._exit, not sys.exit: interpreter shutdown would run process-group destructors that
    # may block on the very peers that just failed.
    os._exit(1)


def _on_sigterm(peers: list[tuple[str, int, str | None]], signum: int, frame: Any) -> None:
    """torchrun stops the surviving ranks with SIGTERM when one rank dies.

    The agent often notices a dead rank (~0.1 s) before a survivor's pending collective fails,
    so this handler is where most survivors learn of the failure: report it, end the local
    world (a frozen peer would hold the agent for its 30 s SIGKILL grace) and exit at once.
    Python runs the handler between bytecodes: at once while sleeping or computing, at the
    latest when a blocked collective returns, i.e. within `collective_timeout`.
    """
    _end_local_world(peers)
    probe.detected(cause="terminated: SIGTERM from the launcher", signal=signum)
    os._exit(128 + signum)


# ---------------------------------------------------------------------------------------------
# Training


def average_gradients(model: torch.nn.Module, loss: torch.Tensor, layout: Layout) -> float:
    """Average gradients over the DP group in one all_reduce; return the mean loss.

    One flat buffer means one collective per step. The loss rides along in the same buffer,
    so the reported loss is the global one at no extra cost. With two replicas the Gloo sum is
    a + b on every rank, which is bitwise deterministic.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    dist.all_reduce(flat, group=layout.dp_group)
    flat /= layout.replicas
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
    return float(flat[-1])


def train(cfg: TrainConfig, layout: Layout, world: int, device: torch.device) -> None:
    rank = layout.rank
    model = ParallelMLP(cfg.model_config(), layout, cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    ckpt_root = Path(cfg.checkpoint_dir)

    # Resume: the newest committed step that every rank can verify, else start fresh.
    step = 0
    loaded = checkpoint.load_latest(ckpt_root, cfg.fingerprint(), layout.world_group)
    if loaded is not None:
        step, path, state = loaded
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        assert state["data_step"] == step, "data position must match the restored step"
        probe.checkpoint_loaded(step, str(path))

    while step < cfg.steps:
        # Every batch is a function of (seed, step, replica); `step` is the data position.
        x, y = make_batch(cfg.model_config(), cfg.seed, step, layout.replica, cfg.batch_size)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        global_loss = average_gradients(model, loss, layout)
        optimizer.step()
        step += 1  # `step` optimizer steps are now applied on this rank
        probe.step(step, world=world, loss=global_loss)

        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "data_step": step,
                "rng": {"torch": torch.get_rng_state()},
            }
            path = checkpoint.save(ckpt_root, step, state, cfg.fingerprint(), layout.world_group)
            if rank == 0:
                probe.checkpoint_saved(step, str(path))
                checkpoint.prune(ckpt_root, cfg.keep_checkpoints, step)
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)

    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    probe.params(param_digest(final), step=step)
    if cfg.out:
        out = Path(cfg.out) / "final"
        out.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(final, buffer)
        checkpoint.write_atomic(out / f"rank_{rank}.pt", buffer.getvalue())


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.recovery != "restart":
        # Warm processes, in-memory state and in-place regrouping: a different runtime.
        from reference_impl import resilient

        return resilient.main(cfg)
    # Until the groups are up, keep Python's default SIGTERM action: it kills the process at
    # once, even inside a blocking C++ rendezvous that may wait for a long time.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.replicas == 0:  # derive it from the world
        if world % cfg.shards:
            print(
                f"error: WORLD_SIZE {world} is not a multiple of --shards {cfg.shards}",
                file=sys.stderr,
            )
            return 2
        cfg.replicas = world // cfg.shards
    if cfg.replicas * cfg.shards != world:
        print(
            f"error: --replicas {cfg.replicas} × --shards {cfg.shards} = "
            f"{cfg.replicas * cfg.shards}, but WORLD_SIZE is {world} "
            "(set --nproc-per-node to replicas × shards)",
            file=sys.stderr,
        )
        return 2

    # One thread per rank: ranks already share the cores, and a fixed thread count keeps
    # CPU kernels' reduction order (hence the bits) the same on every run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if cfg.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # The default group gets a generous timeout: it covers rendezvous, where ranks that are
    # still importing torch on a busy host may lag by seconds. Every collective of the
    # training loop runs on groups created with the short `collective_timeout`.
    dist.init_process_group(
        cfg.backend, timeout=timedelta(seconds=max(60.0, cfg.collective_timeout))
    )
    timeout = timedelta(seconds=cfg.collective_timeout)
    peers: list[tuple[str, int, str | None]] = []
    try:
        layout = build_layout(cfg.replicas, cfg.shards, timeout)
        probe.hello(
            world=world,
            generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            replica=layout.replica,
            shard=layout.shard,
        )
        # Who is who, so that a rank that sees a failure can end the whole local world.
        gathered: list[Any] = [None] * world
        me = (socket.gethostname(), os.getpid(), _start_time(os.getpid()))
        dist.all_gather_object(gathered, me, group=layout.world_group)
        peers = [tuple(p) for p in gathered]
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, peers))
        train(cfg, layout, world, device)
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, Gloo errors
        _fail(exc, peers)

    probe.emit("exit", code=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
