"""Every scenario of scenarios/slurm/ against the test cluster: it passes, Slurm's own view
of the job (the `slurm_job` event, from `scontrol show job`) agrees with what the scenario is
about, and the run leaves no job in the queue and no node DOWN or DRAINed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import slurm_cli as _slurm
from aftershock.harness import api

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(500)]
ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios" / "slurm").glob("*.yaml"))
#: Slurm's requeue count at the end of each scenario: a rank killed is recovered by torchrun
#: inside the one job; a node DOWN or a preemption ends the job, which Slurm requeues once.
REQUEUES = {"kill_rank_restart": "0", "kill_slurmd": "0", "node_down_requeue": "1",
            "preempt_requeue": "1", "ddp_tutorial_preempt": "1", "node_partition": "0"}


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_slurm_scenario_passes_and_leaves_nothing(
        test_cluster: None, tmp_path: Path, scenario: Path) -> None:
    result = api.check(api.run(scenario, run_dir=tmp_path / "r", use_cache=False))
    run_dir = Path(result.run_dir)
    (submitted,) = _events(run_dir, "slurm_submitted")
    assert "RUNNING" in [e["jobstate"] for e in _events(run_dir, "slurm_state")]
    (final,) = _events(run_dir, "slurm_job")
    assert final["JobId"] == submitted["job_id"]
    assert final["JobState"] == "COMPLETED"
    assert final["ExitCode"] == "0:0"
    assert final["NodeList"] == "node[0-1]"
    assert final["Restarts"] == REQUEUES[scenario.stem]
    assert (run_dir / "logs" / f"slurm-{submitted['job_id']}.out").is_file()
    # This run's job only: the cluster is shared, other runs' jobs may be queued.
    assert _slurm.live_jobs(submitted["name"]) == []
    states = _slurm.run(["sinfo", "--noheader", "--Node", "--format=%N %T"]).split("\n")
    assert not [s for s in states if "down" in s or "drain" in s], states
