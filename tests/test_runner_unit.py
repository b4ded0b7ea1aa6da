"""Small pieces of the runner that need no processes."""

from __future__ import annotations

from aftershock.harness.run.runner import _params, baseline_key
from aftershock.harness.scenario.load import parse_scenario

SCENARIO = """\
name: x
system: {reference: trainer, step_sleep: 10ms}
faults:
  - {kind: process.term, target: {rank: 0}, at: {step: 1}, grace: 2s}
  - {kind: collective.delay, target: {rank: 0}, at: {step: 1}, delay: 250ms}
"""


def test_fault_parameters_reach_the_engine_as_seconds() -> None:
    spec = parse_scenario(SCENARIO)
    assert _params(spec.faults[0]) == {"grace": 2.0}
    assert _params(spec.faults[1]) == {"op": "all_reduce", "call": 1, "delay": 0.25}


def test_baseline_key_ignores_pacing_but_not_the_math() -> None:
    spec = parse_scenario(SCENARIO)
    paced = parse_scenario(SCENARIO.replace("10ms", "50ms"))
    longer = parse_scenario(SCENARIO.replace("step_sleep: 10ms", "steps: 300"))
    assert baseline_key(spec, 0) == baseline_key(paced, 0)
    assert baseline_key(spec, 0) != baseline_key(longer, 0)
    assert baseline_key(spec, 0) != baseline_key(spec, 1)


def test_baseline_key_ignores_what_only_recovery_uses_but_not_the_strategy() -> None:
    def key(extra: str) -> str:
        return baseline_key(parse_scenario(SCENARIO.replace("step_sleep: 10ms", extra)), 0)

    spare = key("recovery: hot_spare, spares: 1, snapshot_every: 1, collective_timeout: 3s")
    assert spare == key("recovery: hot_spare, spares: 2, snapshot_every: 10")
    assert key("checkpoint_every: 5, max_restarts: 0") == key("checkpoint_every: 20")
    assert spare != key("recovery: restart")
    assert spare != key("recovery: hot_spare, world: {replicas: 1, shards: 2}")


def test_server_baseline_key_ignores_timing_and_recovery_but_not_the_load() -> None:
    base = "name: s\nsystem: {reference: server, %s}\n"
    spec = parse_scenario(base % "dead_after: 1s")
    same = parse_scenario(base % "dead_after: 300ms, recovery: fail_stop, journal: false")
    other_load = parse_scenario(base % "load: {requests: 7}")
    other_kernel = parse_scenario(base % "batch_invariant: false")
    assert baseline_key(spec, 0) == baseline_key(same, 0)
    assert baseline_key(spec, 0) != baseline_key(other_load, 0)
    assert baseline_key(spec, 0) != baseline_key(other_kernel, 0)


def test_a_reused_run_dir_starts_with_a_fresh_timeline(tmp_path) -> None:
    import sys

    from aftershock.harness.run.runner import NullObserver, execute

    text = (f"name: x\nsystem:\n  command: [{sys.executable}, -c, \"from aftershock import "
            "probe; probe.emit('marker')\"]\n")
    spec = parse_scenario(text)
    for _ in range(2):
        execution = execute(spec, scenario_dir=tmp_path, run_dir=tmp_path / "run", seed=0,
                            observer=NullObserver())
        assert execution.outcome.exit_code == 0
        assert [e.event for e in execution.events].count("marker") == 1
        assert [e.event for e in execution.events].count("launch") == 1
