"""The reference fault-tolerant trainer: hybrid data × tensor parallel, restart recovery.

Launch with torchrun (all ranks on one host, Gloo on CPU)::

    python -m torch.distributed.run --standalone --nproc-per-node=4 --max-restarts=3 \\
        -m aftershock.reference_impl.trainer --replicas 2 --shards 2 --steps 200 --checkpoint-every
        20

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
import dataclasses
import functools
import io
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aftershock.faults import process_start_time
from aftershock.harness import probe
from aftershock.reference_impl import _forked, _memory, checkpoint, health
from aftershock.reference_impl import model as model_lib
from aftershock.reference_impl._star import Star
from aftershock.reference_impl.model import (
    GradBuffer,
    Layout,
    ModelConfig,
    ParallelMLP,
    build_layout,
    param_digest,
)
from aftershock.reference_impl.model import synthetic_batch as make_batch
from aftershock.reference_impl.phases import Laps

RECOVERY_STRATEGIES = ("restart", "hot_spare", "elastic")
STRAGGLER_EVERY = 10  # steps between comparisons of the ranks' compute times
STRAGGLER_RATIO = 2.0  # a rank whose compute time exceeds this × the median is a straggler
NON_FINITE_RETRIES = 3  # the same step non-finite this often in a row: restart from a checkpoint


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
    # hot_spare: the slot (torchrun RANK) of the first spare, the spares taking consecutive
    # slots and the ranks the others in order; -1: after every rank (the last slots). Across
    # nodes it keeps the spares on node 0, whose slots come first (docs/nodes.md).
    first_spare: int = -1
    snapshot_every: int = 1  # hot_spare/elastic: peer-memory snapshot interval; 0 disables
    fingerprint_every: int = 10  # cross-replica parameter fingerprint interval; 0 disables
    heartbeat_timeout: float = 0.0  # a silent member is fenced after this; 0: collective_timeout
    replay: str = ""  # elastic: membership.jsonl of an earlier run to replay deterministically
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
    parser = argparse.ArgumentParser(prog="python -m aftershock.reference_impl.trainer",
                                     description=__doc__)
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
    numbers = (
        "steps",
        "checkpoint_every",
        "step_sleep",
        "keep_checkpoints",
        "spares",
        "snapshot_every",
        "fingerprint_every",
        "heartbeat_timeout",
    )
    for name in numbers:
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.first_spare < -1:
        parser.error(f"--first-spare must be >= 0 (-1: after every rank), got {cfg.first_spare}")
    if cfg.collective_timeout <= 0 or cfg.shards < 1 or cfg.replicas < 0:
        parser.error("--collective-timeout and --shards must be positive, --replicas >= 0")
    return cfg


# ---------------------------------------------------------------------------------------------
# Failure handling


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (field 22 of /proc/PID/stat), to tell a reused pid apart."""
    started = process_start_time(pid)
    return None if started is None else str(started)


class XidFailure(RuntimeError):
    """This rank's GPU reported an Xid whose recommended action is more than logging it."""

    def __init__(self, code: int, action: str) -> None:
        super().__init__(f"Xid {code} on this rank's GPU: recommended action {action}")
        self.code, self.action = code, action


class XidMonitor:
    """Receives Xids from the watcher thread; the training loop polls it once a step.

    The watcher must not act on the main thread's state itself (it could interrupt a
    collective half way), so it only records the first fatal Xid; the loop raises it at a
    step boundary, where a failure is handled like any other (end the world, restart).
    """

    def __init__(self) -> None:
        self.fatal: tuple[int, str] | None = None
        self._lock = threading.Lock()

    def on_xid(self, code: int, action: str) -> None:
        probe.emit("xid_action", code=code, action=action)
        print(f"[rank {os.environ.get('RANK')}] Xid {code}: action {action}", file=sys.stderr)
        if action != "none":
            with self._lock:
                if self.fatal is None:
                    self.fatal = (code, action)

    def check(self) -> None:
        if self.fatal is not None:
            raise XidFailure(*self.fatal)


def start_xid_watcher() -> XidMonitor:
    """Watch this rank's GPU (LOCAL_RANK) for Xids, real NVML or simulated."""
    monitor = XidMonitor()
    health.XidWatcher(gpu=int(os.environ.get("LOCAL_RANK", "0")), on_xid=monitor.on_xid).start()
    return monitor


