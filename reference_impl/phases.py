"""Where a training step's time goes: thread CPU and wall time per phase of the loop.

Off unless ``AFTERSHOCK_PHASES`` is ``FIRST:LAST`` (two step numbers, FIRST < LAST): then
the loop's laps over steps FIRST + 1 to LAST are summed, and once step LAST is done the rank
appends one ``phases`` event to the run's timeline (``aftershock.harness.probe``): the steps
counted and,
per phase, the main thread's CPU and the wall time in nanoseconds. ``make bench`` sets it for
its rows and reports the table (bench/run.py, docs/benchmarks.md). A lap reads two clocks
(about a microsecond); off, it is one attribute test.

A lap charges the time since the previous lap to the phase it names, so every moment of the
loop lands in exactly one phase: ``lap("forward")`` right after the forward pass, and so on;
``step_done`` charges what is left to ``rest``. A step computed again (a vote that said no)
adds to the same phases, and its step is counted once.
"""

from __future__ import annotations

import os
import time

from aftershock.harness import probe

ENV = "AFTERSHOCK_PHASES"
EVENT = "phases"


def parse(spec: str) -> tuple[int, int]:
    """``FIRST:LAST`` as two steps; ValueError, saying what is wrong, for anything else."""
    first, sep, last = spec.partition(":")
    try:
        window = int(first), int(last)
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ValueError(f"{ENV}={spec!r}: expected FIRST:LAST, two step numbers with "
                         "0 <= FIRST < LAST (e.g. 20:295)")
    return window


class Laps:
    """The lap timer of one rank's training loop (module docstring)."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV) if spec is None else spec
        self.on = bool(spec)
        self.first, self.last = parse(spec) if spec else (0, 0)
        self.counting = False
        self.totals: dict[str, list[int]] = {}
        self._cpu = self._wall = 0
        if self.on:
            self._cpu, self._wall = time.thread_time_ns(), time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        if not self.on:
            return
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        if self.counting:
            total = self.totals.setdefault(phase, [0, 0])
            total[0] += cpu - self._cpu
            total[1] += wall - self._wall
        self._cpu, self._wall = cpu, wall

    def step_done(self, step: int) -> None:
        """Step ``step`` is committed: the rest of its time goes to ``rest``; the window
        opens after step FIRST and is reported, once, after step LAST."""
        if not self.on:
            return
        self.lap("rest")
        if step == self.first:
            self.totals.clear()
            self.counting = True
        elif step >= self.last and self.counting:
            probe.emit(EVENT, first=self.first, last=self.last, steps=self.last - self.first,
                       phases={name: {"cpu_ns": cpu, "wall_ns": wall}
                               for name, (cpu, wall) in self.totals.items()})
            self.on = self.counting = False
