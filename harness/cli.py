"""The `aftershock` command line: thin commands over engine functions.

Exit codes (DESIGN.md): 0 all checks hold, 1 a check failed, 2 invalid input,
3 the harness itself failed. Heavy modules are imported inside commands so
``aftershock --help`` stays instant.
"""

from __future__ import annotations

import enum
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(
    name="aftershock",
    help="Fault injection and reliability checks for distributed PyTorch training and serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Off a terminal (CI logs) rich would assume 80 columns and fold the check table. No emoji
# codes: `:smile:` in a scenario name or a log line is data, printed as written.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160, emoji=False)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 160,
              emoji=False)

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_HARNESS = 0, 1, 2, 3


def _show_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("aftershock")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "(not installed: no distribution metadata)"
    out.print(f"aftershock {installed}", markup=False, highlight=False)
    raise typer.Exit(EXIT_OK)


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="print the installed version and exit")] = False,
) -> None:
    pass


def _need_extra(module: str, extra: str, what: str) -> None:
    """Exit 2 with the one line that installs ``module`` where this install lacks it (a core
    install has no extras)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        typer.echo(f"aftershock: {what} needs {module}: pip install 'aftershock[{extra}]'",
                   err=True)
        raise typer.Exit(EXIT_INVALID)


def _fail_invalid(problems: list[str], *, broken: bool = False) -> typer.Exit:
    """Exit 2 after printing ``problems``; 3 (``broken``) when a scenario uses a plug-in that
    was skipped as broken: the installation is at fault, not the scenario."""
    for problem in problems:
        err.print(problem, markup=False, highlight=False)
    return typer.Exit(EXIT_HARNESS if broken else EXIT_INVALID)


def _uses_broken(exc: Exception) -> bool:
    from aftershock.harness.errors import PluginError

    return isinstance(exc, PluginError)


@app.command()
def validate(
    paths: Annotated[
        list[Path], typer.Argument(help="scenario files or folders", readable=False)
    ],
) -> None:
    """Parse and validate scenario files without running anything."""
    from aftershock.harness.errors import SpecError
    from aftershock.harness.scenario.load import find_scenarios, load_scenario

    files, problems = find_scenarios(list(paths))
    broken = False
    for file in files:
        try:
            load_scenario(file)
        except SpecError as exc:
            problems.extend(exc.problems)
            broken = broken or _uses_broken(exc)
        else:
            out.print(f"ok {file}", markup=False, highlight=False)
    if problems:
        raise _fail_invalid(problems, broken=broken)
    if not files:
        raise _fail_invalid([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])


class Executor(enum.StrEnum):
    """Where ``aftershock run`` runs its scenarios."""

    local = "local"
    slurm = "slurm"


@app.command()
def run(
    # readable=False here and below: typer's own check answers an unreadable path with a
    # usage box and no position; the loader names it as path:1:1 like any other problem.
    paths: Annotated[
        list[Path], typer.Argument(help="scenario files or folders", readable=False)
    ],
    json_out: Annotated[
        str | None, typer.Option("--json", help="write the run record as JSON ('-' for stdout)")
    ] = None,
    junit: Annotated[
        Path | None, typer.Option(help="write JUnit XML here", readable=False)
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(help="keep run folders here (default .aftershock/runs/...)", readable=False),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, max=2**32 - 1, help="override every scenario's seed")
    ] = None,
    repeat: Annotated[int, typer.Option(min=1, help="run each scenario N times")] = 1,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="re-run fault-free baselines instead of reusing")
    ] = False,
    plain: Annotated[bool, typer.Option(help="plain lines even on a terminal")] = False,
    html: Annotated[
        Path | None, typer.Option(help="write a self-contained HTML report here")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="write a Chrome trace-event file (Perfetto) here")
    ] = None,
    executor: Annotated[Executor, typer.Option(
        help="where the runs run: here, one after another (local), or each as a task of "
             "one Slurm array job (slurm; docs/scale-out.md)")] = Executor.local,
) -> None:
    """Run scenarios: launch, inject faults, check recovery, report."""
    loaded = _load_all(paths)
    # Before anything runs: a record that cannot be written is lost after the whole run.
    unusable = _check_outputs(json_out=json_out, junit=junit, run_dir=run_dir, html=html,
                              trace=trace)
    if unusable:
        raise _fail_invalid(unusable)

    # Progress goes to stderr when the JSON record goes to stdout.
    console = err if json_out == "-" else out
    results: list[Any] = []
    try:
        if executor is Executor.slurm:
            from aftershock.harness.nodes.slurm_campaign import run_campaign

            results.extend(run_campaign(loaded, run_dir=run_dir, seed=seed, repeat=repeat,
                                        use_cache=not no_cache,
                                        say=lambda line: console.print(line, markup=False)))
        else:
            _run_here(loaded, results, run_dir=run_dir, seed=seed, repeat=repeat,
                      use_cache=not no_cache, console=console,
                      live=console.is_terminal and not plain)
    except BaseException as exc:
        code = _run_stopped(exc, results)
        if code is None:
            raise
        raise typer.Exit(code) from None
    finally:
        _write_records(results, json_out, junit, html)
        _write_pictures(results, html=html, trace=trace)

    failed = [r for r in results if not r.passed]
    summary = f"{len(results) - len(failed)} passed, {len(failed)} failed"
    console.print(summary, style="red" if failed else "green")
    raise typer.Exit(EXIT_FAILED if failed else EXIT_OK)


def _load_all(paths: list[Path]) -> list[Any]:
    """Every scenario under ``paths``, validated; exit 2 (3 for a broken plug-in) naming
    every problem of every file otherwise."""
    from aftershock.harness.errors import SpecError
    from aftershock.harness.scenario.load import discover, load_scenario

    try:
        files = discover(list(paths))
        if not files:
            raise SpecError([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])
        problems: list[str] = []
        loaded = []
        broken = False
        for file in files:
            try:
                loaded.append(load_scenario(file))
            except SpecError as exc:
                problems.extend(exc.problems)
                broken = broken or _uses_broken(exc)
        if problems:
            raise _fail_invalid(problems, broken=broken)
    except SpecError as exc:
        raise _fail_invalid(exc.problems) from None
    return loaded


def _run_here(loaded: list[Any], results: list[Any], *, run_dir: Path | None,
              seed: int | None, repeat: int, use_cache: bool, console: Console,
              live: bool) -> None:
    """Each scenario ``repeat`` times on this machine, one after another, each result
    appended to ``results`` as it ends (so an interrupted campaign still reports them)."""
    from aftershock.harness import systems
    from aftershock.harness.reporting.report import LiveObserver, PlainObserver
    from aftershock.harness.run.runner import Observer, run_scenario

    for scenario in loaded:
        for attempt in range(repeat):
            this_dir = None
            if run_dir is not None:
                suffix = f"-{attempt + 1}" if repeat > 1 else ""
                this_dir = run_dir / f"{scenario.spec.name}{suffix}"
            this_seed = (seed if seed is not None else scenario.spec.seed) + attempt
            total = systems.of(scenario.spec.system).steps(scenario.spec.system)
            if live:
                with LiveObserver(console, total_steps=total) as view:
                    result = run_scenario(scenario, run_dir=this_dir, seed=this_seed,
                                          observer=view, use_cache=use_cache)
            else:
                observer: Observer = PlainObserver(console)
                result = run_scenario(scenario, run_dir=this_dir, seed=this_seed,
                                      observer=observer, use_cache=use_cache)
            results.append(result)


def _left_behind() -> list[str]:
    """What this process's runs could not undo in their teardown (a Slurm job that outlived
    its cancel's bound...): the entries still pending in the heal journals it owns."""
    import contextlib
    import os

    from aftershock.faults.journal import journal_dir, read

    left: list[str] = []
    with contextlib.suppress(OSError):
        for path in sorted(journal_dir().glob("*.jsonl")):
            with contextlib.suppress(OSError, ValueError):
                contents = read(path)
                if contents.owner is None or contents.owner.pid != os.getpid():
                    continue
                for entry in contents.pending:
                    job = entry.undo.get("slurm_job_name")
                    left.append(f"Slurm jobs named {job}" if job else
                                f"{entry.op} {entry.kind} of run {path.stem}")
    return left