def _describe(exc: BaseException) -> tuple[str, str]:
    """(cause, first line of the error) for a failed collective."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else type(exc).__name__
    if isinstance(exc, XidFailure):
        return f"xid_{exc.code}", first
    if isinstance(exc, NonFiniteFailure):
        return "non_finite", first
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


class NonFiniteFailure(RuntimeError):
    """The gradients of one step stayed non-finite after retries: the state itself is bad."""


# ---------------------------------------------------------------------------------------------
# Training


def average_gradients(
    model: torch.nn.Module,
    loss: torch.Tensor,
    layout: Layout,
    buffer: GradBuffer,
    flags: torch.Tensor,
    late: bool = False,
) -> tuple[float, bool]:
    """Average gradients over the DP group in one all_reduce; return (the mean loss, whether
    this rank's averaged gradients are all finite). On the way, start the vote (``vote``):
    ``flags[0]`` says whether this rank's own gradients are finite, sent before the average;
    ``late``: whether its average is, sent after it.

    One flat buffer means one collective per step. The loss rides along in the same buffer,
    so the reported loss is the global one at no extra cost. With two replicas the Gloo sum is
    a + b on every rank, which is bitwise deterministic. Afterwards each gradient is a view of
    its slice of the buffer (DDP's ``gradient_as_bucket_view``): the same values as a copy
    back, without the copy; ``zero_grad(set_to_none=True)`` drops the views before the next
    backward, and the next step reuses the buffer (``GradBuffer``). One finiteness check over
    the whole buffer replaces one per parameter.
    """
    pairs = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    flat = buffer.flatten([g for _, g in pairs] + [loss.detach().reshape(1)])
    if not late:
        flags[0] = 0.0 if model_lib.all_finite(flat[:-1]) else 1.0
        layout.star.start_sum(flags)
    dist.all_reduce(flat, group=layout.dp_group)
    flat /= layout.replicas
    finite = model_lib.all_finite(flat[:-1])
    if late:
        flags[0] = 0.0 if finite else 1.0
        layout.star.start_sum(flags)
    offset = 0
    for p, grad in pairs:
        n = grad.numel()
        p.grad = flat[offset : offset + n].view_as(p)
        offset += n
    return float(flat[-1]), finite


def vote(flags: torch.Tensor, finite: bool, layout: Layout) -> tuple[bool, list[int]]:
    """Finish the vote ``average_gradients`` started: (whether every rank's own gradients
    were finite, the ranks that wait for a repair). ``finite``: this rank's average.

    Ranks of one shard share their averaged gradients, but the shards do not, so a NaN in
    one shard's gradients would make only that shard skip the step: every rank must take
    the same decision. Each rank sends whether its own gradients are finite (``flags[0]``)
    to rank 0 over the world's star (``aftershock.reference_impl._star``: its own connections, read
    by
    this thread) before the gradient all_reduce, and reads the total after it, so the vote
    waits for the slowest rank's backward, not for its all_reduce. A NaN in any rank's
    gradients reaches every rank's total: nobody applies the step.

    What that does not see is a collective that corrupts its result on one rank alone
    (``collective.corrupt``), after every rank's own gradients were finite: that rank alone
    finds its average not finite. It skips the step, its peers apply it, and at the next
    step it asks for a repair (``flags[1 + rank]``): every rank reads who waits, nobody
    applies that step (the world computed it one step apart), and each waiting rank gets
    the state of a peer of its shard that applied the step (``repair``).

    A *late* vote is sent after the average and carries this rank's average instead, so a
    corrupted average makes every rank skip the step. The loop votes late where a rank may
    not fall behind: with one replica (no peer holds its state), before a checkpoint (every
    rank saves its own state) and at the last step.
    """
    layout.star.finish_sum(flags)
    waiting = [rank for rank, wait in enumerate(flags[1:].tolist()) if wait]
    return flags[0].item() == 0, waiting


def repair(
    waiting: list[int],
    layout: Layout,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    last: dict[str, Any],
) -> dict[str, Any] | None:
    """Give each rank in ``waiting`` the state of the first rank of its shard that is not
    waiting: the parameters, the optimizer's state, and ``last`` (the step and its loss, for
    its step event). Every rank calls it with the same ``waiting``; only the DP groups with
    a waiting member exchange anything. Returns what this rank received, or None.

    A shard whose every replica waits has no good copy left: NonFiniteFailure, on every
    rank (a restart from the newest checkpoint).
    """
    shards, replicas = layout.shards, layout.replicas
    for shard in sorted({rank % shards for rank in waiting}):
        members = [shard + k * shards for k in range(replicas)]
        if all(member in waiting for member in members):
            raise NonFiniteFailure(
                f"every replica of shard {shard} lost its average of step {last['step'] + 1}: "
                "no peer holds the step"
            )
    members = [layout.shard + k * shards for k in range(replicas)]
    if not any(member in waiting for member in members):
        return None
    source = next(member for member in members if member not in waiting)
    payload: list[Any] = [None]
    if layout.rank == source:
        payload[0] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "source": source,
            **last,
        }
    dist.broadcast_object_list(payload, src=source, group=layout.dp_group)
    if layout.rank not in waiting:
        return None
    state = payload[0]
    model.load_state_dict(state["model"])  # copies into the parameters where they are
    optimizer.load_state_dict(state["optimizer"])
    return state


# A straggler must cost the job, not merely jitter: besides STRAGGLER_RATIO × the median, a
# rank is named only when its busy time exceeds the median's by this share of the window,
# over a window of at least STRAGGLER_WINDOW_S. Measured with every thread's CPU time and
# wait (_busy_seconds) on a 2-core host running 0 to 8 spinning processes besides the 4 ranks
# (load average 3 to 9, docs/trainer.md): a rank held to a twentieth of a CPU exceeded the
# median by 2.6 to 4.5 windows in each of 29 throttled windows (its threads wait for a CPU
# side by side); 263 unthrottled rank-windows by at most 0.18. Counting the training thread
# alone, the throttled rank exceeded it by only 0.28 to 0.68 (its Gloo threads lost the
# time, while it slept in the collective), and CI's run once named nobody.
STRAGGLER_SHARE = 0.5
STRAGGLER_WINDOW_S = 1.0
# Rank 0's view of the previous window: its clock, and every rank's cumulative busy and
# compute seconds. Per process, so a restarted world starts afresh (its first call only
# takes the baseline: start-up is nobody's straggling).
_straggler_window: list[tuple[float, list[float], list[float]]] = []
_compute_total = [0.0]  # this rank's compute seconds since it started
_busy_total = [0.0]  # this rank's busy seconds (_busy_seconds) since its first call
_thread_busy: dict[str, float] = {}  # each thread's busy seconds at the last call
# Rank 0's own figures at the last comparison, its step and its clock, until the others' are
# read at the next vote (``collect_stragglers``).
_figures_due: list[tuple[torch.Tensor, int, float]] = []


def _busy_seconds() -> float | None:
    """CPU time of every thread of this process plus the time each waited for a CPU while
    ready to run (``/proc/self/task/*/schedstat``), cumulative; None where the kernel does
    not say.

    Waiting for a CPU is where a throttled (CFS quota) or oversubscribed rank loses its
    time, wherever in the step it falls, and in whichever thread: the training thread
    sleeps in a collective while Gloo's threads move the data, and a throttled rank loses
    its time there. The peers that wait for it in collectives are asleep meanwhile, which
    counts as neither. A thread that ended since the last call takes its time since then
    with it (its figures are gone); what it had counted before stays counted.
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    seen: dict[str, float] = {}
    for tid in tids:
        try:  # os.open/os.read: a third of open()'s cost, ~15 threads every 10 steps
            fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            try:
                on_cpu, waiting, _ = os.read(fd, 128).split()
            finally:
                os.close(fd)
        except (OSError, ValueError):
            continue  # ended meanwhile, or a kernel without schedstats
        seen[tid] = (int(on_cpu) + int(waiting)) / 1e9
    if not seen:
        return None
    before = _thread_busy
    # A reused thread id whose figures went down is a new thread: all of its time counts.
    _busy_total[0] += sum(
        now - before.get(tid, 0.0) if now >= before.get(tid, 0.0) else now
        for tid, now in seen.items()
    )
    _thread_busy.clear()
    _thread_busy.update(seen)
    return _busy_total[0]


def report_stragglers(compute_s: float, layout: Layout, step: int) -> None:
    """Compare how long each rank was busy with its own work since the last comparison;
    rank 0 names a straggler.

    A rank's busy time is the larger of two measures: its threads' CPU time plus their wait
    for a CPU (``_busy_seconds``; catches a rank starved of CPU wherever in the step and in
    whichever thread it happens), and
    its compute time, forward+backward wall time minus the model's collectives (catches a
    rank stopped outright while computing, e.g. by SIGSTOP, which schedstat does not
    count). A straggler's peers wait for it inside collectives, asleep, so neither measure
    grows for them. Every rank calls this at the same steps, right after that step's vote:
    the others send their two figures to rank 0 over the world's star, after their vote's
    message on the same connection, and go on. Rank 0 keeps its own figures and reads the
    others' at its next vote (``collect_stragglers``), a step later, when they have arrived:
    read right away, rank 0 waited for every other rank to get a core after the vote, ~2.6 ms
    per comparison with 4 ranks on 2 cores (docs/benchmarks.md). (Over Gloo's point-to-point
    calls it cost ~0.05 ms of CPU per call, where the all_gather before it cost ~3 ms of wall
    time and ~4.5 ms of CPU, every 10 steps.)
    """
    _compute_total[0] += compute_s
    busy = _busy_seconds()
    star = layout.star
    mine = torch.tensor([-1.0 if busy is None else busy, _compute_total[0]], dtype=torch.float64)
    if star.rank != 0:
        star.send(mine, 0)
        return
    _figures_due.append((mine, step, time.monotonic()))


def collect_stragglers(layout: Layout) -> None:
    """Rank 0: read the figures the other ranks sent at the last comparison
    (``report_stragglers``) and name any straggler among them. The loop calls it before each
    vote, whose messages follow the figures on the same connections, and once after its last
    step; elsewhere, and with no comparison due, it does nothing."""
    if not _figures_due:
        return
    mine, step, now = _figures_due.pop()
    star = layout.star
    totals = [mine] + [torch.zeros(2, dtype=torch.float64) for _ in range(1, star.size)]
    for peer in range(1, star.size):
        star.recv(totals[peer], peer)
    busy_totals = [float(t[0]) for t in totals]
    compute_totals = [float(t[1]) for t in totals]
    if not _straggler_window:
        _straggler_window.append((now, busy_totals, compute_totals))
        return
    since, busy_before, compute_before = _straggler_window[0]
    window = now - since
    if window < STRAGGLER_WINDOW_S:
        return  # too short to tell a straggler from scheduling noise: keep accumulating
    _straggler_window[0] = (now, busy_totals, compute_totals)
    values = [
        max(compute - compute_was, busy - busy_was if busy >= 0 and busy_was >= 0 else 0.0)
        for busy, busy_was, compute, compute_was in zip(
            busy_totals, busy_before, compute_totals, compute_before, strict=True
        )
    ]
    for rank, ratio in stragglers(values, window):
        probe.emit(
            "straggler_detected",
            slow_rank=rank,
            ratio=round(ratio, 2),
            step=step,
            busy_s=round(values[rank], 4),
            median_s=round(statistics.median(values), 4),
            window_s=round(window, 3),
        )


def stragglers(values: list[float], window: float | None = None) -> list[tuple[int, float]]:
    """(rank, times the median) of every rank slower than STRAGGLER_RATIO × the median and,
    given the window's wall time, busier than the median by STRAGGLER_SHARE of it."""
    median = statistics.median(values)
    if median <= 0:
        return []
    floor = 0.0 if window is None else STRAGGLER_SHARE * window
    return [
        (rank, value / median)
        for rank, value in enumerate(values)
        if value > STRAGGLER_RATIO * median and value - median > floor
    ]


def train(
    cfg: TrainConfig,
    layout: Layout,
    world: int,
    device: torch.device,
    xid: XidMonitor | None = None,
) -> None:
    rank = layout.rank
    model = ParallelMLP(cfg.model_config(), layout, cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Opt in to Aftershock's in-process faults (a no-op outside the harness).
    probe.install(model=model, optimizer=optimizer)
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

    compute_s = 0.0  # this rank's compute time in the current straggler window
    non_finite = 0  # consecutive non-finite attempts at the current step
    behind = False  # this rank skipped the last step alone and waits for a repair (``vote``)
    last: dict[str, Any] = {"step": step, "loss": None}  # the newest applied step and its loss
    grads = GradBuffer()  # the flat gradient buffer, reused every step
    laps = Laps()  # where each step's time goes, when AFTERSHOCK_PHASES asks (make bench)
    while step < cfg.steps:
        if xid is not None:
            xid.check()
        current = step + 1  # the step being computed, 1-based, as probe.step will report it
        # Every batch is a function of (seed, step, replica); `step` is the data position.
        x, y = make_batch(cfg.model_config(), cfg.seed, step, layout.replica, cfg.batch_size)
        laps.lap("batch")
        started, comm = time.perf_counter(), model_lib.comm_seconds[0]
        probe.fault_point("forward", current)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        laps.lap("forward")
        optimizer.zero_grad(set_to_none=True)
        laps.lap("zero_grad")
        loss.backward()
        compute_s += (time.perf_counter() - started) - (model_lib.comm_seconds[0] - comm)
        probe.fault_point("backward", current)
        laps.lap("backward")
        flags = torch.zeros(1 + world, dtype=torch.float64)
        flags[1 + rank] = 1.0 if behind else 0.0
        late = (
            layout.replicas == 1
            or current == cfg.steps
            or bool(cfg.checkpoint_every and current % cfg.checkpoint_every == 0)
        )
        global_loss, mine = average_gradients(model, loss, layout, grads, flags, late)
        laps.lap("average")
        collect_stragglers(layout)  # the last comparison's figures come before this vote
        laps.lap("straggler figures")
        everyone, waiting = vote(flags, mine, layout)
        laps.lap("vote")
        if waiting:
            # Some rank skipped the last step alone: this step was computed by a world one
            # step apart, so nobody applies it. The waiting ranks take a peer's state, then
            # every rank computes this step again.
            repaired = repair(waiting, layout, model, optimizer, last)
            if repaired is not None:
                behind = False
                step = repaired["step"]
                probe.emit("state_repaired", step=step, source=repaired["source"])
                probe.step(step, world=world, loss=repaired["loss"])
            continue
        if not everyone:
            # Never apply a poisoned update. The step's data is a function of the step, so
            # computing it again from the same state gives the fault-free update, unless the
            # state itself is poisoned: then only an older checkpoint helps.
            non_finite += 1
            if not mine:
                probe.detected(cause="non_finite", step=current, attempt=non_finite)
            if non_finite >= NON_FINITE_RETRIES:
                raise NonFiniteFailure(
                    f"gradients of step {current} non-finite {non_finite} times in a row"
                )
            continue
        non_finite = 0
        if not mine:
            # Every rank's own gradients were finite, but this rank's average is not: the
            # all_reduce's result was corrupted here alone. The others apply the step; this
            # rank skips it and takes their state at the next step (``vote``).
            probe.detected(cause="non_finite", step=current, attempt=1)
            behind = True
            if current % STRAGGLER_EVERY == 0:  # the others send theirs now: so does this rank
                report_stragglers(compute_s, layout, current)
                compute_s = 0.0
            continue
        probe.fault_point("optimizer", current)
        optimizer.step()
        laps.lap("optimizer")
        step += 1  # `step` optimizer steps are now applied on this rank
        last = {"step": step, "loss": global_loss}
        probe.step(step, world=world, loss=global_loss)

        if step % STRAGGLER_EVERY == 0:
            laps.lap("rest")
            report_stragglers(compute_s, layout, step)
            compute_s = 0.0
            laps.lap("straggler figures")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            laps.lap("rest")
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "data_step": step,
                "rng": {"torch": torch.get_rng_state()},
            }
            if rank == 0:
                probe.emit("checkpoint_started", step=step)
            # A failed save (e.g. ENOSPC) is reported inside and costs only this checkpoint.
            saved = checkpoint.save(ckpt_root, step, state, cfg.fingerprint(), layout.world_group)
            if rank == 0 and saved is not None:
                probe.checkpoint_saved(step, str(saved))
                checkpoint.prune(ckpt_root, cfg.keep_checkpoints, step)
            laps.lap("checkpoint")
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
        laps.step_done(step)

    collect_stragglers(layout)  # the last step's comparison, if it was one
    probe.fault_point("finish", step)
    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    probe.params(param_digest(final), step=step)
    if cfg.out:
        out = Path(cfg.out) / "final"
        out.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(final, buffer)
        checkpoint.write_atomic(out / f"rank_{rank}.pt", buffer.getvalue())


def report_restart() -> None:
    """A world that torchrun restarted says so: the previous world failed. Usually a
    survivor reported that failure already; when every rank died at once, nobody did, and
    without this the failure was never acknowledged at all (found by `aftershock explore`:
    scenarios/explore/found/kill_every_rank_restart.yaml). Rank 0 says it, once per world."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts and os.environ.get("RANK") == "0":
        probe.detected(cause="restarted: the launcher replaced a failed world", restart=restarts)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # Every step frees and allocates the same megabytes again: autograd's fresh gradients,
    # freed once copied into the flat buffer, and the optimizer's temporaries. glibc's malloc
    # gave that memory back to the kernel at each free, and the next allocation faulted it
    # in again: with 2.1 M parameters (4 ranks), ~400 faults per step in each rank's main
    # thread, the loop's CPU over DDP's in `backward` and `optimizer` (docs/benchmarks.md,
    # "Page faults every step"). The process keeps what it freed instead, as PyTorch's
    # caching allocator does on GPUs; its forks (resilient's spares, standbys) inherit it.
    _memory.keep_freed()
    if cfg.recovery != "restart":
        # Warm processes, in-memory state and in-place regrouping: a different runtime.
        from aftershock.reference_impl import resilient

        _exit_now(resilient.main(cfg))
    # Until the groups are up, keep Python's default SIGTERM action: it kills the process at
    # once, even inside a blocking C++ rendezvous that may wait for a long time.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    report_restart()

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
    # Also imports torch._dynamo (~2 s of CPU per rank), which torch.optim needs anyway:
    # better paid here, before rendezvous, than inside the first step, where a rank that
    # is still importing stalls collectives that run on the short timeout.
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
        # Who is who, so that a rank that sees a failure can end the whole local world; and
        # each launcher's restart count, which torchrun keeps per node: a node that was
        # restarted counts from 0 again while the survivors' agents count on. The world's
        # generation is the newest any rank was told, so that every rank names the same one.
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        gathered: list[Any] = [None] * world
        me = (socket.gethostname(), os.getpid(), _start_time(os.getpid()), restarts)
        dist.all_gather_object(gathered, me, group=layout.world_group)
        peers = [tuple(p[:3]) for p in gathered]
        generation = max(int(p[3]) for p in gathered)
        # The vote's connections, met through the job's store under the world's generation:
        # a store that outlives a world must not hand the next one the last world's address.
        star = Star.connect(
            dist.distributed_c10d._get_default_store(),
            layout.rank,
            world,
            cfg.collective_timeout,
            key=f"aftershock/vote/{generation}",
        )
        layout = dataclasses.replace(layout, star=star)
        probe.hello(
            world=world,
            generation=generation,
            replica=layout.replica,
            shard=layout.shard,
        )
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, peers))
        train(cfg, layout, world, device, start_xid_watcher())
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, Gloo errors
        _fail(exc, peers)

    probe.emit("exit", code=0)
    probe.fault_point("exit", cfg.steps)
    dist.destroy_process_group()
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Exit without interpreter shutdown. Everything a rank owes is on disk by now
    (checkpoints and final state are written atomically and fsynced, events are appended
    unbuffered), and shutting down an interpreter with torch loaded costs ~2 s per rank on a
    busy host, which torchrun waits for before it exits or restarts."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _forked.forked():  # forked by the warm launcher: end through torchrun's worker
        raise _forked.Exit(code)
    os._exit(code)


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy of it: one copy of every
    # function and class, so whatever wraps or patches reference_impl.trainer (a profiler,
    # a test's deliberately broken variant) sees the code that actually runs.
    from aftershock.reference_impl import trainer

    sys.exit(trainer.main())
