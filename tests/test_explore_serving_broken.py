"""Explore finds the routers that acknowledge before durable (issue 47, class 1).

Each broken variant of tests/broken_serving/sitecustomize.py (on the server's PYTHONPATH
through ``system.env``, switched on by ``AFTERSHOCK_INJECT_BROKEN_DURABILITY``, which the
fault-free twin goes without) passes every serving scenario shipped before the router's
durability points. The shipped space, scenarios/explore/server.yaml, draws what shows them:
a crash of the router at a point of its durability path, a power loss under its journal, and
clients that resubmit or only resume (``load.resubmit``). A search of at most 40 runs must
find each variant, and the schedule it writes must pass on the correct server: the failure
is the variant's, not the space's.

Each search launches the reference server up to 40 times (about ten minutes on a busy
machine): ``make test-explore-long``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import ROOT

from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search.explore import Exploration, explore

pytestmark = [pytest.mark.slow, pytest.mark.explore_long, pytest.mark.timeout(2400)]

SPACE = ROOT / "scenarios" / "explore" / "server.yaml"
BROKEN = ROOT / "tests" / "broken_serving"
VARIANT_ENV = "AFTERSHOCK_INJECT_BROKEN_DURABILITY"
BUDGET = 40  # runs, everything included: search, shrinking, minimizing, confirming


def broken(variant: str) -> LoadedScenario:
    """The shipped space, run against the server with ``variant`` in it."""
    loaded = load_scenario(SPACE)
    system = loaded.spec.system
    env = {**system.env, "PYTHONPATH": os.pathsep.join(str(p) for p in (BROKEN, ROOT)),
           VARIANT_ENV: variant}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    return LoadedScenario(spec, loaded.path, loaded.text)


def search(base: LoadedScenario, tmp_path: Path) -> Exploration:
    found = explore(base, runs=28, shrink_runs=10, confirm=1, seed=0, database=None,
                    out=tmp_path / "out")
    assert found.runs <= BUDGET, found.runs
    assert found.findings, [(a.schedule, a.verdict, a.reason) for a in found.attempts]
    return found


def passes_on_the_correct_server(finding_file: str, tmp_path: Path) -> None:
    """The written scenario, without the variant: every check holds."""
    loaded = load_scenario(finding_file)
    system = loaded.spec.system
    env = {k: v for k, v in system.env.items() if k not in (VARIANT_ENV, "PYTHONPATH")}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    result = run_scenario(LoadedScenario(spec, loaded.path, loaded.text),
                          run_dir=tmp_path / "correct")
    assert result.passed, [(c.name, c.message) for c in result.checks if not c.passed]


@pytest.fixture(autouse=True)
def _cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(shared_cache))


def test_explore_finds_tokens_shown_before_their_record_is_durable(tmp_path: Path) -> None:
    """A crash of the router loses nothing of a write the kernel holds: only a power loss
    under the journal takes the tokens clients already saw."""
    found = search(broken("shown_before_durable"), tmp_path)
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    assert "acknowledged_durable" in finding.failed_checks, finding
    spec = load_scenario(finding.file).spec
    assert [str(f.kind) for f in spec.faults] == ["storage.lose_unsynced"], finding.schedule
    passes_on_the_correct_server(finding.file, tmp_path)


def test_explore_finds_a_restarted_router_that_redoes_acknowledged_requests(
        tmp_path: Path) -> None:
    """A router restarted on its journal that fails the requests it held: clients that
    resubmit get the same tokens from a redo (acknowledged_durable sees it in the journal),
    clients that only resume lose them (no_lost_requests)."""
    found = search(broken("redo_after_crash"), tmp_path)
    finding = found.findings[0]
    assert finding.status == "confirmed", finding
    assert {"acknowledged_durable", "no_lost_requests"} & set(finding.failed_checks), finding
    spec = load_scenario(finding.file).spec
    # What brings the router down: a kill of it, or the power under its journal.
    assert any(f.target.role == "router" for f in spec.faults), finding.schedule
    passes_on_the_correct_server(finding.file, tmp_path)
