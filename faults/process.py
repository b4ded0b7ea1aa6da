"""Process faults: kill with any signal, terminate with a grace period, freeze and thaw."""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from typing import Any

from faults._proc import ProcessRef
from faults.journal import Journal, UndoContext
from faults.registry import Applied, KindInfo, register


class Kill:
    info = KindInfo(
        kind="process.kill",
        summary="Send a signal to the target process (SIGKILL by default).",
        caused_by="kill(2) with the chosen signal on the rank's pid, checked against its "
        "start time so a reused pid is never hit. With `at: {step, phase}` the probe inside "
        "the target sends it to its own process at that fault point (e.g. `phase: save`, "
        "between a checkpoint's shard writes and its commit), a moment no outside trigger "
        "can hit; the target must call harness.probe.install().",
        params={"signal": "signal name, default SIGKILL"},
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        if params.get("phase"):
            from faults import inproc

            return inproc.arm(self.info.kind, target, params, journal)
        sig = signal.Signals[str(params.get("signal", "SIGKILL"))]
        sent = target.signal(sig)
        detail = f"{sig.name} -> pid {target.pid}" + ("" if sent else " (already gone)")
        return Applied(self.info.kind, None, {}, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        return None


class Term:
    info = KindInfo(
        kind="process.term",
        summary="SIGTERM, then SIGKILL if the process is still alive after a grace period.",
        caused_by="kill(2) with SIGTERM, and a timer that sends SIGKILL after `grace`.",
        params={"grace": "time allowed to exit cleanly, default 5s"},
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        grace = float(params.get("grace", 5.0))
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
    info = KindInfo(
        kind="process.freeze",
        summary="Stop the process (SIGSTOP) until healed: a hung rank, as the kernel sees one.",
        caused_by="kill(2) with SIGSTOP; the process keeps its sockets but never answers.",
        params={"duration": "thaw after this long; default: at the end of the run"},
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