def _run_stopped(exc: BaseException, results: list[Any]) -> int | None:
    """The exit code for a campaign that ``exc`` stopped, said on stderr (a run it
    carries joins ``results``); None for an exception that is not the campaign's to end
    (typer's own Exit, SystemExit)."""
    from aftershock.harness.errors import AftershockError, HarnessError, RunDirBusy, RunFailed
    from aftershock.harness.run.runner import Interrupted, RunInterrupted

    if isinstance(exc, KeyboardInterrupt):
        if isinstance(exc, RunInterrupted):
            results.append(exc.result)
        left = _left_behind()
        err.print("interrupted: " + (
            f"left behind, for `aftershock heal`: {'; '.join(left)}" if left else
            "every fault was healed and every process of the run ended"), markup=False)
        # The shell's convention: 128 + the signal number (SIGINT 2, SIGTERM 15).
        return (exc.exit_code if isinstance(exc, RunInterrupted)
                else 143 if isinstance(exc, Interrupted) else 130)
    if not isinstance(exc, Exception):
        return None
    if isinstance(exc, RunFailed):
        results.append(exc.result)
    if isinstance(exc, RunFailed | HarnessError):
        err.print(f"aftershock: harness error: {exc}", markup=False)
        return EXIT_HARNESS
    if isinstance(exc, RunDirBusy):
        err.print(f"aftershock: {exc}", markup=False)
        return EXIT_INVALID
    if isinstance(exc, AftershockError):
        err.print(f"aftershock: {exc}", markup=False)
        return EXIT_HARNESS
    if isinstance(exc, typer.Exit):
        return None
    # Exit 1 means "a check failed": a bug of the harness must never read as a verdict.
    err.print(f"aftershock: harness error: unexpected {type(exc).__name__}: {exc} "
              f"(traceback: {_save_traceback()})", markup=False)
    return EXIT_HARNESS


