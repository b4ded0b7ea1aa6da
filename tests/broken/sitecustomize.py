"""Deliberately broken variants of the reference trainer, for tests only.

A test that must show a check failing puts this folder first on the job's ``PYTHONPATH`` and
names one bug in ``AFTERSHOCK_TEST_BUG`` (tests/_broken.py does both, for the faulted run
only: the fault-free baseline and the elastic replay stay the real trainer). Python imports
``sitecustomize`` at start-up in every process of the job; this one patches the named
function or method when its module is imported, and says so on the timeline
(``test_bug`` event), so a test can tell the broken code really ran. Production code has no
switch for any of these.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

BUG_ENV = "AFTERSHOCK_TEST_BUG"


def _announce(name: str) -> None:
    from aftershock.harness import probe

    probe.emit("test_bug", bug=name)


# --- the bugs: each takes the freshly imported module and breaks one thing in it -----------


def prune_before_commit(checkpoint: ModuleType) -> None:
    """Make room first: rank 0 deletes the older checkpoints before the new one is
    committed, so a crash between the shard writes and the commit leaves nothing to resume
    from (the restarted world starts from step 0)."""
    save = checkpoint.save

    def broken(root: Path, step: int, state: Any, meta: Any, group: Any) -> Any:
        import torch.distributed as dist

        if dist.get_rank(group) == 0:
            for older, path in checkpoint.committed_steps(root):
                if older < step:
                    shutil.rmtree(path, ignore_errors=True)
        return save(root, step, state, meta, group)

    checkpoint.save = broken


def quarantine_on_failed_agreement(checkpoint: ModuleType) -> None:
    """When the ranks fail to agree on the checkpoint to resume from, rank 0 blames the
    checkpoint and deletes it so that the next restart does not try it again. A peer that
    dies during the agreement then costs a good checkpoint.

    The deletion always happens: torchrun's SIGTERM, which the launcher sends once it sees
    the dead peer (within its 0.1 s monitor interval), waits until it is done. Otherwise a
    rank 0 that a busy host did not schedule in time ended at the SIGTERM first, the
    defect never happened, and the run rightly passed: the one way this scenario resumes
    from step 20 again, which CI saw once."""
    import signal

    load_latest = checkpoint.load_latest

    def broken(root: Path, meta: Any, group: Any) -> Any:
        import torch.distributed as dist

        held: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
        try:
            return load_latest(root, meta, group)
        except RuntimeError:
            newest = checkpoint.committed_steps(root)
            if dist.get_rank(group) == 0 and newest:
                shutil.rmtree(newest[0][1], ignore_errors=True)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            if held:
                os.kill(os.getpid(), signal.SIGTERM)

    checkpoint.load_latest = broken


def lineage_per_sync(resilient: ModuleType) -> None:
    """A completed sync makes a member's state current in that generation, whether or not the
    sync changed it. When a second failure interrupts a recovery, the members whose sync
    completed then outrank their peers whose sync failed while holding the very same state,
    and a shard whose only holder is such a peer counts as lost."""
    sync = resilient.Worker.sync

    def broken(self: Any, g: Any) -> int:
        resume = sync(self, g)
        self.state_gen = g.gen
        return resume

    resilient.Worker.sync = broken


def vote_alone(trainer: ModuleType) -> None:
    """Each rank decides alone whether its averaged gradients are finite: the vote's messages
    still flow, but its verdict is ignored. A NaN in one shard's gradients then makes only
    that shard skip the step."""
    vote = trainer.vote

    def broken(flags: Any, finite: bool, layout: Any) -> tuple[bool, list[int]]:
        vote(flags, finite, layout)
        return finite, []

    trainer.vote = broken


def stale_snapshot(resilient: ModuleType) -> None:
    """A replacement copies its state from a live peer, then loads the controller's
    snapshot one step older on top of it (a state one step old)."""
    copy = resilient.Worker.copy_from_peer

    def broken(self: Any, g: Any, source: int, step: int, *, receive: bool) -> Any:
        flat = copy(self, g, source, step, receive=receive)
        if receive:
            old = self.read_snapshot(g.rank % self.cfg.shards).get(step - 1)
            if old is not None:
                self.load_flat(old)
                flat.copy_(old)  # what it returns is the state it now holds
        return flat

    resilient.Worker.copy_from_peer = broken


def full_average(resilient: ModuleType) -> None:
    """While replicas are missing (elastic), survivors still divide the gradient sum by the
    configured replica count (a classic elastic bug; the membership log stays truthful)."""

    def broken(self: Any, flat: Any, live: int) -> None:
        flat /= self.cfg.replicas

    resilient.Worker.average = broken


def snapshot_without_optimizer(resilient: ModuleType) -> None:
    """The controller's snapshots restore the parameters only: AdamW's moments and step
    count start over, as when a snapshot is a model state_dict without the optimizer's."""
    restore = resilient.Worker.restore_snapshots

    def broken(self: Any, g: Any) -> int:
        resume = restore(self, g)
        for state in self.opt.state.values():
            for value in state.values():
                value.zero_()
        return resume

    resilient.Worker.restore_snapshots = broken


