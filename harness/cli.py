"""The `aftershock` command line: thin commands over engine functions.

Exit codes (DESIGN.md): 0 all checks hold, 1 a check failed, 2 invalid input,
3 the harness itself failed. Heavy modules are imported inside commands so
``aftershock --help`` stays instant.
"""

from __future__ import annotations

import json
import sys
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
# Off a terminal (CI logs) rich would assume 80 columns and fold the check table.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 160)

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_HARNESS = 0, 1, 2, 3


def _fail_invalid(problems: list[str]) -> typer.Exit:
    for problem in problems:
        err.print(problem, markup=False, highlight=False)
    return typer.Exit(EXIT_INVALID)


@app.command()
def validate(
    paths: Annotated[list[Path], typer.Argument(help="scenario files or folders")],
) -> None:
    """Parse and validate scenario files without running anything."""
    from harness.errors import SpecError
    from harness.spec import discover, load_scenario

    problems: list[str] = []
    try:
        files = discover(list(paths))
    except SpecError as exc:
        raise _fail_invalid(exc.problems) from None
    for file in files:
        try:
            load_scenario(file)
        except SpecError as exc:
            problems.extend(exc.problems)
        else:
            out.print(f"ok {file}", markup=False, highlight=False)
    if problems:
        raise _fail_invalid(problems)
    if not files:
        raise _fail_invalid([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])


@app.command()
def run(
    paths: Annotated[list[Path], typer.Argument(help="scenario files or folders")],
    json_out: Annotated[
        str | None, typer.Option("--json", help="write the run record as JSON ('-' for stdout)")
    ] = None,
    junit: Annotated[Path | None, typer.Option(help="write JUnit XML here")] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="keep run folders here (default .aftershock/runs/...)")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="override every scenario's seed")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="run each scenario N times")] = 1,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="re-run fault-free baselines instead of reusing")
    ] = False,
    plain: Annotated[bool, typer.Option(help="plain lines even on a terminal")] = False,
) -> None:
    """Run scenarios: launch, inject faults, check recovery, report."""
    from harness.errors import AftershockError, HarnessError, RunFailed, SpecError
    from harness.report import LiveObserver, PlainObserver
    from harness.runner import Interrupted, Observer, RunInterrupted, run_scenario
    from harness.spec import TrainerSystem, discover, load_scenario

    try:
        files = discover(list(paths))
        if not files:
            raise SpecError([f"{p}:1:1: no scenario files (*.yaml, *.yml) found" for p in paths])
        problems: list[str] = []
        loaded = []
        for file in files:
            try:
                loaded.append(load_scenario(file))
            except SpecError as exc:
                problems.extend(exc.problems)
        if problems:
            raise SpecError(problems)
    except SpecError as exc:
        raise _fail_invalid(exc.problems) from None

    # Progress goes to stderr when the JSON record goes to stdout.
    console = err if json_out == "-" else out
    live = console.is_terminal and not plain
    results = []
    try:
        for scenario in loaded:
            for attempt in range(repeat):
                this_dir = None
                if run_dir is not None:
                    suffix = f"-{attempt + 1}" if repeat > 1 else ""
                    this_dir = run_dir / f"{scenario.spec.name}{suffix}"
                this_seed = (seed if seed is not None else scenario.spec.seed) + attempt
                total = (scenario.spec.system.steps
                         if isinstance(scenario.spec.system, TrainerSystem) else None)
                if live:
                    with LiveObserver(console, total_steps=total) as view:
                        result = run_scenario(scenario, run_dir=this_dir, seed=this_seed,
                                              observer=view, use_cache=not no_cache)
                else:
                    observer: Observer = PlainObserver(console)
                    result = run_scenario(scenario, run_dir=this_dir, seed=this_seed,
                                          observer=observer, use_cache=not no_cache)
                results.append(result)
    except KeyboardInterrupt as exc:
        if isinstance(exc, RunInterrupted):
            results.append(exc.result)
        err.print("interrupted: every fault was healed and every process of the run ended")
        # The shell's convention: 128 + the signal number (SIGINT 2, SIGTERM 15).
        code = (exc.exit_code if isinstance(exc, RunInterrupted)
                else 143 if isinstance(exc, Interrupted) else 130)
        raise typer.Exit(code) from None
    except RunFailed as exc:
        results.append(exc.result)
        err.print(f"aftershock: harness error: {exc}", markup=False)
        raise typer.Exit(EXIT_HARNESS) from None
    except HarnessError as exc:
        err.print(f"aftershock: harness error: {exc}", markup=False)
        raise typer.Exit(EXIT_HARNESS) from None
    except AftershockError as exc:
        err.print(f"aftershock: {exc}", markup=False)
        raise typer.Exit(EXIT_HARNESS) from None
    except Exception as exc:
        # Exit 1 means "a check failed": a bug of the harness must never read as a verdict.
        err.print(f"aftershock: harness error: unexpected {type(exc).__name__}: {exc} "
                  f"(traceback: {_save_traceback()})", markup=False)
        raise typer.Exit(EXIT_HARNESS) from None
    finally:
        _write_records(results, json_out, junit)

    failed = [r for r in results if not r.passed]
    summary = f"{len(results) - len(failed)} passed, {len(failed)} failed"
    console.print(summary, style="red" if failed else "green")
    raise typer.Exit(EXIT_FAILED if failed else EXIT_OK)