def _database_problems(database: Path | None) -> list[str]:
    """What is wrong with explore's example database folder (none: nothing)."""
    if database is None:
        return []
    from aftershock.harness.search.explore import database_problems

    return database_problems(database)


@app.command()
def explore(
    paths: Annotated[
        list[Path], typer.Argument(help="scenario files or folders with an `explore:` block",
                                   readable=False)
    ],
    runs: Annotated[int, typer.Option(min=1, max=100_000,
                                      help="schedules to try per scenario")] = 30,
    time_limit: Annotated[str | None, typer.Option(
        "--time", help="stop searching after this long per scenario (e.g. 10m)")] = None,
    seed: Annotated[int | None, typer.Option(
        min=0, max=2**32 - 1, help="seed of the search (default: random, printed); the "
        "same seed and code give the same schedules")] = None,
    max_faults: Annotated[int | None, typer.Option(
        min=1, max=64, help="most faults per schedule (default: the scenario's)")] = None,
    out_dir: Annotated[Path, typer.Option(
        "--out", help="write failing schedules (as scenarios) and run folders here",
        readable=False)] = Path(".aftershock") / "explore",
    json_out: Annotated[str | None, typer.Option(
        "--json", help="write what each exploration did as JSON ('-' for stdout)")] = None,
    shrink_runs: Annotated[int, typer.Option(
        min=0, max=100_000, help="runs spent shrinking a failure")] = 20,
    confirm: Annotated[int, typer.Option(
        min=1, max=100, help="re-runs of a shrunk failure before it is reported")] = 1,
    db: Annotated[Path | None, typer.Option(
        help="hypothesis's example database (default .aftershock/hypothesis)",
        readable=False)] = None,
    no_db: Annotated[bool, typer.Option(
        "--no-db", help="no example database: neither replay nor keep failures")] = False,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="run the fault-free twin again (once) instead of reusing it")] = False,
    plain: Annotated[bool, typer.Option(help="plain lines even on a terminal")] = False,
    executor: Annotated[Executor, typer.Option(
        help="where the searches run: here (local), or as the tasks of one Slurm array job "
             "(slurm; docs/scale-out.md)")] = Executor.local,
    workers: Annotated[int, typer.Option(
        min=1, max=1000, help="searchers at once, sharing the example database: side by "
        "side here, or as Slurm tasks (--executor slurm); --runs, --time and --shrink-runs "
        "are each one's")] = 1,
) -> None:
    """Search each scenario's `explore:` space for a fault schedule that fails its `expect`;
    shrink it, re-run it and write it as a scenario (docs/explore.md).

    Exit 0: the budget ran out and nothing failed (a flaky schedule is reported, not a
    failure); 1: a failing schedule was found, shrunk and written; 2: invalid input; 3: the
    harness failed, or a scenario uses a broken plug-in; 130/143: interrupted (what was found
    so far is written).
    """
    import secrets

    _need_extra("hypothesis", "explore", "aftershock explore")
    from aftershock.harness.search.explore import Exploration, sigterm_unwinds

    problems: list[str] = []
    limit_s = _time_limit(time_limit, problems)
    loaded, broken = _explorable(paths, problems)
    problems += _check_outputs(json_out=json_out, junit=None, run_dir=out_dir)
    database = None if no_db else (db or Path(".aftershock") / "hypothesis")
    problems += _executor_problems(executor, workers=workers, no_db=no_db)
    problems += _database_problems(database)
    if problems:
        raise _fail_invalid(problems, broken=broken)
    search_seed = seed if seed is not None else secrets.randbelow(2**32)
    console = err if json_out == "-" else out
    done: list[Exploration] = []
    code = EXIT_OK
    try:
        with sigterm_unwinds():
            _explore_each(loaded, console, live=console.is_terminal and not plain, kwargs=dict(
                runs=runs, time_limit_s=limit_s, seed=search_seed, max_faults=max_faults,
                out=out_dir, shrink_runs=shrink_runs, confirm=confirm, use_cache=not no_cache,
                database=database, sink=done), executor=executor, workers=workers)
    except (KeyboardInterrupt, Exception) as exc:
        code = _explore_stopped(exc, done)
    finally:
        if json_out is not None:
            _write_json(json_out, [e.to_json() for e in done])
    if code == EXIT_OK and any(e.failed for e in done):
        code = EXIT_FAILED
    if seed is None:
        console.print(f"search seed {search_seed} (repeat with --seed {search_seed})",
                      markup=False, highlight=False)
    raise typer.Exit(code)


