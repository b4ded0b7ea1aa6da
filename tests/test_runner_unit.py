"""Small pieces of the runner that need no processes."""

from __future__ import annotations

from harness.runner import _params, baseline_key
from harness.spec import parse_scenario

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
