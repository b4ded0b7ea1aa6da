"""Recovery without restarting survivors: ``hot_spare`` and ``elastic`` for the reference trainer.

Process shape (one torchrun worker per *slot*; torchrun only launches, it never sees a death)::

    torchrun worker (slot k) = supervisor ──fork──► worker process (the training rank or a spare)
                                         └─(slot 0 only) fork──► controller (hosts the store)

- The **supervisor** imports torch once and forks the worker, so a killed worker is re-forked
  warm (no 1 s ``import torch``): in ``hot_spare`` the new process becomes a spare, in
  ``elastic`` it is the returning replica. Once a worker has lived a second, the supervisor
  also forks its successor ahead of need (the *standby*), which connects to the store and
  waits: a death wakes it, it reports the death to the controller at once, and becomes the
  slot's next worker. The supervisor's own exit status is what torchrun sees: torchrun's
  agent would otherwise answer any death by tearing down and restarting the whole group,
  which is exactly what we avoid.
- The **controller** (``aftershock.reference_impl.controller``) hosts the TCPStore (so no rank's
death
  takes the store with it), watches deaths, heartbeats and failed collectives, and publishes
  numbered membership plans.
- A **worker** joins a plan by building fresh ``ProcessGroupGloo``s over a ``PrefixStore``
  named ``gen{g}/...``, and the vote's star (``aftershock.reference_impl._star``); on any failure it
  destroys its groups and closes its star (which makes its peers' pending collectives and
  votes fail at once instead of at their timeout) and waits for the next plan.

Commit protocol. Every step ends with a tiny sum over the world (the *vote*, through the
world's rank 0, over the star's own connections) after the data-parallel gradient
all_reduce: it carries "gradients not
finite", "fingerprints differed" and "a new plan is waiting", and after a fingerprint step
every rank's fingerprint of that step's state. The optimizer step is applied, and
the step reported, only after the vote completed. A completed vote on any rank proves every
rank holds the averaged gradients (rank 0 heard from all, the others from rank 0 after that),
so after a failure a rank whose vote failed can still apply them (roll forward) and no
reported step is ever lost. State for a replacement comes from a live data-parallel peer (all
replicas of a shard are bitwise identical); if every replica of a shard is gone, from the
peer-memory snapshots that one replica per shard sends off the critical path (a background
thread) into the controller's memory.

Faults come from outside (the harness's chaos engine) or through the probe's fault points
(``aftershock.harness.probe.fault_point``); deliberately broken variants of this trainer live in
the tests
(tests/broken/sitecustomize.py), never here.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aftershock.harness import probe
from aftershock.reference_impl import _leave, _memory, _snapshots, _store, checkpoint, controller
from aftershock.reference_impl._star import Star
from aftershock.reference_impl.model import (
    GradBuffer,
    Layout,
    ParallelBlock,
    ParallelMLP,
    all_finite,
    param_digest,
    shard_numels,
    synthetic_batch,
)
from aftershock.reference_impl.phases import Laps


class Superseded(Exception):
    """A newer plan was published before this one started: skip to it."""


class Switch(Exception):
    """All members agreed (through the vote) to move to the next plan after this step."""


@dataclass(frozen=True, slots=True)
class Groups:
    gen: int
    rank: int  # logical training rank
    members: list[int]  # logical ranks of the plan, sorted
    replicas: list[int]  # live data-parallel replicas
    world: Any
    tp: Any
    dp: Any
    dp_ranks: list[int]
    star: Star  # the vote's connections (world ranks, as ``world``'s)


@dataclass(frozen=True, slots=True)
class Held:
    """The state a member brings to a sync, as it told the others."""

    gen: int  # its lineage: the generation that last trained it (or, for a state received in
    #           a sync, the source's); -1: never trained or received (the seeded init)
    steps: int  # optimizer steps applied to it
    pending: int  # generation in which the next step's gradients were averaged and the vote
    #               did not finish here; -1: none


def ready_at(held: dict[int, Held], fresh_is_step_0: bool) -> tuple[int, set[int]]:
    """(the step to resume from, the members that hold it or can roll forward to it).

    The newest lineage wins: a replica that was dropped holds an older one (the survivors
    went on with other math) and never counts, whatever its step. Within it the most
    advanced state wins, and a member that averaged that step's gradients in the same
    generation but lost the vote may apply them: someone completed the vote, so every member
    contributed to it. A never-trained member's seeded init counts as step 0 only while
    ``fresh_is_step_0`` (nothing was ever committed). Nobody holding anything: (0, empty), and
    the caller goes to the snapshots.
    """
    usable = {r: h for r, h in held.items() if h.gen >= 0 or fresh_is_step_0}
    if not usable:
        return 0, set()
    newest = max(h.gen for h in usable.values())
    top = max(h.steps for h in usable.values() if h.gen == newest)
    ready = {r for r, h in usable.items()
             if (h.gen == newest and h.steps == top)
             or (h.pending == newest and h.steps == top - 1)}
    return top, ready


def encode_vote(flags: tuple[bool, bool, bool], world: int) -> torch.Tensor:
    """This rank's part of the vote: its three flags as digits of base ``world + 1`` in one
    float64, which a SUM over the world adds up exactly (up to ~200,000 ranks: (world + 1)³ <
    2⁵³). One element, not three: on Gloo a 4-rank all_reduce of one element costs ~0.6 ms
    and ~30 µs of its transport's CPU per rank, of three ~2 ms and ~400 µs (docs/benchmarks.md,
    "Where the failure-free overhead goes")."""
    base = world + 1
    code = int(flags[0]) + int(flags[1]) * base + int(flags[2]) * base * base
    return torch.tensor([float(code)], dtype=torch.float64)


def decode_vote(total: torch.Tensor, world: int) -> tuple[bool, bool, bool]:
    """Whether any rank raised each flag, from the summed vote. A corrupted vote (a fault on
    this very collective) reads as the three-float vote read it, each flag compared ``> 0``:
    NaN or a negative sum raises none, +inf every one."""
    value = float(total[0])
    if math.isnan(value) or value <= 0:
        return (False, False, False)
    if math.isinf(value):
        return (True, True, True)
    base, code = world + 1, round(value)
    return (code % base > 0, (code // base) % base > 0, code // (base * base) > 0)


def encode_fingerprint(fingerprint: int, index: int, world: int) -> torch.Tensor:
    """This rank's part of a vote that carries the fingerprints: ``2 * world`` float64 zeros
    but for its own two slots, which hold its 64-bit fingerprint as two 32-bit halves. The SUM
    over the world is then every rank's fingerprint, exactly (each slot adds one value below
    2³² to zeros), in the order of the world group's ranks."""
    unsigned = fingerprint & (2**64 - 1)
    part = torch.zeros(2 * world, dtype=torch.float64)
    part[2 * index] = float(unsigned >> 32)
    part[2 * index + 1] = float(unsigned & 0xFFFFFFFF)
    return part


