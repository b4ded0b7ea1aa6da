"""``process.straggle``: one slow rank, as a thermally throttled or oversubscribed host makes it.

With the cgroup v1 ``cpu`` controller the process is moved into a group of
its own whose CFS quota lets it run ``cpus / factor`` CPUs' worth of time per
period. Without it, a thread in the harness stops and continues the process
(SIGSTOP/SIGCONT) on a duty cycle; the journal records the process, so a heal
after the harness died sends the final SIGCONT.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from aftershock.faults import _cgroup
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, UndoContext, UndoRefused, undone_on_error
from aftershock.faults.params import Duration, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

PERIOD_US = 100_000  # CFS period; 100 ms is the kernel default and keeps stalls short
MIN_QUOTA_US = 1_000  # the kernel refuses quotas below 1 ms

# Duty-cycle threads of this process, by token, so an in-process revert can stop
# its thread before the final SIGCONT (a heal from another process finds none).
_cyclers: dict[str, tuple[threading.Event, threading.Thread]] = {}


def _cycle(target: ProcessRef, factor: float, period_s: float, quit_: threading.Event) -> None:
    """Let the process run ``period_s / factor``, then stop it for as long as it actually ran
    times ``factor - 1``. The thread wakes late on a busy machine (or behind the GIL), so the
    runs are often longer than asked; sizing each stop from the run it follows keeps the share
    of wall time at 1/factor whatever the lateness."""
    run_s = period_s / factor
    # Each run is timed from before the SIGCONT that starts it to after the SIGSTOP that ends
    # it: any lateness of this thread in between (a /proc read releases the GIL) is counted.
    resumed = time.monotonic()
    try:
        while True:
            if quit_.wait(run_s) or not target.signal(signal.SIGSTOP):
                break
            ran = time.monotonic() - resumed
            if quit_.wait(ran * (factor - 1)):
                break
            resumed = time.monotonic()
            if not target.signal(signal.SIGCONT):
                break
    finally:
        target.signal(signal.SIGCONT)


class StraggleParams(FaultParams):
    factor: float = Field(4.0, gt=1.0, le=1000,
                          description="how many times slower (4: a quarter of the CPU time)")
    cpus: float = Field(1.0, gt=0, le=1024,
                        description="CPUs the process would use unthrottled, for the quota")
    method: Literal["auto", "cgroup", "signal"] = Field(
        "auto", description="cgroup: a CPU quota; signal: SIGSTOP/SIGCONT on a duty cycle; "
        "auto: cgroup where this machine has the controller")
    duration: Duration | None = Field(
        None, description="end the slowdown after this long; default: at the end of the run")


class Straggle:
    params = StraggleParams
    acts: Acts = "outside"
    needs = frozenset({"signals"})
    info = KindInfo(
        kind="process.straggle",
        summary="Slow the target process down by a factor while it keeps running.",
        caused_by="cgroup v1 `cpu` controller: the process (all its threads, and children it "
        "starts later) is moved into /sys/fs/cgroup/cpu/<its group>/aftershock_<id> with "
        "cpu.cfs_quota_us = cpu.cfs_period_us × cpus / factor. Fallback (method: signal, or "
        "auto without the controller): SIGSTOP/SIGCONT on a 100 ms duty cycle; a run that "
        "overran (the harness thread woke late) is paid for by a longer stop, so the share "
        "stays 1/factor.",
        reverted_by="move the process back to its original cpu group and remove the fault's "
        "group (cgroup); or stop the duty cycle and SIGCONT (signal).",
    )

    def preflight(self, params: Mapping[str, Any]) -> list[str]:
        if StraggleParams.bind(params).method != "cgroup":
            return []  # auto falls back to SIGSTOP/SIGCONT, which needs nothing
        mount = _cgroup.v1_mount("cpu")
        if mount is None or not _cgroup.writable(mount):
            return ["method: cgroup needs a writable cgroup v1 cpu controller "
                    "(/sys/fs/cgroup/cpu, as root); method: auto falls back to SIGSTOP/SIGCONT"]
        return []

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        bound = StraggleParams.bind(params)
        factor, method = bound.factor, bound.method
        mount = _cgroup.v1_mount("cpu")
        usable = mount is not None and _cgroup.writable(mount)
        if method == "cgroup" and not usable:
            raise FaultUnavailable("no writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu)")
        token = uuid.uuid4().hex[:12]
        if method != "signal" and mount is not None and usable:
            return self._cgroup(target, factor, bound.cpus, mount, token, journal)
        return self._signal(target, factor, token, journal)

    def _cgroup(
        self,
        target: ProcessRef,
        factor: float,
        cpus: float,
        mount: Path,
        token: str,
        journal: Journal,
    ) -> Applied:
        home = _cgroup.group_of(target.pid, "cpu")
        if home is None:
            return Applied(self.info.kind, None, {}, f"pid {target.pid} already gone")
        group_dir = _cgroup.directory(mount, f"{home.rstrip('/')}/aftershock_{token}")
        undo = {
            "method": "cgroup",
            "cgroup": str(group_dir),
            "home": str(_cgroup.directory(mount, home)),
            "root": str(mount),
        }
        quota = max(MIN_QUOTA_US, round(PERIOD_US * cpus / factor))
        entry = journal.intend(self.info.kind, undo)
        with undone_on_error(journal, entry, self.revert, undo):
            group_dir.mkdir()
            (group_dir / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (group_dir / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            # cgroup.procs (not tasks) moves every thread of the process at once.
            if target.alive():
                _cgroup.move(target.pid, group_dir)
        detail = f"pid {target.pid} limited to {quota}/{PERIOD_US} us of CPU per period"
        return Applied(self.info.kind, entry, undo, detail)

    def _signal(self, target: ProcessRef, factor: float, token: str, journal: Journal) -> Applied:
        undo = {"method": "signal", "token": token, **target.to_json()}
        entry = journal.intend(self.info.kind, undo)
        run_s = 0.1 / factor
        quit_ = threading.Event()
        thread = threading.Thread(
            target=_cycle,
            args=(target, factor, 0.1, quit_),
            name=f"aftershock-straggle-{target.pid}",
            daemon=True,
        )
        _cyclers[token] = (quit_, thread)
        thread.start()
        detail = (f"pid {target.pid} runs {run_s * 1000:.0f} ms of every 100 ms (SIGSTOP/SIGCONT; "
                  "a late run is paid for by a longer stop)")
        return Applied(self.info.kind, entry, undo, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        if undo.get("method") == "signal":
            cycler = _cyclers.pop(str(undo["token"]), None)
            if cycler is not None:
                cycler[0].set()
                cycler[1].join()
            ProcessRef.from_json({"pid": int(undo["pid"]), "start": int(undo["start"])}).signal(
                signal.SIGCONT
            )
            return
        _cgroup.remove(Path(undo["cgroup"]), Path(undo["home"]), Path(undo["root"]))

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        method = undo.get("method")
        if method == "signal":
            if not isinstance(undo.get("token"), str):
                raise UndoRefused("a signal straggle without its token")
            context.process(undo)
        elif method == "cgroup":
            context.cgroup(undo, _cgroup.v1_mount("cpu"))
        else:
            raise UndoRefused(f"method {method!r} is neither signal nor cgroup")


STRAGGLE = register(Straggle())
