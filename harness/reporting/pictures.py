"""What `aftershock report` and `run --html/--trace` do with recorded runs: tables, re-checks,
the HTML report and the trace. The CLI stays thin; this module holds the order of things."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text

from aftershock.harness.errors import AftershockError
from aftershock.harness.run.rundir import RecordedRun, find_runs, load_run


def write_pictures(run_dirs: list[Path], *, html: Path | None, trace: Path | None,
                   clock: str = "run", runs: list[RecordedRun] | None = None,
                   notes: list[list[str]] | None = None) -> list[str]:
    """Write the HTML report and/or the trace of these runs; the problems, as lines (a run
    that cannot be drawn must not lose the others' records)."""
    problems: list[str] = []
    try:
        loaded = runs if runs is not None else [load_run(d) for d in run_dirs]
    except AftershockError as exc:
        return [f"aftershock: no HTML or trace: {exc}"]
    if html is not None:
        from aftershock.harness.reporting.html import write_html

        try:
            write_html(loaded, html, notes=notes or [])
        except (AftershockError, OSError) as exc:
            problems.append(f"aftershock: cannot write {html}: {exc}")
    if trace is not None:
        from aftershock.harness.reporting.trace import write_trace

        try:
            write_trace(loaded, trace, clock=clock)
        except OSError as exc:
            problems.append(f"aftershock: cannot write {trace}: {exc}")
    return problems


def _rechecked(path: Path, scenario: Path | None) -> tuple[RecordedRun, list[str]]:
    """The recorded run at ``path`` judged again, and what the re-check says."""
    from aftershock.harness.verdict.recheck import recheck as judge_again

    again = judge_again(path, scenario=scenario)
    run = RecordedRun(path=path, result=again.result, events=list(again.events),
                      scenario_text=again.scenario_text)
    changed = [f"{name}: {then} -> {now}" for name, then, now in again.changed()]
    return run, [*again.notes, *(f"re-checked: {c}" for c in changed)]


def _print_notes(runs: list[RecordedRun], notes: list[list[str]], out: Console, *,
                 recheck: bool) -> None:
    for run, said in zip(runs, notes, strict=True):
        prefix = f"{run.result.name}: " if len(runs) > 1 else ""
        for line in said:
            out.print(Text(prefix + line), highlight=False)
        if recheck and not any(line.startswith("re-checked:") for line in said):
            out.print(Text(prefix + "re-checked: no verdict changed"), highlight=False)


def show_runs(paths: list[Path], *, out: Console, err: Console, recheck: bool,
              scenario: Path | None, html: Path | None, trace: Path | None,
              clock: str) -> bool:
    """Print the runs (one: its check table; several: compared), re-checked if asked, and
    write the HTML and trace. True when every run passed."""
    from aftershock.harness.reporting.compare import compare, render_comparison
    from aftershock.harness.reporting.report import render_result

    dirs = find_runs(paths)
    runs: list[RecordedRun] = []
    notes: list[list[str]] = []
    for path in dirs:
        run, said = _rechecked(path, scenario) if recheck else (load_run(path), [])
        runs.append(run)
        notes.append(said)
    if len(runs) == 1:
        render_result(runs[0].result, out)
    else:
        render_comparison(compare([r.result for r in runs]), out)
    _print_notes(runs, notes, out, recheck=recheck)
    if trace is not None and clock == "wall":
        from aftershock.harness.errors import SpecError

        missing = [str(r.path) for r in runs if r.wall_offset is None]
        if missing:
            raise SpecError([f"{m}:1:1: the run recorded no wall-clock offset (runs recorded "
                             "before it was kept); use --clock run" for m in missing])
    for problem in write_pictures(dirs, html=html, trace=trace, clock=clock, runs=runs,
                                  notes=notes):
        err.print(problem, markup=False, highlight=False)
    return all(r.result.passed for r in runs)
