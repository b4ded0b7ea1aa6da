"""`params_match: replay` is judged by an oracle independent of the trainer it judges.

The shipped kill_rank_elastic scenario, run against a deliberately broken elastic trainer (a
test-only ``sitecustomize`` patch: while a replica is missing, the survivors still divide the
gradient sum by the configured replica count). Recomputing the membership log with the same
trainer code would repeat the bug and pass; harness.oracle recomputes it from the model's math
alone and must see the parameters differ. The passing side is the shipped scenario itself
(tests/test_shipped_scenarios.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import ROOT, on_two_ranks, read_events

from harness.runner import run_scenario
from harness.spec import LoadedScenario, parse_scenario

ELASTIC = ROOT / "scenarios" / "training" / "kill_rank_elastic.yaml"
WRONG_AVERAGE = ROOT / "tests" / "fixtures" / "broken" / "elastic_full_average"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_replay_check_fails_on_a_trainer_that_averages_wrongly(tmp_path: Path) -> None:
    # On a 2-rank world (one rank per replica) to halve the cost; the bug is the same.
    path_env = f"{WRONG_AVERAGE}{os.pathsep}{ROOT}"
    text = on_two_ranks(ELASTIC.read_text()).replace(
        "  step_sleep: 10ms\n", f"  step_sleep: 10ms\n  env: {{PYTHONPATH: '{path_env}'}}\n")
    assert str(WRONG_AVERAGE) in text
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                          run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed, checks["completes"].message
    assert checks["faults_injected"].passed
    # The run recovered as usual (a survivor went on alone, with the wrong average); only
    # the math was wrong.
    assert checks["lost_steps"].passed
    alone = [e for e in read_events(tmp_path / "run" / "events.jsonl", "step")
             if e.get("replicas") == 1]
    assert alone, "no step was committed while a replica was missing: nothing to catch"
    assert "[broken variant]" in (tmp_path / "run" / "logs" / "launcher.stderr.log").read_text()
    assert not checks["params_match"].passed, checks["params_match"].message
    assert "parameters differ" in checks["params_match"].message
    assert not result.passed