def decode_fingerprints(total: torch.Tensor, world: int) -> list[int | None]:
    """Every rank's fingerprint from the summed vote, by its index in the world group; None
    where the slots cannot hold one (a corrupted vote: NaN, ±inf, a fraction, out of range)."""
    values = total.tolist()
    out: list[int | None] = []
    for index in range(world):
        halves = values[2 * index : 2 * index + 2]
        if len(halves) != 2 or not all(
                math.isfinite(h) and h == int(h) and 0 <= h < 2**32 for h in halves):
            out.append(None)
            continue
        unsigned = (int(halves[0]) << 32) | int(halves[1])
        out.append(unsigned - 2**64 if unsigned >= 2**63 else unsigned)
    return out


def disagreeing_shards(fingerprints: list[int | None], members: list[int],
                       shards: int) -> dict[int, list[int]]:
    """The shards whose replicas' fingerprints differ, each with its odd replicas: those
    outside the majority, or all of them where no value has one (two replicas that differ).
    ``fingerprints[i]`` is member ``members[i]``'s; an unreadable one (None) agrees with
    nothing, so it is never taken for agreement."""
    found: dict[int, list[int]] = {}
    for shard in range(shards):
        pairs = [(rank // shards, fp) for rank, fp in zip(members, fingerprints, strict=True)
                 if rank % shards == shard]
        values = [fp for _, fp in pairs]
        if None not in values and len(set(values)) <= 1:
            continue
        counts = {v: values.count(v) for v in values if v is not None}
        best = max(counts.values(), default=0)
        found[shard] = [replica for replica, fp in pairs
                        if fp is None or counts[fp] < best or best == 1]
    return found


class KeptStates:
    """Flat copies of the state (parameters and optimizer state) in buffers that are reused:
    the state kept for a rollback, the one awaiting its fingerprints' comparison, and the
    snapshots the sender thread is sending. A fresh 3 MB tensor costs ~0.9 ms (the kernel
    hands over and zeroes new pages), a copy into a used one ~0.08 ms (docs/benchmarks.md).

    A buffer goes back to the free list only when nothing holds it any more: each holder
    (the loop's kept states, the sender until its put returned) takes a hold and drops it,
    from either thread. A buffer never written while anyone reads it is what makes the
    reuse safe: a rollback or a snapshot reading a buffer the next copy overwrites would be
    a torn state."""

    def __init__(self, free_limit: int = 2) -> None:
        self._lock = threading.Lock()
        self._holds: dict[int, int] = {}  # id(buffer) -> holders, for the pool's buffers
        self._free: list[torch.Tensor] = []
        self._free_limit = free_limit

    def copy(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A flat copy of ``tensors`` in a free buffer (or a new one), held once."""
        numel = sum(t.numel() for t in tensors)
        with self._lock:
            reuse = next((b for b in self._free if b.numel() == numel), None)
            if reuse is not None:
                self._free.remove(reuse)
        buffer = reuse if reuse is not None else torch.empty(numel, dtype=torch.float32)
        torch.cat([t.reshape(-1) for t in tensors], out=buffer)
        with self._lock:
            self._holds[id(buffer)] = 1
        return buffer

    def hold(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if id(buffer) in self._holds:
                self._holds[id(buffer)] += 1

    def drop(self, buffer: torch.Tensor | None) -> None:
        """One holder is done with ``buffer``; a buffer the pool did not make is left alone."""
        if buffer is None:
            return
        with self._lock:
            left = self._holds.get(id(buffer))
            if left is None:
                return
            if left > 1:
                self._holds[id(buffer)] = left - 1
                return
            del self._holds[id(buffer)]
            if len(self._free) < self._free_limit:
                self._free.append(buffer)

    def held(self) -> int:
        """How many of the pool's buffers something holds (for tests)."""
        with self._lock:
            return len(self._holds)


def _grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient after backward (every parameter of the model has one)."""
    grad = param.grad
    assert grad is not None
    return grad


class Worker:
    def __init__(self, cfg: Any, slot: int, inc: int, host: str, port: int) -> None:
        self.cfg = cfg
        self.slot, self.inc = slot, inc
        self.host, self.port = host, port
        self.world_size = cfg.replicas * cfg.shards
        # A re-forked worker may arrive after the job ended and the store is gone: give up soon.
        wait = _store.CONNECT_TIMEOUT if inc == 1 else timedelta(seconds=10)
        self.store = _store.connect(host, port, timeout=wait)
        # Blocks on plans and start lines instead of polling them.
        self.waiter = _store.waiter(host, port, timeout=wait)
        self.rank: int | None = None
        self.model: ParallelMLP | None = None
        self.model_shard = -1  # the shard ``model`` belongs to
        self.opt: torch.optim.Optimizer | None = None
        self.steps_done = -1  # optimizer steps applied to the state we hold; -1: no state
        # Lineage of our state: the generation that last trained it, or the source's when a
        # sync gave it to us (a sync alone changes nothing, so it moves no lineage: a member
        # whose sync failed while its peers' completed still holds the same state as they
        # do); -1: the seeded init, never trained.
        self.state_gen = -1
        self.pending = False  # gradients of step steps_done+1 are averaged, vote unfinished
        self.pending_gen = -1  # the generation that averaged them
        self.committed = False  # this process committed a step (and told the store so)
        self.rolled_back_to = -1  # step of the last fingerprint rollback
        self.mismatch = False  # some shard's fingerprints differed: roll back at the next vote
        # The newest state all fingerprints agreed on, and one fingerprinted here whose
        # fingerprints ride in the next vote (step, fingerprint); buffers from ``kept``.
        self.verified: tuple[int, torch.Tensor] | None = None
        self.candidate: tuple[int, torch.Tensor] | None = None
        self.fp_pending: tuple[int, int] | None = None
        self.kept = KeptStates()
        # The flat gradient buffer, reused every step and across generations: a fresh one
        # in every generation cost each survivor ~260 page faults in its first step.
        self.grads = GradBuffer()
        self.gen = -1
        self.groups: Groups | None = None
        self.plan_ahead = -1  # newest generation the heartbeat thread saw published
        self.stopping = False
        self.snapshots: queue.Queue[tuple[int, int, torch.Tensor] | None] = queue.Queue(1)
        self.replay = controller.read_membership(cfg.replay) if cfg.replay else None
        # 20 beats per heartbeat timeout, but no more than 20 a second: each beat is a round
        # trip to the store, served by the controller's process on the ranks' cores (at 20 a
        # second from 5 processes, ~1 ms of CPU per training step on the bench's host).
        timeout = cfg.heartbeat_timeout or cfg.collective_timeout
        self.hb_interval = min(0.5, max(0.05, timeout / 20))
        self.gen_changed = threading.Event()  # set whenever self.gen changes
        # Which generations a newer plan superseded: their waits give up (``_leave``).
        self.leave = _leave.Leave()
        for target in (self._heartbeat, self._snapshot_sender, self._plan_watch):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()

    # -- background threads: off the step's critical path ---------------------------------

    def _heartbeat(self) -> None:
        store = _store.connect(self.host, self.port)  # one connection per thread
        key = f"hb/{self.slot}/{self.inc}"
        while not self.stopping:
            with contextlib.suppress(Exception):
                if store.add(key, 1) < 0:
                    # Fenced by a controller on another node, which cannot signal us
                    # (controller.FENCED): we were silent too long and were replaced.
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.hb_interval)

    def _plan_watch(self) -> None:
        """Watch the plans after our generation. Any one sets ``plan_ahead`` (the vote then
        moves every member to it at the end of the step); one that does not wait for a step
        boundary (a member was lost, or the collectives failed) also makes us leave our
        generation at once (``_leave``): nothing of it waits on for a collective's timeout.
        Blocks on the store; woken by the run loop when this process joins a generation."""
        if self.replay is not None:
            return  # a replay switches at recorded steps, never on a plan
        store = _store.waiter(self.host, self.port)
        want = 0
        while not self.stopping:
            gen = self.gen
            if gen < 0:
                self.gen_changed.wait()
                self.gen_changed.clear()
                continue
            want = max(want, gen + 1)
            try:
                store.wait([f"plan/{want}"])
                plan = _store.get_json(store, f"plan/{want}")
            except Exception:  # the store is gone: the job is over
                while self.gen == gen and not self.stopping:
                    self.gen_changed.wait()
                    self.gen_changed.clear()
                continue
            if plan.get("end"):
                return
            self.plan_ahead = max(self.plan_ahead, want)
            if not plan.get("planned"):
                self.leave.supersede(want)
            want += 1

    def _snapshot_sender(self) -> None:
        sender: _snapshots.Sender | None = None
        while (item := self.snapshots.get()) is not None:
            step, shard, flat = item
            try:
                with contextlib.suppress(Exception):
                    if sender is None:  # the controller publishes it before the first plan
                        sender = _snapshots.Sender(self.store.get("snapshots").decode())
                    # The tensor's own memory, no copy in Python: the kernel copies it while
                    # sendall has released the GIL. (numpy's stubs do not declare the buffer
                    # protocol its arrays implement.)
                    sender.put(shard, step, memoryview(flat.numpy()).cast("B"))  # type: ignore[arg-type]
            finally:
                self.kept.drop(flat)  # the loop may write this buffer again

    def send_snapshot(self, step: int, shard: int, state: torch.Tensor) -> None:
        """Hand ``state`` (a buffer of ``kept``) to the sender thread, unless it is still busy
        with the previous one (then this one is skipped); the sender holds it until sent."""
        self.kept.hold(state)
        try:
            self.snapshots.put_nowait((step, shard, state))
        except queue.Full:
            self.kept.drop(state)

    def read_snapshot(self, shard: int) -> dict[int, torch.Tensor]:
        """The controller's snapshots of ``shard``: step -> flat state."""
        held = _snapshots.fetch(self.store.get("snapshots").decode(), shard)
        return {step: torch.frombuffer(data, dtype=torch.float32) for step, data in held.items()}

    # -- state ------------------------------------------------------------------------------

    def build(self, rank: int, groups: Groups) -> None:
        """This rank's model and optimizer (built unless held for its shard), on ``groups``."""
        model = self.prepare(rank, len(groups.replicas))
        for block in model.blocks:
            block.tp_group = groups.tp

    def prepare(self, rank: int, replicas: int) -> ParallelMLP:
        """The model and optimizer of ``rank``'s shard, built now unless this process holds
        them (a new one starts from the seeded init, the state of step 0). Needs no group: a
        process that holds no model yet (a spare, a re-forked member) prepares it as soon as
        a plan names its rank, while the others still tear their old groups down, instead of
        after the start line (``run``)."""
        shard = rank % self.cfg.shards
        if self.model is None or self.model_shard != shard:
            layout = Layout(replicas, self.cfg.shards, rank, None, None, None)
            self.model = ParallelMLP(self.cfg.model_config(), layout, self.cfg.seed)
            self.model_shard = shard
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                         weight_decay=0.0)
            # Create AdamW's state now, exactly as its first step would, so the state has a
            # fixed layout that can be flattened, sent and received before any step.
            for p in self.model.parameters():
                self.opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            self.steps_done, self.state_gen = 0, -1  # the seeded init is the state of step 0
            # Opt in to Aftershock's in-process faults on the new tensors (a no-op outside
            # the harness).
            probe.install(model=self.model, optimizer=self.opt)
        return self.model

    def tensors(self) -> list[torch.Tensor]:
        assert self.model is not None
        assert self.opt is not None
        params = list(self.model.parameters())
        out = [p.data for p in params]
        for p in params:
            state = self.opt.state[p]
            out += [state["exp_avg"], state["exp_avg_sq"], state["step"].view(1)]
        return out

    def load_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        for t in self.tensors():
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def fingerprint(self, flat: torch.Tensor) -> int:
        """CRC-32 of each half of the parameters' bytes, in order, as one signed 64-bit value
        (the first half's in the high 32 bits), from a flat state (``tensors()`` begins with
        the parameters): hashed from the very copy kept for a rollback, so the two cannot
        differ even when a bit flips while they are taken.

        What it must catch is a replica whose parameters silently differ: a flipped bit, a
        poisoned word, a stale tensor. A CRC-32 catches every change confined to 32
        consecutive bits of its half with certainty, and any other with probability
        1 - 2^-32; it costs 0.15 ms per MB here, against 0.52 ms for the sha256 it replaced
        (the fingerprints' phase, docs/benchmarks.md)."""
        assert self.model is not None
        params = sum(p.numel() for p in self.model.parameters())
        data = memoryview(flat[:params].numpy()).cast("B")  # type: ignore[arg-type]
        half = len(data) // 2
        value = (zlib.crc32(data[:half]) << 32) | zlib.crc32(data[half:])
        return value - 2**64 if value >= 2**63 else value

    # -- membership -------------------------------------------------------------------------

    def mine(self, plan: dict[str, Any]) -> int | None:
        for rank, (slot, inc) in plan["members"].items():
            if (slot, inc) == (self.slot, self.inc):
                return int(rank)
        return None

    def wait_for_plan(self) -> dict[str, Any] | None:
        """The next plan that includes this process (skipping superseded ones), or None at
        the end of the job. Blocks on the store (no polling): the controller writes every
        plan, and at the end ``{"end": true}`` as the next one."""
        want = self.gen + 1
        while True:
            self.waiter.wait([f"plan/{want}"])
            if _store.get_json(self.store, f"plan/{want}").get("end"):
                return None
            newest = max(_store.latest(self.store), want)
            plan = _store.get_json(self.store, f"plan/{newest}")
            if plan.get("end"):
                return None
            if self.mine(plan) is not None:
                return plan
            want = newest + 1

    def join(self, plan: dict[str, Any]) -> Groups:
        gen, rank = plan["gen"], self.mine(plan)
        assert rank is not None
        members = sorted(int(r) for r in plan["members"])
        # Start line: build no group while a member may still be dead or superseded (a Gloo
        # group's constructor would wait for a missing member until its timeout). Where our
        # loop is, for the controller: it fences a member that stays inside an old generation.
        self.store.set(f"loop/{self.slot}/{self.inc}", f"{gen} in")
        if self.store.add(f"arrive/{gen}", 1) == len(members):
            self.store.set(f"arrived/{gen}", "all")
        elif _store.latest(self.store) > gen:
            raise Superseded
        # The last member to arrive sets the key, or the controller when it publishes the
        # next generation (then some member may never come).
        self.waiter.wait([f"arrived/{gen}"])
        if self.store.add(f"arrive/{gen}", 0) < len(members):
            raise Superseded
        probe.fault_point("join", self.steps_done)  # every member is in; no group built yet
        timeout = timedelta(seconds=self.cfg.collective_timeout)
        store = self.store

        def group(name: str, ranks: list[int]) -> Any:
            prefixed = dist.PrefixStore(f"gen{gen}/{name}/", store)
            # Called directly, never through torch.distributed's functions: opted in to
            # Aftershock's collective faults here (the group itself outside the harness).
            # Its waits give up once a newer plan supersedes this generation.
            return _leave.Abandonable(probe.wrap_group(
                dist.ProcessGroupGloo(prefixed, ranks.index(rank), len(ranks), timeout)),
                self.leave, gen)

        shards = self.cfg.shards
        replica, shard = divmod(rank, shards)
        dp_ranks = [r * shards + shard for r in plan["replicas"]]

        def make() -> tuple[Any, Any, Any, Star]:
            return (group("world", members),
                    group(f"tp{replica}", [replica * shards + s for s in range(shards)]),
                    group(f"dp{shard}", dp_ranks),
                    Star.connect(dist.PrefixStore(f"gen{gen}/", store), members.index(rank),
                                 len(members), self.cfg.collective_timeout))

        # Each constructor waits for every member until the collective timeout, and nothing
        # interrupts it: a member killed after the start line would hold us here that long.
        try:
            world, tp, dp, star = _leave.build(make, self.leave, gen)
        except _leave.Left:
            # The abandoned build may block on our store connection until its timeout (a
            # TCPStore connection runs one call at a time): it keeps that one, we take a
            # new one. Not one of our own beside it from the start: each connection costs
            # the store's host a reverse DNS lookup of our address, and where a burst of
            # them is dropped (seen in this sandbox) every connect of the burst waits 5 s.
            self.store = _store.connect(self.host, self.port)
            raise
        self.leave.enter(gen, star)
        return Groups(gen, rank, members, plan["replicas"], world, tp, dp, dp_ranks, star)

    def sync(self, g: Groups) -> int:
        """Agree on the step to resume from and give every member that state."""
        assert self.opt is not None
        shards = self.cfg.shards
        pending = self.pending_gen if self.pending else -1
        mine = torch.tensor([self.state_gen, self.steps_done, pending, g.rank])
        rows = [torch.zeros(4, dtype=torch.int64) for _ in g.members]
        g.world.allgather([rows], [mine]).wait()
        held = {int(row[3]): Held(int(row[0]), int(row[1]), int(row[2])) for row in rows}
        # The seeded init is the state of step 0 until some process committed a step.
        fresh_is_step_0 = not _store.has(self.store, "committed")
        top, ready = ready_at(held, fresh_is_step_0)
        newest = max((held[r].gen for r in ready if held[r].steps == top), default=-1)
        if g.gen > 0:  # a recovery: members agreed on the step, no state has moved yet
            probe.fault_point("restore", top)
        if self.rank in ready and self.steps_done == top - 1:
            self.opt.step()
            self.steps_done = top
        self.pending = False
        sources = {}
        for shard in range(shards):
            have = sorted(r for r in ready if r % shards == shard)
            if have:
                sources[shard] = have[0]
        # The states kept for a rollback are replaced below: their buffers serve the copy.
        for old in (self.verified, self.candidate):
            self.kept.drop(old[1] if old else None)
        self.verified = self.candidate = None
        copied = None
        if len(sources) == shards:
            resume, lineage = top, newest
            if any(r not in ready for r in g.dp_ranks):
                source = sources[g.rank % shards]
                copied = self.copy_from_peer(g, source, resume, receive=g.rank not in ready)
                if g.rank != source and g.rank in ready:
                    # The copy holds the source's state; we kept our own (the same bits).
                    self.kept.drop(copied)
                    copied = None
        else:
            # Every member, survivors of the other shards too, now holds the snapshots' state:
            # a lineage of this generation's own.
            resume, lineage = self.restore_snapshots(g), g.gen
        self.steps_done, self.state_gen = resume, lineage
        # What we hold now is what a rollback returns to: the copy we just took part in,
        # which is already our state, or a copy of it.
        self.verified = (resume, copied if copied is not None
                         else self.kept.copy(self.tensors()))
        self.candidate, self.mismatch, self.fp_pending = None, False, None
        if self.cfg.snapshot_every > 0 and g.rank // shards == g.replicas[0]:
            # The state every member holds now, so that losing every holder of a shard before
            # the next step's snapshot still finds this one.
            self.send_snapshot(resume, g.rank % shards, self.verified[1])
        if g.rank == g.members[0]:
            self.store.set(f"resume/{g.gen}", str(resume))
            _store.report(self.store, type="resumed", gen=g.gen, step=resume)
        if g.gen > 0:
            probe.recovered(rank=g.rank, generation=g.gen, step=resume,
                            replicas=g.replicas)
        return resume

    def copy_from_peer(self, g: Groups, source: int, step: int, *, receive: bool
                       ) -> torch.Tensor:
        """Our data-parallel group takes the state of ``source``, a member of the same shard
        that holds step ``step`` (replicas of a shard are bitwise identical); ``receive``:
        we are behind and load it. Returns the source's state, in a buffer of ``kept`` held
        once (the caller's to drop): a buffer used before, whose pages are already the
        process's, not a fresh 3 MB tensor (~800 page faults in the middle of a recovery)."""
        flat = self.kept.copy(self.tensors())
        try:
            opts = dist.BroadcastOptions()
            opts.rootRank = g.dp_ranks.index(source)
            g.dp.broadcast([flat], opts).wait()
            if receive:
                self.load_flat(flat)
        except _leave.Left:
            raise  # the abandoned broadcast may still write into it: never reused
        except BaseException:
            self.kept.drop(flat)
            raise
        return flat

    def restore_snapshots(self, g: Groups) -> int:
        """Every replica of some shard is gone: every member goes back to the newest step for
        which the controller holds a snapshot of every shard (parameters and optimizer
        state), survivors of the other shards included. Returns that step."""
        shards = self.cfg.shards
        snaps = [self.read_snapshot(s) for s in range(shards)]
        common = set(snaps[0]).intersection(*snaps[1:])
        if not common:
            raise SystemExit("no live replica and no complete snapshot for some shard")
        resume = max(common)
        shard = g.rank % shards
        self.load_flat(snaps[shard][resume])
        # The generation that restores, which a survivor's events do not name until its
        # first step in it: what tells one restore from the next (checks, `lost_steps`).
        probe.checkpoint_loaded(resume, f"peer-memory snapshot of shard {shard}", rank=g.rank,
                                generation=g.gen)
        return resume

    # -- training -----------------------------------------------------------------------------

    def train(self, g: Groups) -> None:
        cfg, model, opt = self.cfg, self.model, self.opt
        assert model is not None
        assert opt is not None
        replica, shard = divmod(g.rank, cfg.shards)
        live = len(g.replicas)
        snapshotter = cfg.snapshot_every > 0 and replica == g.replicas[0]
        stop_at = None
        if self.replay is not None and g.gen + 1 < len(self.replay):
            stop_at = self.replay[g.gen + 1]["first_step"] - 1
        params = list(model.parameters())
        grads = self.grads
        laps = Laps()  # where each step's time goes, when AFTERSHOCK_PHASES asks (make bench)
        world_rank = g.members.index(g.rank)  # the fingerprints' slots are by world rank
        while self.steps_done < cfg.steps:
            if stop_at is not None and self.steps_done >= stop_at:
                _store.report(self.store, type="leave", gen=g.gen, rank=g.rank)
                raise Switch
            step = self.steps_done + 1  # the step being computed, 1-based
            x, y = synthetic_batch(cfg.model_config(), cfg.seed, step - 1, replica,
                                   cfg.batch_size)
            laps.lap("batch")
            probe.fault_point("forward", step)
            loss = F.mse_loss(model(x), y)
            laps.lap("forward")
            opt.zero_grad(set_to_none=True)
            laps.lap("zero_grad")
            loss.backward()
            probe.fault_point("backward", step)
            laps.lap("backward")
            flat = grads.flatten([_grad(p) for p in params] + [loss.detach().reshape(1)])
            g.dp.allreduce([flat]).wait()
            self.average(flat, live)
            nonfinite = not all_finite(flat)
            offset = 0
            for p in params:  # views of the buffer, not copies (trainer.average_gradients)
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n
            self.pending, self.pending_gen = True, g.gen
            laps.lap("average")
            vote = encode_vote((nonfinite, self.mismatch, self.plan_ahead > g.gen),
                               len(g.members))
            riding = self.fp_pending  # the last fingerprint step's fingerprints ride along
            if riding is not None:
                vote = torch.cat([vote, encode_fingerprint(riding[1], world_rank,
                                                           len(g.members))])
            g.star.sum(vote)
            self.pending = False
            bad, mismatch, ahead = decode_vote(vote[:1], len(g.members))
            if riding is not None:
                self.fp_pending = None
                self.judge_fingerprints(
                    g, riding[0], decode_fingerprints(vote[1:], len(g.members)), snapshotter)
                mismatch = mismatch or self.mismatch
            laps.lap("vote")
            if bad:  # nobody applies it; compute the same step again
                if nonfinite:
                    probe.detected(cause="non_finite", rank=g.rank, step=step, replica=replica,
                                   generation=g.gen)
                continue
            if mismatch:  # silent corruption somewhere: everyone back to the last agreement
                assert self.verified is not None
                back, state = self.verified
                self.load_flat(state)
                self.kept.drop(self.candidate[1] if self.candidate else None)
                self.steps_done, self.mismatch, self.candidate = back, False, None
                self.state_gen = g.gen  # every member of the generation rolls back with us
                why = "rolled back to the last matching fingerprints"
                if self.rolled_back_to == back:
                    # The same disagreement again from the same state: the saved state itself
                    # differs between replicas. Make every shard agree with its lowest replica
                    # (with two replicas there is no majority to prefer), then go on.
                    flat = self.kept.copy(self.tensors())
                    g.dp.broadcast([flat], dist.BroadcastOptions()).wait()
                    self.load_flat(flat)
                    self.kept.drop(state)
                    self.verified = (back, flat)
                    why = f"copied from replica {g.replicas[0]} after a repeated mismatch"
                self.rolled_back_to = back
                probe.recovered(rank=g.rank, generation=g.gen, step=back, why=why)
                continue
            probe.fault_point("optimizer", step)
            opt.step()
            laps.lap("optimizer")
            self.steps_done, self.state_gen = step, g.gen
            if not self.committed:  # fresh processes no longer hold the state of step 0
                self.committed = True
                self.store.set("committed", "1")
            probe.step(step, world=self.world_size, rank=g.rank, loss=float(flat[-1]),
                       generation=g.gen, replicas=live)
            fingerprinted = cfg.fingerprint_every and step % cfg.fingerprint_every == 0
            if fingerprinted:
                laps.lap("rest")
                self.take_fingerprint(step)
                laps.lap("fingerprints")
            # A fingerprinted state is sent once its fingerprints agreed, after the next vote
            # (judge_fingerprints), never while the replicas may disagree on it; and none while
            # they are known to (the vote rolls every member back at the next step). Lazy:
            # if the sender is still busy with the previous one, this one is skipped.
            if snapshotter and step % cfg.snapshot_every == 0 and not fingerprinted \
                    and not self.mismatch and not self.snapshots.full():
                laps.lap("rest")
                state = self.kept.copy(self.tensors())
                self.send_snapshot(step, shard, state)
                self.kept.drop(state)  # the sender's hold is the only one
                laps.lap("snapshot")
            if ahead:
                raise Switch
            if cfg.step_sleep:
                time.sleep(cfg.step_sleep)
            laps.step_done(step)

    @staticmethod
    def average(flat: torch.Tensor, live: int) -> None:
        """The data-parallel sum, in place, to the mean over the replicas that computed it:
        while a replica is missing (elastic) that is fewer than configured, and the membership
        log says so, which is what a replay recomputes."""
        flat /= live

    def take_fingerprint(self, step: int) -> None:
        """Keep a copy of this step's state and fingerprint it; the fingerprint rides in the
        next step's vote, which compares every shard's replicas (judge_fingerprints). No
        collective of its own: an all_gather over the replicas here cost each rank a round
        and a wait (~1 ms of CPU on the bench's host, docs/benchmarks.md)."""
        self.kept.drop(self.candidate[1] if self.candidate else None)
        state = self.kept.copy(self.tensors())
        self.candidate = (step, state)
        self.fp_pending = (step, self.fingerprint(state))

    def judge_fingerprints(self, g: Groups, step: int, fingerprints: list[int | None],
                           snapshotter: bool) -> None:
        """The fingerprints of ``step``'s state, every member's, from the vote: every member
        reads the same values and takes the same decision. Agreed: that state is the one a
        rollback returns to, and the snapshot that waited for it is sent. Differed: nobody
        keeps it, and the vote's caller rolls every member back to the last agreed state."""
        found = disagreeing_shards(fingerprints, g.members, self.cfg.shards)
        candidate, self.candidate = self.candidate, None
        shard = g.rank % self.cfg.shards
        if found:
            self.mismatch = True
            self.kept.drop(candidate[1] if candidate else None)
            if shard in found and g.rank == g.dp_ranks[0]:
                probe.detected(cause="fingerprint_mismatch", rank=g.rank, step=step,
                               shard=shard, replicas=found[shard], generation=g.gen)
            return
        if candidate is None or candidate[0] != step:
            return
        self.kept.drop(self.verified[1] if self.verified else None)
        self.verified = candidate
        if snapshotter and step % self.cfg.snapshot_every == 0 and not self.snapshots.full():
            self.send_snapshot(step, shard, candidate[1])

    def finish(self, g: Groups) -> None:
        assert self.model is not None
        # The training is over from here (the controller's ``over``), said before anything
        # that can fail or take time: a death reported before any member's final parameters
        # (a standby reports one within ~15 ms) would otherwise start a generation of
        # members on their way out.
        _store.report(self.store, type="last", rank=g.rank, slot=self.slot, inc=self.inc)
        probe.fault_point("finish", self.steps_done)
        final = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        probe.params(param_digest(final), step=self.steps_done, rank=g.rank)
        if self.cfg.out:
            out = Path(self.cfg.out) / "final"
            out.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(final, buffer)
            checkpoint.write_atomic(out / f"rank_{g.rank}.pt", buffer.getvalue())
        _store.report(self.store, type="done", rank=g.rank, slot=self.slot, inc=self.inc)

    def close_groups(self) -> None:
        """Destroy this generation's groups: that closes our Gloo sockets, so a peer still
        blocked on us fails now instead of at its timeout. (``abort()`` and ``shutdown()``
        do not close them for Gloo in torch 2.13; dropping the last reference does.)

        The three groups are destroyed at once, each in a thread of its own, and this
        returns once all three are. A Gloo group's destructor (torch runs it without the
        GIL) closes its connections one at a time, each after a tick of its event loop,
        which sleeps up to 10 ms when idle: one after another the bench's world, TP and DP
        groups took ~50 ms on the way to the next plan, and a peer blocked on our DP
        connection learnt of the failure only at the end of it (docs/benchmarks.md,
        "Recovery: where the time went"). A generation we left on a newer plan
        (``_leave``) may have an op in flight, which its group's destructor waits for up
        to the op's timeout: that teardown goes on in its threads while we go on."""
        self.leave.forget()
        g, self.groups = self.groups, None
        boxes: list[list[Any]] = []
        # A generation we left may have a Gloo op in flight: its group's destructor waits
        # for that op, up to its timeout. Not on the way to the next plan.
        wait = g is None or not self.leave.superseded(g.gen)
        if g is not None:
            g.star.close()
            boxes = [[g.dp], [g.tp], [g.world]]
        del g
        if self.model is not None:
            for block in self.model.blocks:
                assert isinstance(block, ParallelBlock)
                block.tp_group = None
        gc.collect()  # cycles (a traceback's frames) that may still hold a group
        # Each box holds the group's last reference: the thread's clear() drops it.
        threads = [threading.Thread(target=box.clear, daemon=True, name="close_group")
                   for box in boxes]
        for thread in threads:
            thread.start()
        if wait:
            for thread in threads:
                thread.join()
        if self.leave.abandoned:
            # An abandoned all_reduce may still write into the gradient buffer.
            self.grads = GradBuffer()
            self.leave.abandoned.clear()

    def run(self, left: int | None = None) -> int:
        """Train (or wait as a spare) until the job ends; ``left``: a pipe to the supervisor,
        told once this process has left the job."""
        _store.report(self.store, type="ready", slot=self.slot, inc=self.inc, pid=os.getpid(),
                      host=controller.host_id())
        initial = self.inc == 1 and not controller.is_spare_slot(self.cfg, self.slot)
        if self.cfg.recovery == "hot_spare" and not initial:
            probe.hello(world=self.world_size, generation=max(_store.latest(self.store), 0),
                        rank=None, role="spare", slot=self.slot)
            if self.inc == 1:
                # The job's own spare, at its start. A spare forked after a death does not:
                # it would take the CPU from the recovery under way; a standby did already.
                _prefault(self.cfg)
        while True:
            plan = self.wait_for_plan()
            if plan is None:
                break
            if self.model is None:
                # ~12 ms of model and optimizer state on this host: built while the survivors
                # still tear their old groups down, not after the start line, where every
                # member would wait for it (a spare's recovery, "Runs T and U" in
                # docs/benchmarks.md).
                rank = self.mine(plan)
                assert rank is not None  # wait_for_plan returns only plans that name us
                self.prepare(rank, len(plan["replicas"]))
            self.gen = plan["gen"]
            self.gen_changed.set()
            failure = None
            g: Groups | None = None
            try:
                g = self.join(plan)
                self.groups = g
                if self.rank != g.rank:
                    # Events and in-process faults aimed at a rank follow the logical rank.
                    probe.set_rank(g.rank)
                    self.build(g.rank, g)
                    self.rank = g.rank
                    probe.hello(world=self.world_size, generation=g.gen, rank=g.rank,
                                role="trainer", replica=g.rank // self.cfg.shards,
                                shard=g.rank % self.cfg.shards, slot=self.slot)
                else:
                    self.build(g.rank, g)
                self.sync(g)
                self.train(g)
                self.finish(g)
                break
            except (Superseded, Switch):
                pass
            except RuntimeError as exc:  # DistBackendError, DistNetworkError, Gloo errors
                if not self.leave.superseded(self.gen):
                    text = str(exc).strip().splitlines()
                    failure = text[0] if text else type(exc).__name__
                # else a newer plan superseded this generation and we left it (``_leave``):
                # the controller knows why.
            # Out of the generation, said before the teardown, which can take seconds (Gloo
            # destroys a broken group holding the GIL: even the heartbeat pauses), so that the
            # controller never takes a member on its way for one wedged in a collective.
            self.store.set(f"loop/{self.slot}/{self.inc}", f"{self.gen} out")
            # Out of the handler, so the traceback (and its frames' references) is gone.
            g = None
            self.close_groups()
            if failure is not None:
                low = failure.lower()
                cause = "collective_timeout" if "timed out" in low or "timeout" in low \
                    else "collective_error"
                probe.detected(cause=cause, error=failure[:200], rank=self.rank,
                               generation=self.gen)
                _store.report(self.store, type="fail", slot=self.slot, inc=self.inc,
                              gen=self.gen, cause=cause)
        self.close_groups()
        self.stopping = True
        self.gen_changed.set()
        self.snapshots.put(None)
        if left is not None:
            # Our final parameters are reported (or the job ended without us): from here on a
            # death is no failure of the job. Without this, a kill on the way out looked like
            # any other to the supervisor, whose re-forked worker then found the store gone,
            # failed, and torchrun restarted the whole job from step 0.
            os.write(left, b"1")
        probe.emit("exit", code=0, rank=self.rank)
        self.store.add("exited", 1)
        probe.fault_point("exit", self.steps_done)
        return 0


# ---------------------------------------------------------------------------------------------
# Supervisor


def _worker(
    cfg: Any, slot: int, inc: int, host: str, port: int, died: tuple[int, int] | None,
    left: int,
) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker = Worker(cfg, slot, inc, host, port)
    if died is not None:  # process-exit detection for the controller, milliseconds after it
        _store.report(worker.store, type="dead", slot=slot, inc=died[0], status=died[1])
    return worker.run(left)


#: How long a slot's worker lives before its supervisor forks the standby: a fork of a
#: process that imported torch costs a few ms of CPU, kept off a start or a recovery that
#: is still under way. A worker that dies sooner is followed by a fresh fork, as before.
STANDBY_AFTER_S = 1.0


#: How much memory a process that may join a recovery later (a warm spare, a standby) makes
#: its own while it waits, in flat states of one shard (``state_bytes``): the model and its
#: optimizer state, the copy it receives from a peer, and its first step's gradients and
#: activations are what it writes first there (``reference_impl._memory``).
PREFAULT_STATES = 4


def state_bytes(cfg: Any) -> int:
    """Bytes of one shard's flat state (``Worker.tensors``: each parameter, AdamW's two
    moments of it and its step count, float32), without building the model."""
    return sum(3 * n + 1 for n in shard_numels(cfg.model_config(), cfg.shards)) * 4


def _prefault(cfg: Any) -> None:
    """Make the memory a recovery will need this process's own now, while it waits."""
    _memory.prefault(PREFAULT_STATES * state_bytes(cfg))


def _standby(cfg: Any, slot: int, inc: int, host: str, port: int, wake: int, left: int
             ) -> int:
    """A slot's next incarnation, forked while the current one runs (``_fork_standby``).

    It connects to the store and blocks on ``wake``. When its supervisor writes the dead
    incarnation and its status there, it reports the death at once (its connection is
    already open: a fork, Python's start in the child and a store connection after the
    death took most of the ~30 ms between a kill and the controller's plan, docs/trainer.md),
    then becomes the slot's worker. EOF instead: the job ended, nothing to report."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    store: dist.Store | None = None
    with contextlib.suppress(Exception):  # no store (the job ended): connect when woken
        store = _store.connect(host, port)
    _prefault(cfg)
    word = b""
    while chunk := os.read(wake, 64):
        word += chunk
    os.close(wake)
    if not word:
        return 0
    died_inc, status = (int(part) for part in word.split())
    if store is None:
        store = _store.connect(host, port, timeout=timedelta(seconds=10))
    _store.report(store, type="dead", slot=slot, inc=died_inc, status=status)
    worker = Worker(cfg, slot, inc, host, port)
    return worker.run(left)


@dataclass
class _Incarnation:
    """A process the supervisor forked for its slot: the worker, or the standby."""

    pid: int
    inc: int
    left: int  # read end of the pipe on which it says it has left the job
    wake: int | None = None  # a standby's: write end of the pipe that wakes it


def _dies_within(pid: int, seconds: float) -> bool:
    """Whether child ``pid`` exits within ``seconds`` (left for ``waitpid`` to reap). True
    where pidfds are missing: then no standby is forked."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return True
    try:
        import select

        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)