def _time_limit(time_limit: str | None, problems: list[str]) -> float | None:
    """``--time`` in seconds (None without it); a problem noted if it is no duration."""
    from aftershock.harness.scenario._duration import parse_duration

    if time_limit is None:
        return None
    try:
        return parse_duration(time_limit).total_seconds()
    except ValueError as exc:
        problems.append(f"--time {time_limit}: {exc}")
        return None


def _explorable(paths: list[Path], problems: list[str]) -> tuple[list[Any], bool]:
    """The scenarios under ``paths``, loaded, with what is wrong with them (each must have
    an `explore:` block) added to ``problems``; and whether one uses a broken plug-in."""
    from aftershock.harness.errors import SpecError
    from aftershock.harness.scenario.load import discover, load_scenario

    loaded = []
    broken = False
    try:
        files = discover(list(paths))
        if not files:
            raise SpecError([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])
        for file in files:
            try:
                scenario = load_scenario(file)
            except SpecError as exc:
                problems.extend(exc.problems)
                broken = broken or _uses_broken(exc)
                continue
            if scenario.spec.explore is None:
                problems.append(f"{file}:1:1: no `explore:` block: nothing to search (add "
                                "`explore: {}` to search the system's default space)")
            loaded.append(scenario)
    except SpecError as exc:
        problems.extend(exc.problems)
    return loaded, broken


def _executor_problems(executor: Executor, *, workers: int, no_db: bool) -> list[str]:
    """What keeps ``--executor``/``--workers`` from running here, each in a line."""
    if executor is Executor.local:
        return []
    from aftershock.faults import slurm_cli

    problem = slurm_cli.problem()
    if problem is not None:
        return [f"--executor slurm: {problem}"]
    return ["--no-db: the searchers share their failures through the example database"
            ] if no_db else []


