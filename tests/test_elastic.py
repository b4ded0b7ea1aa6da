"""End-to-end test of ``--recovery elastic``: a replica drops out, comes back, and the run is
reproduced bit for bit by a deterministic replay of its membership log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_hot_spare import WORLD, full_strength_at, kill_rank_at, run_to_end


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_survivors_go_on_with_one_replica_and_replay_reproduces_it(tmp_path: Path) -> None:
    run, killed_at = kill_rank_at(tmp_path / "live", 1, 25, recovery="elastic")
    assert run.returncode == 0, run.log()
    assert sorted(run.digests()) == list(range(WORLD)), run.log()
    assert run.lost_steps() <= 1

    log = tmp_path / "live" / "output" / "membership.jsonl"
    generations = [json.loads(line) for line in log.read_text().splitlines()]
    # Both replicas, then replica 1 alone (replica 0 lost rank 1), then both again.
    assert [g["replicas"] for g in generations][:1] == [[0, 1]]
    assert [1] in [g["replicas"] for g in generations]
    assert generations[-1]["replicas"] == [0, 1]
    alone = [e for e in run.events("step") if e["t"] > killed_at and e.get("replicas") == 1]
    assert alone, "survivors never committed a step on their own"
    assert {e["rank"] for e in alone} == {2, 3}
    detected = min(e["t"] for e in run.events("failure_detected") if e["t"] >= killed_at)
    print(f"elastic: kill -> detect {(detected - killed_at) * 1000:.0f} ms, -> survivors "
          f"commit {(min(e['t'] for e in alone) - killed_at) * 1000:.0f} ms, -> full "
          f"strength {(full_strength_at(run, detected) - killed_at) * 1000:.0f} ms")  # fmt: skip

    replay = run_to_end(tmp_path / "replay", f"--replay={log}", recovery="elastic")
    assert replay.returncode == 0, replay.log()
    assert replay.digests() == run.digests()
    assert not replay.events("failure_detected")