def _has_left(pipe: int) -> bool:
    """Whether the worker on the other end of ``pipe`` (now dead) said it had left the job."""
    os.set_blocking(pipe, False)
    try:
        return os.read(pipe, 1) == b"1"
    except BlockingIOError:
        return False


def _fork(target: Any, *args: Any, close: tuple[int, ...] = ()) -> int:
    """Run ``target(*args)`` in a forked child; ``close``: the parent's descriptors the child
    must not hold (a standby sees EOF on its wake pipe only once no other process holds
    the write end)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd in close:
                os.close(fd)
            code = target(*args)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Never run interpreter shutdown: group destructors may block on dead peers.
            os._exit(code)
    return pid


def _fork_standby(cfg: Any, slot: int, worker: _Incarnation, host: str, port: int
                  ) -> _Incarnation:
    wake_read, wake_write = os.pipe()
    left_read, left_write = os.pipe()
    pid = _fork(_standby, cfg, slot, worker.inc + 1, host, port, wake_read, left_write,
                close=(wake_write, left_read, worker.left))
    os.close(wake_read)
    os.close(left_write)
    return _Incarnation(pid, worker.inc + 1, left_read, wake_write)


def _wake(standby: _Incarnation, died: tuple[int, int]) -> bool:
    """Tell ``standby`` its predecessor died; False if it is gone (nobody reads its pipe)."""
    assert standby.wake is not None
    try:
        os.write(standby.wake, f"{died[0]} {died[1]}".encode())
    except OSError:  # EPIPE: it died
        return False
    finally:
        os.close(standby.wake)
        standby.wake = None
    return True


def _drop(standby: _Incarnation) -> None:
    """End a standby that will not be needed (or cannot be woken): it holds nothing but a
    store connection, and may still be waiting for the store, so it is killed, not asked."""
    if standby.wake is not None:
        os.close(standby.wake)
        standby.wake = None
    with contextlib.suppress(ProcessLookupError):
        os.kill(standby.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(standby.pid, 0)
    os.close(standby.left)


def main(cfg: Any) -> int:
    slots = int(os.environ.get("WORLD_SIZE", "1"))
    slot = int(os.environ.get("RANK", "0"))
    spares = cfg.spares if cfg.recovery == "hot_spare" else 0
    if cfg.replicas == 0:
        cfg.replicas = (slots - spares) // cfg.shards
    if cfg.replicas < 1 or cfg.replicas * cfg.shards + spares != slots:
        print(f"error: WORLD_SIZE {slots} must be --replicas × --shards + --spares "
              f"({cfg.replicas} × {cfg.shards} + {spares})", file=sys.stderr)
        return 2
    if spares and controller.first_spare(cfg) > cfg.replicas * cfg.shards:
        print(f"error: --first-spare {cfg.first_spare} must be 0..{cfg.replicas * cfg.shards}"
              " (or -1: after every rank)", file=sys.stderr)
        return 2
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    # With the agent's store shared (torchrun's default), MASTER_PORT is that store, hosted by
    # the agent and so already out of every rank's fate; otherwise the controller hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    children: dict[str, int] = {}

    def on_sigterm(signum: int, frame: Any) -> None:
        for pid in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    # Once, here: forked workers inherit both settings. One thread per rank fixes CPU kernels'
    # reduction order (hence the bits); the first use_deterministic_algorithms call of a
    # process costs seconds (lazy imports), which a re-forked worker must not pay again.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # Everything alive now (torch's modules, ~300,000 objects) lives as long as the process:
    # keep it out of every later collection. close_groups' gc.collect, which decides how soon
    # a broken group's sockets close and so how soon peers learn of a failure, then takes
    # microseconds instead of ~0.1 s (0.3 s on a busy host), and forked workers share these
    # pages instead of copying them when a collection touches their headers.
    gc.freeze()
    if slot == 0:
        children["controller"] = _fork(controller.run, cfg, host, port, slots, not agent_store)
    code = 0
    died: tuple[int, int] | None = None
    worker: _Incarnation | None = None
    standby: _Incarnation | None = None
    while True:
        # The supervisor itself never opens a store connection: a process forked while one
        # is open cannot connect again. The next incarnation reports its predecessor's death:
        # the standby, already connected, where one is up; else one forked now.
        inc = 1 if worker is None else worker.inc + 1
        if standby is not None and died is not None and _wake(standby, died):
            worker, standby = standby, None
            children.pop("standby", None)
        else:
            if standby is not None:  # it died, or cannot be woken: a fresh fork instead
                _drop(standby)
                standby = None
                children.pop("standby", None)
            read_end, write_end = os.pipe()
            pid = _fork(_worker, cfg, slot, inc, host, port, died, write_end, close=(read_end,))
            os.close(write_end)
            worker = _Incarnation(pid, inc, read_end)
        children["worker"] = worker.pid
        if standby is None and not _dies_within(worker.pid, STANDBY_AFTER_S):
            standby = _fork_standby(cfg, slot, worker, host, port)
            children["standby"] = standby.pid
        _, status = os.waitpid(worker.pid, 0)
        left = _has_left(worker.left)
        os.close(worker.left)
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
            break
        if left:  # killed on its way out, its work done: the job lost nothing
            break
        died = (worker.inc, -os.WTERMSIG(status))  # killed: its successor takes over, warm
    if standby is not None:
        _drop(standby)
    if "controller" in children:
        _, status = os.waitpid(children["controller"], 0)
        if code == 0 and os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
    return code
