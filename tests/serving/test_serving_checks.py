"""Each serving check, shown failing on a deliberately broken server, through the harness.

The passing side is the shipped scenarios (scenarios/serving/, run by
tests/test_shipped_scenarios.py) against the correct server. Here the same kind of
scenario runs against a server broken on purpose by a test-only patch
(``tests/serving/broken/sitecustomize.py``, on the server's PYTHONPATH through
``system.env``; the fault-free twin runs without it), or with checksums off, or fail-stop
recovery, and the check that should catch it must fail while the checks it does not
concern still pass, so the failure is the check's doing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aftershock.harness.run.records import RunResult
from aftershock.harness.run.runner import baseline_key, run_scenario
from aftershock.harness.run.timeline import read_events
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.metrics import Output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BROKEN = Path(__file__).resolve().parent / "broken"  # its sitecustomize.py breaks the server

SYSTEM = """\
name: broken-{name}
system:
  reference: server
  workers: 2
  dead_after: 400ms
  step_sleep: 30ms
{system}
  env: {env}
  load: {{requests: 16, rate: 40, max_tokens: {tokens}, prompt_tokens: {{min: 40, max: 60}}}}
faults:
{faults}
expect:
{expect}
"""

KILL = """\
  - kind: process.kill
    target: {worker: 0}
    at: {event: first_token, count: 6}"""


def run(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, *, name: str,
        system: str, faults: str, expect: str, tokens: int = 16,
        broken: str | None = None) -> RunResult:
    """``broken``: the test-only variants of the server to run (sitecustomize.py). Every run
    has the folder on its PYTHONPATH, so broken and correct runs share one fault-free twin."""
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    env = {"PYTHONPATH": f"{BROKEN}:{ROOT}"}
    if broken:
        env["AFTERSHOCK_INJECT_BROKEN_SERVING"] = broken
    text = SYSTEM.format(name=name, system=system, faults=faults, expect=expect, tokens=tokens,
                         env=json.dumps(env))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                        run_dir=tmp_path / "run")


def verdicts(result: RunResult) -> dict[str, bool]:
    return {c.name: c.passed for c in result.checks}


def test_a_router_that_drops_in_flight_requests_loses_them(tmp_path, shared_cache,
                                                           monkeypatch) -> None:
    result = run(tmp_path, shared_cache, monkeypatch, name="drop", broken="drop_inflight",
                 system="", faults=KILL,
                 expect="  no_lost_requests: true\n  no_duplicated_tokens: true")
    assert verdicts(result) == {"completes": True, "faults_injected": True,
                                "no_lost_requests": False, "no_duplicated_tokens": True}
    assert result.metrics["lost_requests"] > 0
    assert result.metrics["lost_tokens"] > 0


def test_a_router_that_restarts_migrated_streams_repeats_tokens(tmp_path, shared_cache,
                                                                monkeypatch) -> None:
    result = run(tmp_path, shared_cache, monkeypatch, name="replay", broken="replay_from_zero",
                 system="", faults=KILL,
                 expect="  no_lost_requests: true\n  no_duplicated_tokens: true")
    assert verdicts(result) == {"completes": True, "faults_injected": True,
                                "no_lost_requests": True, "no_duplicated_tokens": False}
    assert result.metrics["duplicated_tokens"] > 0


def test_without_checksums_a_poisoned_kv_block_changes_outputs(tmp_path, shared_cache,
                                                               monkeypatch) -> None:
    poison = """\
  - kind: memory.bitflip
    target: {worker: 0}
    at: {event: first_token, count: 4}
    tensor: "kv:shared_prefix"
    bit: 30"""
    expect = "  no_lost_requests: true\n  outputs_match: fault_free"
    broken = run(tmp_path / "off", shared_cache, monkeypatch, name="poison-off",
                 system="  checksums: false", faults=poison, expect=expect, tokens=32)
    assert verdicts(broken) == {"completes": True, "faults_injected": True,
                                "no_lost_requests": True, "outputs_match": False}
    # The same flip against the correct server (checksums on, same cached baseline).
    good = run(tmp_path / "on", shared_cache, monkeypatch, name="poison-on",
               system="  checksums: true", faults=poison, expect=expect, tokens=32)
    assert good.passed, [c for c in good.checks if not c.passed]


def test_fail_stop_recovery_misses_a_migration_budget(tmp_path, shared_cache,
                                                      monkeypatch) -> None:
    # fail_stop errors out every in-flight request and restarts every worker cold; the
    # load generator's clients retry, so nothing is lost, but recovery takes a cold start.
    result = run(tmp_path, shared_cache, monkeypatch, name="failstop",
                 system="  recovery: fail_stop", faults=KILL,
                 expect="  time_to_recover: {max: 1s}\n  latency: {ttft_p99: {max: 1s}}")
    checks = verdicts(result)
    assert checks["time_to_recover"] is False
    assert checks["latency.ttft_p99"] is False
    assert result.metrics["time_to_recover_s"] is None or result.metrics["time_to_recover_s"] > 1


# --- the shipped scenarios of the paths no other scenario reaches, against broken variants ---


def shipped(scenario: str, broken: str) -> LoadedScenario:
    """A shipped scenario, unchanged but for the test-only ``broken`` variant of the server
    (its fault-free twin runs the correct server, and is shared with the correct run's)."""
    loaded = load_scenario(ROOT / "scenarios" / "serving" / f"{scenario}.yaml")
    system = loaded.spec.system
    env = {**system.env, "PYTHONPATH": f"{BROKEN}:{ROOT}",
           "AFTERSHOCK_INJECT_BROKEN_SERVING": broken}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    return LoadedScenario(spec, loaded.path, loaded.text)


def run_shipped(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                loaded: LoadedScenario) -> RunResult:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    return run_scenario(loaded, run_dir=tmp_path / "run")


def outputs_of(result: RunResult, loaded: LoadedScenario,
               cache: Path) -> tuple[dict[str, Output], dict[str, Output]]:
    """The run's outputs and its fault-free twin's (from the baseline cache)."""
    events = read_events(Path(result.run_dir) / "events.jsonl")
    path = cache / "fault_free" / f"{baseline_key(loaded.spec, result.seed)}.json"
    twin = {rid: Output.from_json(value)
            for rid, value in json.loads(path.read_text())["outputs"].items()}
    return metrics.outputs(events), twin


def test_a_reprefill_that_loses_batch_invariance_fails_outputs_match(tmp_path, shared_cache,
                                                                      monkeypatch) -> None:
    """kill_worker with migrated requests re-prefilled through the batched split-K kernel.
    Their tokens stay the fault-free ones, so a token comparison passes; the logits they
    were chosen from differ, and outputs_match, which compares those too, fails."""
    loaded = shipped("kill_worker", "reprefill_not_invariant")
    result = run_shipped(tmp_path, shared_cache, monkeypatch, loaded)
    checks = verdicts(result)
    assert checks["outputs_match"] is False
    assert checks["no_lost_requests"] is True
    assert result.metrics["migrated_requests"] > 0
    got, twin = outputs_of(result, loaded, shared_cache)
    assert {rid: o.tokens for rid, o in got.items()} == {rid: o.tokens for rid, o in twin.items()}
    changed = [rid for rid in twin if got[rid].digests != twin[rid].digests]
    assert changed
    (check,) = [c for c in result.checks if c.name == "outputs_match"]
    assert f"{len(changed)} requests have the fault-free tokens but not its logits" in check.message


def test_a_router_that_resumes_journaled_requests_from_zero_repeats_tokens(
        tmp_path, shared_cache, monkeypatch) -> None:
    """kill_router against a router whose journal replay restarts every unfinished request
    at token 0: resuming clients are sent every index they had again."""
    result = run_shipped(tmp_path, shared_cache, monkeypatch,
                         shipped("kill_router", "resume_from_zero"))
    checks = verdicts(result)
    assert checks["no_duplicated_tokens"] is False
    assert checks["no_lost_requests"] is True
    assert result.metrics["duplicated_tokens"] > 0


def test_prefix_hits_used_unverified_let_a_poisoned_idle_block_change_outputs(
        tmp_path, shared_cache, monkeypatch) -> None:
    """poison_idle_prefix_block against an engine that uses prefix-cache hits without their
    checksum check (verify-on-read stays on): the next request with the prefix reads the
    bad block before anything looks at it."""
    result = run_shipped(tmp_path, shared_cache, monkeypatch,
                         shipped("poison_idle_prefix_block", "unverified_hits"))
    checks = verdicts(result)
    assert checks["outputs_match"] is False
    assert checks["no_lost_requests"] is True
    assert checks["faults_injected"] is True


def test_a_router_that_ignores_the_resume_offset_repeats_tokens(tmp_path, shared_cache,
                                                                 monkeypatch) -> None:
    """fail_stop_resume against a router that streams a re-POSTed request from its first
    token whatever the offset: every client that resumed gets its tokens twice."""
    result = run_shipped(tmp_path, shared_cache, monkeypatch,
                         shipped("fail_stop_resume", "ignore_offset"))
    checks = verdicts(result)
    assert checks["no_duplicated_tokens"] is False
    assert checks["no_lost_requests"] is True
    assert result.metrics["duplicated_tokens"] > 0
