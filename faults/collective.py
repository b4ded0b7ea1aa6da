"""Faults applied inside the target by its probe: collective.* and process.hang.

The harness arms them through the run's command file; the probe in each rank applies
them at the exact call or fault point (faults/inproc.py, which runs in the target).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field

from aftershock.faults._proc import ProcessRef
from aftershock.faults.inproc import COLLECTIVES, arm, release, validate_release
from aftershock.faults.journal import Journal, UndoContext
from aftershock.faults.params import MAX_INDEX, MAX_SEED, MAX_STEPS, Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

Collective = Literal[
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "gather", "scatter", "any",
]


class CollectiveParams(FaultParams):
    op: Collective = Field("all_reduce", description="which torch.distributed op (any: every op)")
    call: int = Field(1, ge=1, le=MAX_STEPS,
                      description="the k-th matching call at or after the trigger")


class ProcessHangParams(FaultParams):
    duration: Duration | None = Field(
        None, description="release after this long; default: at the end of the run")


class HangParams(CollectiveParams):
    duration: Duration | None = Field(
        None, description="release after this long; default: at the end of the run")


class DelayParams(CollectiveParams):
    delay: Duration = Field(timedelta(seconds=1), description="how late the call starts")


class CorruptParams(CollectiveParams):
    mode: Literal["nan", "inf", "zero", "bitflip"] = Field(
        "nan", description="what the result's element becomes")
    index: int | None = Field(None, ge=0, le=MAX_INDEX,
                              description="the element (flat index); default: seeded")
    bit: int | None = Field(None, ge=0, le=63, description="bitflip: the bit; default: the "
                            "top exponent bit")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed for the element")


_CAUSED_BY = (
    "the probe wraps the target's process-group objects (torchft's FakeProcessGroupWrapper "
    "pattern; groups a trainer builds itself, through aftershock.probe.wrap_group) and "
    "torch.distributed's collective functions (the groups it keeps in its own tables), Gloo "
    "and NCCL alike, and acts on the `call`-th matching call of `op` on the target rank, at or "
    "after `at: {step}`; with `at.phase`, only calls made after that fault point of the step "
    "count (`phase: backward`: the gradient all_reduce, not the forward pass's); the target "
    "must call aftershock.probe.install() (torch.distributed's groups) or "
    "aftershock.probe.wrap_group() on each group it builds."
)


class _Collective:
    info: KindInfo
    params: type[CollectiveParams] = CollectiveParams
    acts: Acts = "inside"
    needs = frozenset({"probe"})
    revertible = False

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        self.params.bind(params)  # a bad op or call fails here, not in the target
        return arm(self.info.kind, target, params, journal, revertible=self.revertible)

    def revert(self, undo: Mapping[str, Any]) -> None:
        release(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        validate_release(undo, context)


class CollectiveError(_Collective):
    info = KindInfo("collective.error", "The chosen collective call raises, as a backend "
                    "error would (RuntimeError).", _CAUSED_BY)


class CollectiveHang(_Collective):
    params = HangParams
    revertible = True
    info = KindInfo("collective.hang", "The chosen collective call never returns until "
                    "healed: a wedged communicator.", _CAUSED_BY,
                    reverted_by="the hang is released")


class CollectiveDelay(_Collective):
    params = DelayParams
    info = KindInfo("collective.delay", "The chosen collective call starts late: a slow link "
                    "or a straggling peer, where tc netem is unavailable.", _CAUSED_BY)


class CollectiveCorrupt(_Collective):
    params = CorruptParams
    info = KindInfo("collective.corrupt", "The chosen collective completes, then its result "
                    "is poisoned on the target rank (silent data corruption).", _CAUSED_BY)


class ProcessHang:
    """The target's own loop stops at a fault point while the rest of it runs on."""

    params = ProcessHangParams
    acts: Acts = "inside"
    needs = frozenset({"probe"})
    info = KindInfo(
        kind="process.hang",
        summary="The target's loop blocks at a fault point (a step and phase) until healed, "
        "while its other threads (heartbeats, sockets) run on: a wedged decode step, a "
        "deadlocked loop, a device call that never returns. Unlike process.freeze, a "
        "heartbeat alone does not see it; progress checks must.",
        caused_by="the probe blocks the thread that calls aftershock.probe.fault_point() "
        "at the "
        "first point matching `at` (`step`, `phase`) after arming; the target must call "
        "aftershock.probe.install().",
        reverted_by="the blocked thread is released",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        return arm(self.info.kind, target, params, journal, revertible=True)

    def revert(self, undo: Mapping[str, Any]) -> None:
        release(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        validate_release(undo, context)


PROCESS_HANG = register(ProcessHang())
COLLECTIVE_ERROR = register(CollectiveError())
COLLECTIVE_HANG = register(CollectiveHang())
COLLECTIVE_DELAY = register(CollectiveDelay())
COLLECTIVE_CORRUPT = register(CollectiveCorrupt())

__all__ = [
    "COLLECTIVES",
    "COLLECTIVE_CORRUPT",
    "COLLECTIVE_DELAY",
    "COLLECTIVE_ERROR",
    "COLLECTIVE_HANG",
    "PROCESS_HANG",
]