def _explore_each(loaded: list[Any], console: Console, *, live: bool,
                  kwargs: dict[str, Any], executor: Executor = Executor.local,
                  workers: int = 1) -> None:
    """Search each scenario in turn, shown live on a terminal, else as plain lines; with
    ``workers`` above one, by that many searchers (harness/search/team.py), side by side
    here or on Slurm."""
    from functools import partial

    from aftershock.harness.reporting.report import ExploreLiveObserver, ExplorePlainObserver
    from aftershock.harness.search.explore import explore

    explore_scenario: Callable[..., Any] = explore
    if executor is Executor.slurm:
        from aftershock.harness.nodes.slurm_explore import explore_on_slurm

        explore_scenario = partial(explore_on_slurm, workers=workers)
    elif workers > 1:
        from aftershock.harness.search.team import explore_side_by_side

        explore_scenario = partial(explore_side_by_side, workers=workers)

    for scenario in loaded:
        if live:
            with ExploreLiveObserver(console) as view:
                explore_scenario(scenario, observer=view, **kwargs)
        else:
            explore_scenario(scenario, observer=ExplorePlainObserver(console), **kwargs)


def _explore_stopped(exc: BaseException, done: list[Any]) -> int:
    """Say why the search stopped early; its exit code."""
    from aftershock.harness.errors import AftershockError, HarnessError, SpecError
    from aftershock.harness.run.runner import Interrupted, RunInterrupted

    if isinstance(exc, KeyboardInterrupt):
        written = [f.file for e in done for f in e.findings]
        err.print("interrupted: every fault was healed and every process ended; "
                  + (f"what was found so far is written: {', '.join(written)}" if written
                     else "no run had failed yet, so nothing was written"), markup=False)
        return (exc.exit_code if isinstance(exc, RunInterrupted)
                else 143 if isinstance(exc, Interrupted) else 130)
    if isinstance(exc, SpecError):
        for problem in exc.problems:
            err.print(problem, markup=False, highlight=False)
        return EXIT_INVALID
    if isinstance(exc, HarnessError):
        err.print(f"aftershock: harness error: {exc}", markup=False)
        return EXIT_HARNESS
    if isinstance(exc, AftershockError):
        err.print(f"aftershock: {exc}", markup=False)
        return EXIT_HARNESS
    # Exit 1 means "a failing schedule": a bug of the harness must never read as one.
    err.print(f"aftershock: harness error: unexpected {type(exc).__name__}: {exc} "
              f"(traceback: {_save_traceback()})", markup=False)
    return EXIT_HARNESS


def _write_json(json_out: str, data: list[Any]) -> None:
    """``data`` as JSON to ``json_out``, or to stdout for ``-``."""
    text = json.dumps(data, indent=2) + "\n"
    if json_out == "-":
        sys.stdout.write(text)
    else:
        Path(json_out).write_text(text)


