"""`params_match: replay` is judged by an oracle independent of the trainer it judges.

The shipped kill_rank_elastic scenario, run against a deliberately broken elastic trainer
(tests/broken/sitecustomize.py, `full_average`: while a replica is missing, the survivors still
divide the gradient sum by the configured replica count). Recomputing the membership log with
the same trainer code would repeat the bug and pass; aftershock.harness.oracle recomputes it from
the
model's math alone and must see the parameters differ. The passing side is the shipped
scenario itself (tests/test_shipped_scenarios.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _broken import checks, run_broken
from _helpers import ROOT, read_events

ELASTIC = ROOT / "scenarios" / "training" / "kill_rank_elastic.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_replay_check_fails_on_a_trainer_that_averages_wrongly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path
) -> None:
    # On a 2-rank world (one rank per replica) to halve the cost; the bug is the same.
    result = run_broken(ELASTIC, tmp_path / "run", monkeypatch, shared_cache,
                        bug="full_average", two_ranks=True)
    found = checks(result)
    assert found["completes"].passed, found["completes"].message
    assert found["faults_injected"].passed
    # The run recovered as usual (survivors went on alone); only the math was wrong.
    assert found["lost_steps"].passed
    alone = [e for e in read_events(tmp_path / "run" / "events.jsonl", "step")
             if e.get("replicas") == 1]
    assert alone, "no step was committed while a replica was missing: nothing to catch"
    assert not found["params_match"].passed, found["params_match"].message
    assert "parameters differ" in found["params_match"].message
    assert not result.passed
