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
import warnings
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults.journal import Journal
from aftershock.faults.node import KILL
from aftershock.harness.oracle import full_membership, trainer_digests
from aftershock.harness.scenario.spec import TrainerSystem

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


def _kill_detection(timeline: list[dict[str, Any]], kill_started: float,
                    ) -> tuple[float | None, list[dict[str, Any]]]:
    """The first failure detected once the kill began, and the failures detected before it.

    A slow host may fail a world before the fault (a collective error, a failed save) and
    the launcher recovers it; that earlier detection is not the kill's, and taking it for
    the kill's would both misreport the detection time and fail the test for the wrong
    reason (seen in CI: a detection 2.4 s before the kill)."""
    failures = [e for e in timeline if e.get("event") == "failure_detected"]
    after = [e["t"] for e in failures if e["t"] >= kill_started]
    return (min(after) if after else None), [e for e in failures if e["t"] < kill_started]


def test_the_kills_detection_is_the_first_after_the_kill_not_an_earlier_one() -> None:
    timeline = [{"event": "step", "t": 1.0, "step": 4},
                {"event": "failure_detected", "t": 2.0, "cause": "checkpoint_failed: EIO"},
                {"event": "step", "t": 3.0, "step": 10},
                {"event": "failure_detected", "t": 4.5, "cause": "collective_error"},
                {"event": "failure_detected", "t": 4.2, "cause": "terminated"}]
    detected, earlier = _kill_detection(timeline, kill_started=4.0)
    assert detected == 4.2
    assert [e["cause"] for e in earlier] == ["checkpoint_failed: EIO"]
    assert _kill_detection(timeline[:3], kill_started=4.0) == (None, [timeline[1]])


# An earlier failure is shown in the run's warnings summary, not raised: it is not what
# this test judges, and CI's output should say what it was.
@pytest.mark.filterwarnings("always:failures detected before the kill:UserWarning")
def test_a_killed_node_comes_back_and_the_job_ends_bitwise_right(
        engine: None, tmp_path: Path) -> None:
    from aftershock.harness.nodes.cluster import Cluster, node_env, torchrun_argv

    run_id = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    for folder in ("output", "nvml", "logs"):
        (run_dir / folder).mkdir(parents=True)
    journal = Journal.create(run_id, folders=[run_dir])
    cluster = Cluster(run_id=run_id, run_dir=run_dir, nodes=2, env=node_env(run_dir, run_id),
                      cwd=Path.cwd(), restart="on-failure", max_restarts=2)
    journal.intend("nodes", cluster.tracking(), op="launch")
    program = [
        "-m",
        "aftershock.reference_impl.trainer",
        "--replicas=2",
        "--shards=1",
        f"--steps={STEPS}",
        "--seed=0",
        "--checkpoint-every=5",
        f"--checkpoint-dir={run_dir / 'ckpt'}",
        "--collective-timeout=5",
        "--recovery=restart",
        "--backend=gloo",
        "--step-sleep=0.05",
        "--device=cpu",
    ]
    events = run_dir / "events.jsonl"
    started = time.monotonic()
    try:
        cluster.make_network()
        cluster.start(
            [
                torchrun_argv(
                    nodes=2,
                    nproc=1,
                    rdzv_host=cluster.address(0),
                    run_id=run_id,
                    max_restarts=3,
                    log_dir=run_dir / "logs" / "torchrun",
                    program=program,
                )
            ]
            * 2
        )
        killed_at, kill_started = None, 0.0
        while (code := cluster.poll()) is None:
            assert time.monotonic() - started < 240, "the job never ended"
            if killed_at is None and any(
                e.get("event") == "step" and e.get("step", 0) >= KILL_AT for e in _events(events)
            ):
                victim = cluster.processes(1)
                assert victim, "node 1 has no process"
                kill_started = time.monotonic()
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
    system = TrainerSystem(
        reference="trainer", world={"replicas": 2, "shards": 1}, steps=STEPS, recovery="restart"
    )
    expected = trainer_digests(system, seed=0, schedule=full_membership(system))
    assert expected.digests is not None, expected.detail
    assert finals == expected.digests
    # One clock for every node: each node's events are on the harness's CLOCK_MONOTONIC.
    detected, earlier = _kill_detection(timeline, kill_started)
    if earlier:
        warnings.warn(
            f"failures detected before the kill (not the kill's): {earlier}; node 0's "
            f"log ends: {(run_dir / 'logs' / 'node0.log').read_text()[-2000:]}",
            stacklevel=1,
        )
    assert detected is not None, "nobody detected the node's death"
    resumed = min(e["t"] for e in timeline if e.get("event") == "step" and e["t"] > detected)
    assert detected < killed_at + 10.0, (detected - killed_at, earlier)
    print(
        f"start-up {cluster.timings}; detected {detected - killed_at:.2f}s after the kill, "
        f"first step again {resumed - killed_at:.2f}s after; whole run "
        f"{time.monotonic() - started:.1f}s"
    )