def _save_traceback() -> str:
    """The current exception's traceback in a file of its own, for the bug report."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="aftershock-error-", suffix=".txt")
    with open(fd, "w") as handle:
        handle.write(traceback.format_exc())
    return path


def _check_outputs(*, json_out: str | None, junit: Path | None, run_dir: Path | None,
                   html: Path | None = None, trace: Path | None = None) -> list[str]:
    """Problems with the paths a run will write to, found by trying them, not by guessing
    from permission bits (root passes every such check, and /proc refuses anyway)."""
    import os

    problems: list[str] = []
    files = [("--json", Path(json_out)) if json_out not in (None, "-") else None,
             ("--junit", junit) if junit is not None else None,
             ("--html", html) if html is not None else None,
             ("--trace", trace) if trace is not None else None]
    for option, path in filter(None, files):
        existed = path.exists()
        try:
            # O_NONBLOCK: a named pipe without a reader is an error now, not a hang.
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK))
        except OSError as exc:
            problems.append(f"{option} {path}: cannot write ({exc.strerror or exc})")
            continue
        if not existed:
            path.unlink()  # written at the end; nothing is left behind if the run never starts
    if problems:
        return problems
    folder = run_dir if run_dir is not None else Path(".aftershock") / "runs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        name = "--run-dir" if run_dir is not None else "run folder"
        problems.append(f"{name} {folder}: cannot create the folder ({exc.strerror or exc})")
    return problems


def _write_pictures(results: list[Any], *, html: Path | None, trace: Path | None) -> None:
    """The HTML report and the trace of the runs that left a folder (docs/report.md)."""
    if not results or (html is None and trace is None):
        return
    from aftershock.harness.reporting.pictures import write_pictures

    for problem in write_pictures([Path(r.run_dir) for r in results], html=html, trace=trace):
        err.print(problem, markup=False, highlight=False)


def _write_records(results: list[Any], json_out: str | None, junit: Path | None,
                   html: Path | None = None) -> None:
    from aftershock.harness.reporting.report import junit_xml, write_json

    if json_out == "-":
        write_json(results, sys.stdout)
    elif json_out:
        with open(json_out, "w") as handle:
            write_json(results, handle)
    if junit:
        junit.write_text(junit_xml(results, html=html))


@app.command()
def golden(
    paths: Annotated[list[Path], typer.Argument(help="scenario files or folders")],
    update: Annotated[
        bool, typer.Option("--update", help="run each fault-free twin and record its result")
    ] = False,
    seed: Annotated[int | None, typer.Option(help="override every scenario's seed")] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="re-run fault-free twins instead of reusing")
    ] = False,
    run_dir: Annotated[
        Path | None, typer.Option(help="keep the twins' run folders here")
    ] = None,
) -> None:
    """Golden results of fault-free twins (golden.json beside the scenarios): show which
    scenarios have one for this host's rounding key, or record them on purpose with --update."""
    from aftershock.harness.errors import SpecError
    from aftershock.harness.run.runner import default_run_dir
    from aftershock.harness.scenario.load import discover, load_scenario
    from aftershock.harness.twin import golden as goldens

    try:
        files = discover(list(paths))
        if not files:
            raise SpecError([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])
        problems: list[str] = []
        loaded = []
        broken = False
        for file in files:
            try:
                loaded.append(load_scenario(file))
            except SpecError as exc:
                problems.extend(exc.problems)
                broken = broken or _uses_broken(exc)
        # A malformed, unreadable or untrusted golden file is invalid input, found first.
        problems.extend(goldens.problems(loaded, writing=update))
        if problems:
            raise _fail_invalid(problems, broken=broken)
    except SpecError as exc:
        raise _fail_invalid(exc.problems) from None
    if not update:
        for scenario in loaded:
            out.print(_golden_status(scenario, seed), markup=False, highlight=False)
        return
    root = run_dir or default_run_dir("golden")
    results = goldens.update(loaded, seed=seed, use_cache=not no_cache, run_root=root)
    for item in results:
        style = None if item.ok else "red"
        out.print(f"{item.status:9} {item.scenario}: {item.message}", style=style,
                  markup=False, highlight=False)
    raise typer.Exit(EXIT_OK if all(r.ok for r in results) else EXIT_FAILED)


def _golden_status(scenario: Any, seed: int | None) -> str:
    from aftershock.harness.twin import golden as goldens

    what = goldens.what_of(scenario.spec)
    if what is None:
        return f"-        {scenario.path}: no fault-free twin to keep a golden of"
    path = goldens.path_of(scenario.path)
    if not path.exists():
        return f"none     {scenario.path}: no {path}"
    try:
        key = goldens.key_of(scenario.spec, scenario.spec.seed if seed is None else seed)
        found = any(key.matches(e) for e in goldens.read(path))
    except (ValueError, RuntimeError) as exc:
        return f"error    {scenario.path}: {exc}"
    if found:
        return f"golden   {scenario.path}: key {key.rounding} [{key.platform}] seed {key.seed}"
    return (f"missing  {scenario.path}: none for key {key.rounding} [{key.platform}] seed "
            f"{key.seed} (an independent oracle judges its twin; --update records one)")


