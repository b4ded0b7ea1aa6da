"""Run a shipped scenario against a deliberately broken reference trainer.

The broken variants live in tests/broken/sitecustomize.py; the faulted run (and only it) gets
that folder on its PYTHONPATH and the bug's name in its environment. The fault-free baseline
stays the shipped scenario's, cached per session and shared (runner.baseline_key), and the
independent oracle that judges an elastic run never runs trainer code at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, on_two_ranks, read_events

from aftershock.harness.run import runner
from aftershock.harness.run.records import CheckResult, RunResult
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario, Scenario, TrainerSystem
from aftershock.harness.systems.nodes import NodesSystem

BROKEN = ROOT / "tests" / "broken"
BUG_ENV = "AFTERSHOCK_TEST_BUG"


def with_bug(spec: Scenario, bug: str) -> Scenario:
    """``spec`` whose job imports tests/broken/sitecustomize.py with ``bug`` switched on."""
    system = spec.system
    assert isinstance(system, TrainerSystem | NodesSystem)  # both hand `env` to every rank
    path = [str(BROKEN), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**system.env, "PYTHONPATH": os.pathsep.join(p for p in path if p), BUG_ENV: bug}
    return spec.model_copy(update={"system": system.model_copy(update={"env": env})})


def run_broken(
    scenario: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, cache: Path, *,
    bug: str | None = None, extra_args: tuple[str, ...] = (), two_ranks: bool = False,
    text: str | None = None,
) -> RunResult:
    """Run ``scenario`` (or ``text``, a variant of it) with ``bug`` and ``extra_args`` in the
    faulted run only. ``two_ranks``: on a 2-rank data-parallel world instead of 2 x 2, for a
    bug that does not depend on the layout (half the start-up)."""
    execute = runner.execute

    def broken(spec: Scenario, **kwargs: Any) -> Any:
        if kwargs.get("phase", "run") == "run":
            if bug is not None:
                spec = with_bug(spec, bug)
            kwargs["extra_args"] = (*kwargs.get("extra_args", ()), *extra_args)
        return execute(spec, **kwargs)

    monkeypatch.setattr(runner, "execute", broken)
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    loaded = load_scenario(scenario)
    if text is not None or two_ranks:
        text = on_two_ranks(loaded.text) if two_ranks else text
        assert text is not None
        loaded = LoadedScenario(parse_scenario(text, str(scenario)), scenario, text)
    result = runner.run_scenario(loaded, run_dir=run_dir)
    if bug is not None:
        # The broken code really ran (else a failing check would prove nothing).
        announced = {e["bug"] for e in read_events(run_dir / "events.jsonl", "test_bug")}
        assert announced == {bug}, announced
    return result


def checks(result: RunResult) -> dict[str, CheckResult]:
    return {c.name: c for c in result.checks}
