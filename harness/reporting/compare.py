"""Many runs side by side: per metric the median and spread, and which run failed which check.

`aftershock report DIR...` and the HTML of a ``--repeat`` use it. Each metric's
statistics are over the runs that measured it; how many did is shown, so a median
of 2 out of 10 runs is not mistaken for one of 10.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from aftershock.harness.run.records import RunResult


@dataclass(frozen=True, slots=True)
class Spread:
    metric: str
    values: tuple[float | int | None, ...]  # one per run, in the runs' order

    @property
    def measured(self) -> list[float]:
        return [float(v) for v in self.values if isinstance(v, int | float)]

    @property
    def median(self) -> float | None:
        return statistics.median(self.measured) if self.measured else None

    @property
    def low(self) -> float | None:
        return min(self.measured) if self.measured else None

    @property
    def high(self) -> float | None:
        return max(self.measured) if self.measured else None


@dataclass(frozen=True, slots=True)
class Comparison:
    runs: tuple[RunResult, ...]
    spreads: tuple[Spread, ...]
    checks: tuple[str, ...]  # every check name any run had, in first-seen order

    def verdict(self, run: RunResult, check: str) -> bool | None:
        """PASS, FAIL, or None when the run had no such check."""
        return next((c.passed for c in run.checks if c.name == check), None)

    def failures(self) -> dict[str, list[int]]:
        """Check -> the (0-based) runs that failed it."""
        return {check: [i for i, r in enumerate(self.runs) if self.verdict(r, check) is False]
                for check in self.checks}


def compare(runs: Sequence[RunResult]) -> Comparison:
    names: list[str] = []
    checks: list[str] = []
    for r in runs:
        names.extend(k for k in r.metrics if k not in names)
        checks.extend(c.name for c in r.checks if c.name not in checks)
    spreads = tuple(Spread(name, tuple(r.metrics.get(name) for r in runs)) for name in names)
    return Comparison(tuple(runs), spreads, tuple(checks))


def show(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if not float(value).is_integer() else str(int(value))


def render_comparison(comparison: Comparison, console: Console) -> None:
    """Two narrow tables (they fit 80 columns): metrics, then checks by run."""
    n = len(comparison.runs)
    table = Table(title=f"{n} runs", title_justify="left")
    for column, justify in (("metric", "left"), ("median", "right"), ("min", "right"),
                            ("max", "right"), ("runs", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for s in comparison.spreads:
        table.add_row(Text(s.metric), show(s.median), show(s.low), show(s.high),
                      f"{len(s.measured)}/{n}")
    console.print(table)
    checks = Table(title="checks", title_justify="left")
    checks.add_column("check")
    checks.add_column("passed", justify="right")
    checks.add_column("failed in")
    for check, failed in comparison.failures().items():
        ran = sum(1 for r in comparison.runs if comparison.verdict(r, check) is not None)
        where = ", ".join(f"#{i + 1}" for i in failed)
        checks.add_row(Text(check), f"{ran - len(failed)}/{ran}",
                       Text(where or "-", style="red" if failed else ""))
    console.print(checks)
    for i, r in enumerate(comparison.runs):
        verdict = Text("PASSED", style="green") if r.passed else Text("FAILED", style="red")
        console.print(Text(f"#{i + 1} ").append(verdict).append(f" {r.name} seed {r.seed}: "
                                                                f"{r.run_dir}"))