def vote_before_average(resilient: ModuleType) -> None:
    """The ``hot_spare`` / ``elastic`` loop sends its vote as soon as its gradients exist,
    before the gradient all_reduce, as the ``restart`` loop does (trainer.average_gradients;
    it hides the vote's wait behind the all_reduce). A completed vote then no longer proves
    that every shard averaged the step: a member that fails inside the all_reduce after its
    flag went out leaves its shard without the step that the other shards commit, and the
    world falls back to the snapshots, losing a committed step.

    Main's loop with the vote moved, rewritten from its source (a failure to find the
    lines below means the loop changed: update this variant)."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(resilient.Worker.train))
    encode = (
        "vote = encode_vote((nonfinite, self.mismatch, self.plan_ahead > g.gen),\n"
        "                   len(g.members))\n"
        "riding = self.fp_pending  # the last fingerprint step's fingerprints ride along\n"
        "if riding is not None:\n"
        "    vote = torch.cat([vote, encode_fingerprint(riding[1], world_rank,\n"
        "                                               len(g.members))])\n"
    )
    average = (
        "g.dp.allreduce([flat]).wait()\n"
        "self.average(flat, live)\n"
        "nonfinite = not all_finite(flat)\n"
    )
    indent = " " * 8  # the loop's body, in the dedented method
    encode, average = (textwrap.indent(text, indent) for text in (encode, average))
    send = indent + "g.star.sum(vote)\n"
    for text in (encode, average, send):
        if source.count(text) != 1:
            raise RuntimeError(f"vote_before_average: the hot_spare loop changed: {text!r}")
    early = (indent + "nonfinite = not all_finite(flat)\n" + encode
             + indent + "g.star.start_sum(vote)\n"
             + textwrap.indent("g.dp.allreduce([flat]).wait()\nself.average(flat, live)\n",
                               indent))
    source = source.replace(encode, "").replace(average, early)
    source = source.replace(send, indent + "g.star.finish_sum(vote)\n")
    namespace = vars(resilient)  # the method's globals are the module's, as before
    assert "train" not in namespace
    exec(compile(source, resilient.__file__, "exec"), namespace)
    resilient.Worker.train = namespace.pop("train")


def vote_digits_base_world(resilient: ModuleType) -> None:
    """The ``hot_spare`` / ``elastic`` vote packs its three flags as digits of base ``world``
    instead of ``world + 1`` (an off-by-one: a digit counts the ranks that raised a flag,
    0 to ``world``). While only some ranks raise a flag, every digit fits and the vote reads
    right. When every rank raises the same one, its digit carries into the next: "not
    finite" from every rank reads as "fingerprints differed" (a rollback instead of a
    skipped step), "fingerprints differed" from every rank as "a new plan is waiting"."""
    import math

    import torch

    def encode(flags: tuple[bool, bool, bool], world: int) -> Any:
        base = max(world, 2)  # (a world of one would have no digits at all)
        code = int(flags[0]) + int(flags[1]) * base + int(flags[2]) * base * base
        return torch.tensor([float(code)], dtype=torch.float64)

    def decode(total: Any, world: int) -> tuple[bool, bool, bool]:
        value = float(total[0])
        if math.isnan(value) or value <= 0:
            return (False, False, False)
        if math.isinf(value):
            return (True, True, True)
        base, code = max(world, 2), round(value)
        return (code % base > 0, (code // base) % base > 0, code // (base * base) > 0)

    resilient.encode_vote, resilient.decode_vote = encode, decode


def switch_unless_unanimous(resilient: ModuleType) -> None:
    """The vote's third flag ("a newer plan is waiting: stop this generation at the end of
    the step") is read as a count compared against the world, ``0 < count < world``, not
    ``count > 0``: written for "some member saw the plan and the others must follow", it
    forgets the case where every member raised it at once. A step where every rank asks to
    stop then goes on in the old generation, and so does every step after it."""
    import math

    decode = resilient.decode_vote

    def broken(total: Any, world: int) -> tuple[bool, bool, bool]:
        bad, mismatch, ahead = decode(total, world)
        value = float(total[0])
        if ahead and math.isfinite(value):  # (a corrupted vote reads as before)
            base = world + 1
            ahead = 0 < round(value) // (base * base) < world
        return bad, mismatch, ahead

    resilient.decode_vote = broken


def survivors_keep_state(resilient: ModuleType) -> None:
    """When every replica of some shard is gone, only the members that hold no trained
    state (the spares) load the controller's snapshots; the survivors of the other shards
    keep their own state ("it is newer, and nothing happened to it") while the world resumes
    at the snapshot's step. With a snapshot every step that state *is* the snapshot's; with
    sparser snapshots the survivors apply the steps since the snapshot a second time."""
    restore = resilient.Worker.restore_snapshots

    def broken(self: Any, g: Any) -> int:
        own = self.kept.copy(self.tensors()) if self.state_gen >= 0 else None
        resume = restore(self, g)
        if own is not None:
            self.load_flat(own)
            self.kept.drop(own)
        return resume

    resilient.Worker.restore_snapshots = broken


def own_newest_snapshot(resilient: ModuleType) -> None:
    """Every member resumes at the newest step that every shard has a snapshot of, but
    loads its own shard's newest snapshot. While a snapshot round always completes (a
    snapshot every step, faults between rounds) the two are the same step; when a shard is
    lost in the middle of a round, the other shards' newest stand a round ahead and their
    members load a state of a later step than the one they resume at."""
    restore = resilient.Worker.restore_snapshots

    def broken(self: Any, g: Any) -> int:
        resume = restore(self, g)
        held = self.read_snapshot(g.rank % self.cfg.shards)
        self.load_flat(held[max(held)])
        return resume

    resilient.Worker.restore_snapshots = broken


def older_common_snapshot(resilient: ModuleType) -> None:
    """When every holder of a shard is gone, every member goes back to the *oldest* step that
    every shard still has a snapshot of (the controller keeps two per shard), "the one
    surely complete", not the newest. The state is consistent (every member loads that
    step, and the membership log says so, so the replay agrees), but a snapshot interval
    more of committed work is done again than the interval leaves unsaved."""
    probe = resilient.probe

    def broken(self: Any, g: Any) -> int:
        shards = self.cfg.shards
        snaps = [self.read_snapshot(s) for s in range(shards)]
        common = set(snaps[0]).intersection(*snaps[1:])
        if not common:
            raise SystemExit("no live replica and no complete snapshot for some shard")
        resume = min(common)
        shard = g.rank % shards
        self.load_flat(snaps[shard][resume])
        probe.checkpoint_loaded(resume, f"peer-memory snapshot of shard {shard}", rank=g.rank,
                                generation=g.gen)
        return resume

    resilient.Worker.restore_snapshots = broken


def fence_by_pid(controller: ModuleType) -> None:
    """The controller fences a silent member by SIGKILL to the pid it reported, wherever the
    member runs. On one host that is right; a member on another node reported its pid in its
    own PID namespace, which names some other process of the controller's node, or none."""
    import contextlib
    import signal

    def broken(self: Any, proc: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.alive = False

    controller.Controller.fence = broken


def fresh_after_requeue(checkpoint: ModuleType) -> None:
    """A job that Slurm requeued (``SLURM_RESTART_COUNT`` > 0) starts over: it looks for its
    checkpoints under a folder of the new run instance, so it finds none (tests/slurm/)."""
    load_latest = checkpoint.load_latest

    def fresh(root: Any, meta: Any, group: Any) -> Any:
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            _announce("fresh_after_requeue")
            return load_latest(Path(root) / f"requeue_{os.environ['SLURM_RESTART_COUNT']}",
                               meta, group)
        return load_latest(root, meta, group)

    checkpoint.load_latest = fresh


def fresh_after_restart(checkpoint: ModuleType) -> None:
    """Ranks that torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` > 0) start over: they
    look for their checkpoints under a folder of the new attempt, so they find none
    (tests/slurm/)."""
    load_latest = checkpoint.load_latest

    def fresh(root: Any, meta: Any, group: Any) -> Any:
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if count > 0:
            _announce("fresh_after_restart")
            return load_latest(Path(root) / f"restart_{count}", meta, group)
        return load_latest(root, meta, group)

    checkpoint.load_latest = fresh


def dies_with_slurmd(checkpoint: ModuleType) -> None:
    """Each rank exits once its node's slurmd is gone, as a job whose health check takes a
    missing slurmd for a dead node does: it cannot ride out ``slurm.kill_slurmd``. A node of
    the test cluster is a container with its own process namespace, so ``/proc`` there shows
    that node's slurmd only (tests/slurm/)."""
    import threading
    import time

    def slurmd_seen() -> bool:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if entry.joinpath("comm").read_text().strip() in ("slurmd", "slurmd-wlm"):
                        return True
                except OSError:
                    continue
        return False

    def watch() -> None:
        if not slurmd_seen():
            return  # not on a node of the test cluster: nothing to watch
        while slurmd_seen():
            time.sleep(0.2)
        _announce("dies_with_slurmd: slurmd gone, exiting")
        os._exit(1)

    threading.Thread(target=watch, name="dies_with_slurmd", daemon=True).start()


BUGS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "fresh_after_requeue": ("aftershock.reference_impl.checkpoint", fresh_after_requeue),
    "fresh_after_restart": ("aftershock.reference_impl.checkpoint", fresh_after_restart),
    "dies_with_slurmd": ("aftershock.reference_impl.checkpoint", dies_with_slurmd),
    "prune_before_commit": ("aftershock.reference_impl.checkpoint", prune_before_commit),
    "quarantine_on_failed_agreement": (
        "aftershock.reference_impl.checkpoint",
        quarantine_on_failed_agreement,
    ),
    "lineage_per_sync": ("aftershock.reference_impl.resilient", lineage_per_sync),
    "vote_alone": ("aftershock.reference_impl.trainer", vote_alone),
    "stale_snapshot": ("aftershock.reference_impl.resilient", stale_snapshot),
    "full_average": ("aftershock.reference_impl.resilient", full_average),
    "snapshot_without_optimizer": (
        "aftershock.reference_impl.resilient",
        snapshot_without_optimizer,
    ),
    "fence_by_pid": ("aftershock.reference_impl.controller", fence_by_pid),
    "vote_before_average": ("aftershock.reference_impl.resilient", vote_before_average),
    "vote_digits_base_world": ("aftershock.reference_impl.resilient", vote_digits_base_world),
    "survivors_keep_state": ("aftershock.reference_impl.resilient", survivors_keep_state),
    "own_newest_snapshot": ("aftershock.reference_impl.resilient", own_newest_snapshot),
    "switch_unless_unanimous": ("aftershock.reference_impl.resilient", switch_unless_unanimous),
    "older_common_snapshot": ("aftershock.reference_impl.resilient", older_common_snapshot),
}


# --- patch on import --------------------------------------------------------------------------


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``module`` like the regular finders do, then patches it right after it ran."""

    def __init__(self, name: str, module: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.module, self.patch = name, module, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.patch(module)
            _announce(self.name)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


#: The same switch for a search (tests/test_explore_broken_recovery.py): the fault-free twin
#: goes without ``AFTERSHOCK_INJECT_*`` variables (``Scenario.without_faults``), so it is the
#: correct trainer.
EXPLORE_BUG_ENV = "AFTERSHOCK_INJECT_TEST_BUG"


def _install() -> None:
    name = os.environ.get(BUG_ENV) or os.environ.get(EXPLORE_BUG_ENV)
    if not name:
        return
    if name not in BUGS:
        raise SystemExit(
            f"{BUG_ENV}={name!r}: no such broken variant (known: {', '.join(sorted(BUGS))})"
        )
    module, patch = BUGS[name]
    sys.meta_path.insert(0, _PatchOnImport(name, module, patch))


_install()