@app.command()
def faults(
    kind: Annotated[str | None, typer.Argument(help="a kind, or 'xid' for the Xid table")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
    system: Annotated[str | None, typer.Option(
        "--system", help="only the kinds that apply to this kind of system (trainer, server, "
        "command: a plain job, without the in-process probe)")] = None,
    for_file: Annotated[Path | None, typer.Option(
        "--for", help="only the kinds that apply to this scenario's system", readable=False,
    )] = None,
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="the generated part of docs/faults.md")] = False,
) -> None:
    """The fault catalogue: every kind, where it acts, its parameters, how it is really
    caused. Built from each kind's own declaration.

    `aftershock faults xid` prints NVIDIA's Xid table as the simulation uses it.
    """
    from aftershock.faults import catalogue

    if kind == "xid":
        _xid_table(as_json)
        return
    kinds = _kinds_named(kind)
    offered = _offered(system, for_file)
    if offered is not None:
        kinds = [k for k in kinds if catalogue.applicable(k, offered)]
    if markdown:
        print(catalogue.markdown(kinds), end="")
        return
    if as_json:
        print(json.dumps([catalogue.describe(k) for k in kinds], indent=2))
        return
    from rich.table import Table

    table = Table(title="Aftershock faults")
    for column in ("kind", "what", "where", "params", "how it is caused", "undone by"):
        table.add_column(column)
    for k in kinds:
        params = "\n".join(f"{n}: {m}" for n, m in catalogue.parameters(k).items())
        table.add_row(k.info.kind, k.info.summary, catalogue.where(k), params,
                      k.info.caused_by, k.info.reverted_by)
    out.print(table)


def _kinds_named(kind: str | None) -> list[Any]:
    """The declared fault kinds ``kind`` names (itself, or a family: ``net``); all without
    one. Exits 3 for a kind whose plug-in is broken, 2 for an unknown one."""
    from aftershock import faults as engine
    from aftershock.faults import registry

    kinds = [k for k in engine.kinds() if registry.declared(k)]
    if kind is None:
        return kinds
    kinds = [k for k in kinds if k.info.kind == kind or k.info.kind.startswith(kind + ".")]
    skipped = registry.broken_kind(kind)
    if not kinds and skipped is not None:
        err.print(f"aftershock: {skipped.line()}", markup=False, highlight=False)
        raise typer.Exit(EXIT_HARNESS)
    if not kinds:
        known = ", ".join(k.info.kind for k in engine.kinds())
        err.print(f"unknown fault kind {kind!r} (known: {known})", markup=False)
        raise typer.Exit(EXIT_INVALID)
    return kinds


def _offered(system: str | None, for_file: Path | None) -> frozenset[str] | None:
    """What the system named by ``--system`` or ``--for`` lets faults act through; None
    without either."""
    from aftershock.harness import systems
    from aftershock.harness.errors import SpecError
    from aftershock.harness.scenario.load import load_scenario

    if system is not None and for_file is not None:
        raise _fail_invalid(["give --system or --for, not both"])
    if system is not None:
        try:
            kind = systems.get(system)
        except KeyError as exc:
            raise _fail_invalid([str(exc.args[0])]) from None
        model, folder = None, None
    elif for_file is not None:
        try:
            loaded = load_scenario(for_file)
        except SpecError as exc:
            raise _fail_invalid(exc.problems, broken=_uses_broken(exc)) from None
        kind, model, folder = (systems.of(loaded.spec.system), loaded.spec.system,
                               loaded.path.parent)
    else:
        return None
    offered = set(kind.capabilities(model))
    if kind.probe(model, folder) is None:
        offered.add("probe")
    return frozenset(offered)


