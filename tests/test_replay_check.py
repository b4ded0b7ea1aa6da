"""`params_match: replay` catches an elastic trainer whose math does not match the
membership it records: the shipped kill_rank_elastic scenario, run against a deliberately
broken trainer (AFTERSHOCK_INJECT_FULL_AVERAGE: survivors keep dividing the gradient sum
by the configured replica count while a replica is missing). The passing side is the
shipped scenario itself (tests/test_shipped_scenarios.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import ROOT, on_two_ranks

from harness.runner import run_scenario
from harness.spec import LoadedScenario, parse_scenario

ELASTIC = ROOT / "scenarios" / "training" / "kill_rank_elastic.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_replay_check_fails_on_a_trainer_that_averages_wrongly(tmp_path: Path) -> None:
    # On a 2-rank world (one rank per replica) to halve the cost; the bug is the same.
    text = on_two_ranks(ELASTIC.read_text()).replace(
        "  step_sleep: 10ms\n",
        "  step_sleep: 10ms\n  env: {AFTERSHOCK_INJECT_FULL_AVERAGE: '1'}\n")
    assert "FULL_AVERAGE" in text
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                          run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed, checks["completes"].message
    assert checks["faults_injected"].passed
    # The run recovered as usual (survivors went on alone); only the math was wrong.
    assert checks["lost_steps"].passed
    assert not checks["params_match"].passed, checks["params_match"].message
    assert "parameters differ" in checks["params_match"].message
    assert not result.passed
