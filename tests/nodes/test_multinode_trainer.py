"""A 2-node torchrun job in two containers (c10d rendezvous across their addresses) running the
reference trainer with `restart`: one node dies mid-run, the engine's restart policy brings it
back, both nodes meet again and resume from the shared checkpoint. Every rank's final
parameters must equal what the independent oracle (harness/oracle) recomputes from the
model's math, bitwise; the detection and recovery times are printed (docs/nodes.md).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from faults.journal import Journal
from faults.node import KILL
from harness.oracle import full_membership, trainer_digests
from harness.spec import TrainerSystem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STEPS, KILL_AT = 30, 10


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def test_a_killed_node_comes_back_and_the_job_ends_bitwise_right(
        engine: None, tmp_path: Path) -> None:
    from harness.nodes.cluster import Cluster, node_env, torchrun_argv

    run_id = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    for folder in ("output", "nvml", "logs"):
        (run_dir / folder).mkdir(parents=True)
    journal = Journal.create(run_id, folders=[run_dir])
    cluster = Cluster(run_id=run_id, run_dir=run_dir, nodes=2, env=node_env(run_dir, run_id),
                      cwd=Path.cwd(), restart="on-failure", max_restarts=2)
    journal.intend("nodes", cluster.tracking(), op="launch")
    program = ["-m", "reference_impl.trainer", "--replicas=2", "--shards=1", f"--steps={STEPS}",
               "--seed=0", "--checkpoint-every=5", f"--checkpoint-dir={run_dir / 'ckpt'}",
               "--collective-timeout=5", "--recovery=restart", "--backend=gloo",
               "--step-sleep=0.05", "--device=cpu"]
    events = run_dir / "events.jsonl"
    started = time.monotonic()
    try:
        cluster.make_network()
        cluster.start([torchrun_argv(
            nodes=2, nproc=1, rdzv_host=cluster.address(0), run_id=run_id, max_restarts=3,
            log_dir=run_dir / "logs" / "torchrun", program=program)] * 2)
        killed_at = None
        while (code := cluster.poll()) is None:
            assert time.monotonic() - started < 240, "the job never ended"
            if killed_at is None and any(e.get("event") == "step" and e.get("step", 0) >= KILL_AT
                                         for e in _events(events)):
                victim = cluster.processes(1)
                assert victim, "node 1 has no process"
                KILL.inject(victim[0], {}, journal)
                killed_at = time.monotonic()
            time.sleep(0.1)
        states = cluster.states()
    finally:
        cluster.stop()
    assert killed_at is not None, "the job ended before the node was killed"
    assert code == 0, (run_dir / "logs" / "node0.log").read_text()[-3000:]
    assert [s.restarts for s in states] == [0, 1], states
    timeline = _events(events)
    finals = {e["rank"]: e["digest"] for e in timeline if e.get("event") == "params"}
    system = TrainerSystem(reference="trainer", world={"replicas": 2, "shards": 1},
                           steps=STEPS, recovery="restart")
    expected = trainer_digests(system, seed=0, schedule=full_membership(system))
    assert expected.digests is not None, expected.detail
    assert finals == expected.digests
    # One clock for every node: each node's events are on the harness's CLOCK_MONOTONIC.
    detected = min(e["t"] for e in timeline if e.get("event") == "failure_detected")
    resumed = min(e["t"] for e in timeline if e.get("event") == "step" and e["t"] > detected)
    assert killed_at - 1.0 < detected < killed_at + 10.0
    print(f"start-up {cluster.timings}; detected {detected - killed_at:.2f}s after the kill, "
          f"first step again {resumed - killed_at:.2f}s after; whole run "
          f"{time.monotonic() - started:.1f}s")
