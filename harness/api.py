"""Aftershock from Python: load a scenario, run it, read its result.

The small public API beside the CLI (docs/own-job.md). Everything here is what the CLI
and the pytest plugin use; nothing else in ``harness`` is promised to stay as it is.

    from aftershock.harness import api

    scenario = api.load("examples/torchrun_ddp/kill.yaml")
    result = api.run(scenario, seed=3)
    api.check(result)                     # AssertionError with the check table if it failed

A scenario may also be built in Python (``api.from_dict``), relative file names in it
resolving from ``folder`` as they would from a scenario file's folder. In pytest, the
``aftershock`` fixture (_aftershock_pytestplugin.py) runs scenarios into the test's own
temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from aftershock.harness.run.records import CheckResult as CheckResult
from aftershock.harness.run.records import FaultRecord as FaultRecord
from aftershock.harness.run.records import RunResult as RunResult
from aftershock.harness.run.runner import Observer as Observer
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario as LoadedScenario
from aftershock.harness.scenario.spec import Scenario as Scenario

__all__ = ["CheckResult", "FaultRecord", "LoadedScenario", "Observer", "RunResult",
           "Scenario", "check", "from_dict", "load", "loads", "run"]


def load(path: str | Path) -> LoadedScenario:
    """A scenario file, validated as `aftershock validate` does (raises SpecError, whose
    ``problems`` name file:line:col)."""
    return load_scenario(path)


def loads(text: str, *, folder: str | Path = ".", name: str = "scenario.yaml") -> LoadedScenario:
    """Scenario YAML from a string, as if it were the file ``folder/name`` (its relative
    file names resolve from ``folder``; nothing is written)."""
    path = Path(folder).resolve() / name
    spec = parse_scenario(text, str(path), folder=path.parent)
    return LoadedScenario(spec=spec, path=path, text=text)


def from_dict(data: dict[str, Any], *, folder: str | Path = ".") -> LoadedScenario:
    """A scenario built from Python values (the YAML's mapping)."""
    return loads(yaml.safe_dump(data, sort_keys=False), folder=folder)


def run(scenario: LoadedScenario | str | Path, *, run_dir: str | Path | None = None,
        seed: int | None = None, observer: Observer | None = None,
        use_cache: bool = True) -> RunResult:
    """Run a scenario (a loaded one or a file) to its verdict; its record is also written to
    ``run_dir/result.json``. Raises RunFailed (harness trouble, with the record) or
    RunInterrupted (Ctrl-C, SIGTERM), each after every fault was healed."""
    loaded = scenario if isinstance(scenario, LoadedScenario) else load(scenario)
    return run_scenario(loaded, run_dir=None if run_dir is None else Path(run_dir),
                        seed=seed, observer=observer, use_cache=use_cache)


def check(result: RunResult) -> RunResult:
    """``result`` if it passed; else AssertionError with its failed checks and the table."""
    if result.passed:
        return result
    from aftershock.harness.reporting.report import check_table_text

    failed = ", ".join(c.name for c in result.failed_checks()) or result.error or "no verdict"
    raise AssertionError(f"{result.name}: {failed}\n{check_table_text(result)}")
