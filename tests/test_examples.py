"""The jobs of examples/ (docs/own-job.md), run as a user runs them: each scenario must pass.

A plain torchrun DDP job and a torchft job, each attacked fault-free, by a kill and by a
freeze; and a serving stack started as a plain command (examples/own_server), driven by a
scenario-level load, fault-free and with a worker killed. The freeze scenarios pass only if
the job really recovers: its parameters must end bitwise equal to a run never frozen,
resumed from its newest snapshot. The torchft ones need torchft (`make bench` installs it)
and are skipped, saying so, without it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _helpers import ROOT, cli, read_events

EXAMPLES = sorted((ROOT / "examples").glob("*/*.yaml"))

pytestmark = [pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fault-free twin per example job, shared by its kill and freeze scenarios."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("scenario", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_example_passes(scenario: Path, tmp_path: Path, cache: Path) -> None:
    if "torchft" in scenario.parent.name and importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (`make bench` installs it)")
    out = tmp_path / "out.json"
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(tmp_path / "run"),
               "--plain", cache=cache, timeout=560)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    assert record["passed"], proc.stdout
    events = read_events(Path(record["run_dir"]) / "events.jsonl")
    if scenario.parent.name == "own_server":
        # Judged as a server: the load's requests, each compared with the fault-free twin's.
        assert record["metrics"]["requests"] == 24, record["metrics"]
        checks = {c["name"] for c in record["checks"] if c["passed"]}
        assert {"no_lost_requests", "no_duplicated_tokens", "outputs_match"} <= checks
        if scenario.stem != "fault-free":
            assert record["metrics"]["migrated_requests"] >= 1, record["metrics"]
        return
    if scenario.stem != "fault-free":
        # It recovered, in one world with every rank, and no step was trained twice.
        assert record["metrics"]["time_to_recover_s"] is not None, record["metrics"]
        assert record["metrics"]["forked_steps"] == 0, record["metrics"]
        if (scenario.parent.name, scenario.stem) != ("torchft_ddp", "freeze"):
            # A restart the harness saw from the launcher's side (a thawed torchft group
            # rejoins the quorum without one).
            assert record["metrics"]["generations"] >= 1, record["metrics"]
        if scenario.parent.name == "torchrun_ddp":  # torchft heals from a peer instead
            assert any(e["event"] == "checkpoint_loaded" for e in events)