def _xid_table(as_json: bool) -> None:
    from dataclasses import asdict

    from aftershock.faults.xid import CATALOG, CATALOG_URL

    if as_json:
        print(json.dumps([asdict(x) for x in CATALOG.values()], indent=2, default=str))
        return
    from rich.table import Table

    table = Table(title="NVIDIA Xid errors", caption=f"source: {CATALOG_URL}")
    for column in ("Xid", "name", "meaning", "NVIDIA action", "effect", "expected reaction"):
        table.add_column(column)
    for x in CATALOG.values():
        table.add_row(str(x.code), x.name, x.meaning, x.nvidia_action, str(x.effect),
                      str(x.action))
    out.print(table)


@app.command()
def schema() -> None:
    """Print the scenario file's JSON Schema."""
    from aftershock.harness.scenario.load import json_schema

    print(json.dumps(json_schema(), indent=2))


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="run folders written by `aftershock run` (or folders of them, e.g. a --repeat's)",
        readable=False)],
    recheck: Annotated[bool, typer.Option(
        "--recheck", help="judge the saved logs and events again with the current probes and "
        "checks, without re-running")] = False,
    scenario: Annotated[Path | None, typer.Option(
        help="with --recheck: the (fixed) scenario to judge by, instead of the one run")] = None,
    html: Annotated[
        Path | None, typer.Option(help="write a self-contained HTML report here")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="write a Chrome trace-event file (Perfetto) here")
    ] = None,
    clock: Annotated[str, typer.Option(
        help="the trace's clock: run (monotonic, as recorded) or wall (Unix time)")] = "run",
) -> None:
    """Re-render recorded runs: the check table, or several runs compared; HTML and trace.

    With --recheck the exit code is the new verdict's (0 all checks hold, 1 a check failed).
    """
    from aftershock.harness.errors import HarnessError, SpecError
    from aftershock.harness.reporting.pictures import show_runs

    if clock not in ("run", "wall"):
        raise _fail_invalid([f"--clock {clock}: allowed: run, wall"])
    if scenario is not None and not recheck:
        raise _fail_invalid(["--scenario needs --recheck"])
    try:
        passed = show_runs(list(run_dirs), out=out, err=err, recheck=recheck,
                           scenario=scenario, html=html, trace=trace, clock=clock)
    except SpecError as exc:
        raise _fail_invalid(exc.problems, broken=_uses_broken(exc)) from None
    except HarnessError as exc:  # a damaged timeline: the run cannot be judged from it
        err.print(f"aftershock: harness error: {exc}", markup=False)
        raise typer.Exit(EXIT_HARNESS) from None
    raise typer.Exit(EXIT_OK if passed or not recheck else EXIT_FAILED)


@app.command()
def heal() -> None:
    """Undo every fault, and end every process, that a crashed run left behind.

    Only journals of this user in a private state folder are read, and each undo
    record must name what its run made (docs/security.md). Exit 0: nothing left;
    1: an undo failed, a fault may still be applied; 2: something was refused or
    unreadable and left untouched (the output says what and why).
    """
    from aftershock.faults.heal import exit_code, heal_orphans

    healed = heal_orphans()
    for item in healed:
        out.print(item.describe(), markup=False, highlight=False)
    counts = {o: sum(1 for h in healed if h.outcome == o)
              for o in ("undone", "refused", "failed", "skipped")}
    tally = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "nothing was left behind"
    out.print(f"healed {len(healed)} item(s): {tally}", markup=False)
    raise typer.Exit(exit_code(healed))


def _one_line_paragraphs() -> None:
    """Each command's help from its docstring, every paragraph on one line: docstrings are
    wrapped for the source, and the help wraps again at the terminal's width, so a line
    break kept from the source would split a sentence mid-way."""
    import inspect

    for command in app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc:
            command.help = "\n\n".join(" ".join(paragraph.split())
                                       for paragraph in inspect.cleandoc(doc).split("\n\n"))


_one_line_paragraphs()


def main() -> None:
    try:
        app()
    finally:
        # By now every fault is reverted, every process ended and every record written and
        # closed (each in its own `finally`). What is still alive is left to the OS: without
        # this the interpreter's last collection walks every object of typer, rich, pydantic
        # and the scenario models, ~30 ms of CPU per run (docs/benchmarks.md). Objects are
        # still freed as their references go; only cycles are no longer searched for.
        gc.freeze()


if __name__ == "__main__":
    main()