def _save_traceback() -> str:
    """The current exception's traceback in a file of its own, for the bug report."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="aftershock-error-", suffix=".txt")
    with open(fd, "w") as handle:
        handle.write(traceback.format_exc())
    return path


def _write_records(results: list[Any], json_out: str | None, junit: Path | None) -> None:
    from harness.report import junit_xml, write_json

    if json_out == "-":
        write_json(results, sys.stdout)
    elif json_out:
        with open(json_out, "w") as handle:
            write_json(results, handle)
    if junit:
        junit.write_text(junit_xml(results))


@app.command()
def faults(
    kind: Annotated[str | None, typer.Argument(help="a kind, or 'xid' for the Xid table")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """The fault catalogue: every kind, its parameters, how it is really caused.

    `aftershock faults xid` prints NVIDIA's Xid table as the simulation uses it.
    """
    import faults as catalogue

    if kind == "xid":
        _xid_table(as_json)
        return
    kinds = catalogue.kinds()
    if kind is not None:
        kinds = [k for k in kinds if k.info.kind == kind or k.info.kind.startswith(kind + ".")]
        if not kinds:
            known = ", ".join(k.info.kind for k in catalogue.kinds())
            err.print(f"unknown fault kind {kind!r} (known: {known})", markup=False)
            raise typer.Exit(EXIT_INVALID)
    if as_json:
        rows = [
            {"kind": k.info.kind, "summary": k.info.summary, "caused_by": k.info.caused_by,
             "params": dict(k.info.params), "reverted_by": k.info.reverted_by}
            for k in kinds
        ]
        print(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="Aftershock faults")
    for column in ("kind", "what", "params", "how it is caused", "undone by"):
        table.add_column(column)
    for k in kinds:
        params = "\n".join(f"{n}: {m}" for n, m in k.info.params.items())
        table.add_row(k.info.kind, k.info.summary, params, k.info.caused_by, k.info.reverted_by)
    out.print(table)


def _xid_table(as_json: bool) -> None:
    from dataclasses import asdict

    from faults.xid import CATALOG, CATALOG_URL

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
    from harness.spec import json_schema

    print(json.dumps(json_schema(), indent=2))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="a run folder written by `aftershock run`")],
) -> None:
    """Re-render a recorded run's check table."""
    from harness.records import CheckResult, FaultRecord, RunResult
    from harness.report import render_result

    path = run_dir / "result.json"
    try:
        data = json.loads(path.read_text())
        result = RunResult(
            **{**data, "checks": tuple(CheckResult(**c) for c in data["checks"]),
               "faults": tuple(FaultRecord(**f) for f in data["faults"])}
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        err.print(f"{path}:1:1: not a recorded run ({exc})", markup=False)
        raise typer.Exit(EXIT_INVALID) from None
    render_result(result, out)


@app.command()
def heal() -> None:
    """Undo every fault, and end every process, that a crashed run left behind."""
    from faults.heal import heal_orphans

    healed = heal_orphans()
    for item in healed:
        status = "failed: " + item.error if item.error else "undone"
        out.print(f"{item.entry.kind} {dict(item.entry.undo)} {status}", markup=False)
    out.print(f"healed {len(healed)} item(s)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
