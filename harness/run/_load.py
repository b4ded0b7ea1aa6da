"""How starved the machine was during a run: evidence for reading a latency verdict.

A user's CI runner is often overloaded; a recovery that took 9 s on a quiet machine takes
90 s there. A latency check that fails on a starved machine must say so, so a user can
tell load from a slow recovery (correctness checks never depend on load). While the system
runs, a monitor thread measures, every ``PERIOD_S``:

- the harness's own timer slip: how much later than asked its own sleep returned (what a
  starved harness does to every time it stamps);
- CPU pressure (Linux PSI, ``/proc/pressure/cpu``): the share of the time in which some
  runnable task of the machine waited for a CPU, and the same for the run's own cgroup
  (``cpu.pressure``) where it has one: how long the job's processes waited to run.

Each ``REPORT_S`` it writes a ``machine_load`` event with what it saw since the last one
(docs/events.md); :func:`summary` turns them into the run's metrics, and
:func:`starved_note` into the sentence a failing latency check carries.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aftershock.harness.run.records import Event
from aftershock.harness.run.timeline import Timeline

MACHINE_LOAD = "machine_load"
PERIOD_S = 0.1
REPORT_S = 2.0
SYSTEM_PRESSURE = Path("/proc/pressure/cpu")

#: What counts as starved: the job's processes (or, without a group, the machine's) waited
#: for a CPU at least this share of the run, or the harness's own timer slipped this much.
STARVED_PRESSURE = 0.25
STARVED_SLIP_S = 0.5

#: Checks whose verdict is a time, which load can stretch (every other check is correctness).
LATENCY_CHECKS = frozenset({"time_to_detect", "time_to_recover", "step_rate", "ttft_p50",
                            "ttft_p99", "tpot_p50", "tpot_p99"})


def _stall_us(path: Path) -> int | None:
    """The ``some`` total (microseconds some task waited for a CPU) of a PSI file."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                return int(fields["total"])
    return None


class LoadMonitor:
    """Samples timer slip and CPU pressure while a run's system runs (module docstring)."""

    def __init__(self, timeline: Timeline, group: Path | None) -> None:
        self._timeline = timeline
        self._group = None if group is None else group / "cpu.pressure"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, with a last report; a monitor that never started (the launch failed) has
        nothing to stop."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=2 * REPORT_S)

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # an observer that fails is never the run's end
            begun = time.monotonic()
            system, group = _stall_us(SYSTEM_PRESSURE), self._read_group()
            slip = 0.0
            while True:
                asked = time.monotonic()
                stopping = self._stop.wait(PERIOD_S)
                now = time.monotonic()
                if not stopping:
                    slip = max(slip, now - asked - PERIOD_S)
                if stopping or now - begun >= REPORT_S:
                    system, group = self._report(begun, now, slip, system, group)
                    begun, slip = now, 0.0
                if stopping:
                    return

    def _read_group(self) -> int | None:
        return None if self._group is None else _stall_us(self._group)

    def _report(self, begun: float, now: float, slip: float, system: int | None,
                group: int | None) -> tuple[int | None, int | None]:
        window = now - begun
        system_now, group_now = _stall_us(SYSTEM_PRESSURE), self._read_group()
        fields: dict[str, Any] = {"window_s": round(window, 3),
                                  "timer_slip_max_s": round(max(0.0, slip), 4)}
        for key, before, after in (("cpu_pressure", system, system_now),
                                   ("job_cpu_pressure", group, group_now)):
            if before is not None and after is not None and window > 0:
                fields[key] = round(min(1.0, max(0.0, (after - before) / 1e6 / window)), 4)
        if window > 0:
            self._timeline.write(Event(t=now, event=MACHINE_LOAD, source="harness",
                                       fields=fields))
        return system_now, group_now


def summary(events: Sequence[Event]) -> dict[str, float | None]:
    """The run's starvation metrics from its ``machine_load`` events: the worst timer slip,
    and the share of the run in which the machine's, and the job's, tasks waited for a CPU
    (None where nothing was measured)."""
    samples = [e for e in events if e.event == MACHINE_LOAD]
    slips = [float(e.fields["timer_slip_max_s"]) for e in samples
             if isinstance(e.fields.get("timer_slip_max_s"), int | float)]
    out: dict[str, float | None] = {"timer_slip_max_s": max(slips) if slips else None}
    for key in ("cpu_pressure", "job_cpu_pressure"):
        pairs = [(float(e.fields[key]), float(e.fields["window_s"])) for e in samples
                 if isinstance(e.fields.get(key), int | float)
                 and isinstance(e.fields.get("window_s"), int | float)]
        total = sum(w for _, w in pairs)
        out[key] = round(sum(p * w for p, w in pairs) / total, 4) if total > 0 else None
    return out


def starved_note(metrics: dict[str, Any]) -> str | None:
    """The sentence a failing latency check carries when the run was starved, else None."""
    slip = metrics.get("timer_slip_max_s")
    job = metrics.get("job_cpu_pressure")
    machine = metrics.get("cpu_pressure")
    pressure, whose = (job, "the job's processes") if isinstance(job, float) else (
        machine, "the machine's tasks")
    starved_by_slip = isinstance(slip, float) and slip >= STARVED_SLIP_S
    starved_by_pressure = isinstance(pressure, float) and pressure >= STARVED_PRESSURE
    if not (starved_by_slip or starved_by_pressure):
        return None
    parts = []
    if isinstance(slip, float):
        parts.append(f"the harness's own timer slipped up to {slip:.2g} s")
    if isinstance(pressure, float):
        parts.append(f"{whose} waited for a CPU {pressure:.0%} of the run")
    return ("the machine was starved during this run: " + " and ".join(parts)
            + "; a busy machine can stretch this time (docs/metrics.md)")
