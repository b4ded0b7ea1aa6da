"""Process faults: kill with any signal, terminate with a grace period, freeze and thaw."""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from pydantic import Field, field_validator

from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, UndoContext
from aftershock.faults.params import Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

_SIGNALS = sorted(s.name for s in signal.Signals if not s.name.startswith("SIG_"))


class KillParams(FaultParams):
    signal: str = Field("SIGKILL", description="the signal, by name (SIGTERM, TERM, ...)")

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in _SIGNALS:
            raise ValueError(f"unknown signal {value!r} (allowed: {', '.join(_SIGNALS)})")
        return name


class TermParams(FaultParams):
    grace: Duration = Field(timedelta(seconds=5), description="time allowed to exit cleanly")


class FreezeParams(FaultParams):
    duration: Duration | None = Field(
        None, description="thaw after this long; default: at the end of the run")


class Kill:
    params = KillParams
    acts: Acts = "either"
    inside_when = "with `at.phase`"
    needs = frozenset({"signals"})
    info = KindInfo(
        kind="process.kill",
        summary="Send a signal to the target process (SIGKILL by default).",
        caused_by="kill(2) with the chosen signal on the rank's pid, checked against its "
        "start time so a reused pid is never hit. With `at: {step, phase}` the probe inside "
        "the target sends it to its own process at that fault point (e.g. `phase: save`, "
        "between a checkpoint's shard writes and its commit), a moment no outside trigger "
        "can hit; the target must call aftershock.probe.install().",
    )

    def inside(self, params: FaultParams, phase: str | None) -> bool:
        return phase is not None

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        if params.get("phase"):
            from aftershock.faults import inproc

            return inproc.arm(self.info.kind, target, params, journal)
        sig = signal.Signals[KillParams.bind(params).signal]
        sent = target.signal(sig)
        detail = f"{sig.name} -> pid {target.pid}" + ("" if sent else " (already gone)")
        return Applied(self.info.kind, None, {}, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class Term:
    params = TermParams
    acts: Acts = "outside"
    needs = frozenset({"signals"})
    info = KindInfo(
        kind="process.term",
        summary="SIGTERM, then SIGKILL if the process is still alive after a grace period.",
        caused_by="kill(2) with SIGTERM, and a timer that sends SIGKILL after `grace`.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        grace = TermParams.bind(params).grace.total_seconds()
        sent = target.signal(signal.SIGTERM)

        def escalate() -> None:
            if target.alive():
                target.signal(signal.SIGKILL)

        timer = threading.Timer(grace, escalate)
        timer.daemon = True
        timer.start()
        detail = f"SIGTERM -> pid {target.pid}, SIGKILL after {grace:g}s"
        return Applied(self.info.kind, None, {}, detail + ("" if sent else " (already gone)"))

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class Freeze:
    params = FreezeParams
    acts: Acts = "outside"
    needs = frozenset({"signals"})
    info = KindInfo(
        kind="process.freeze",
        summary="Stop the process (SIGSTOP) until healed: a hung rank, as the kernel sees one.",
        caused_by="kill(2) with SIGSTOP; the process keeps its sockets but never answers.",
        reverted_by="SIGCONT to the same process (pid and start time).",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        undo = target.to_json()
        entry = journal.intend(self.info.kind, undo)
        sent = target.signal(signal.SIGSTOP)
        detail = f"SIGSTOP -> pid {target.pid}" + ("" if sent else " (already gone)")
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        ProcessRef.from_json(dict(undo)).signal(signal.SIGCONT)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        context.process(undo)


KILL = register(Kill())
TERM = register(Term())
FREEZE = register(Freeze())
