"""A user's own server, started as a plain `command:` and driven by a scenario-level `load:`
(docs/own-job.md, "Your own server").

The server is tests/fixtures/tiny_server.py: a standard-library OpenAI-compatible streaming
completions server whose deliberately broken variants (``--break``, or
``AFTERSHOCK_INJECT_TINY`` for one the fault-free twin goes without) each must be caught by
a serving check through the command path. Runs take a few seconds each (no torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aftershock.harness import api
from aftershock.harness.errors import SpecError
from aftershock.harness.run.records import RunResult
from aftershock.harness.twin.baseline import baseline_key

TINY = Path(__file__).resolve().parent / "fixtures" / "tiny_server.py"


def text(*, args: str = "", env: str = "{}", load: str = "", expect: str = "",
         faults: str = "", system: str = "") -> str:
    return f"""\
name: own-server
system:
  command: [{sys.executable}, {TINY}, '--port=${{port}}'{args}]
  env: {env}
  timeout: 60s
  {system}
load:
  url: 'http://127.0.0.1:${{port}}'
  requests: 12
  rate: 200
  concurrency: 6
  max_tokens: 8
  {load}
{faults}
expect:
  completes: true
  no_lost_requests: true
  no_duplicated_tokens: true
  {expect}
"""


def run(tmp_path: Path, scenario: str) -> RunResult:
    loaded = api.loads(scenario, folder=tmp_path)
    return api.run(loaded, run_dir=tmp_path / "run", use_cache=False)


def verdicts(result: RunResult) -> dict[str, tuple[bool, str]]:
    return {c.name: (c.passed, c.message) for c in result.checks}


# ------------------------------------------------------------------------ the format


def test_a_command_with_a_load_takes_serving_checks(tmp_path: Path) -> None:
    loaded = api.loads(text(expect="outputs_match: fault_free\n  latency: {ttft_p99: {max: 5s}}"),
                       folder=tmp_path)
    assert loaded.spec.load is not None
    assert loaded.spec.load.url == "http://127.0.0.1:${port}"


@pytest.mark.parametrize(("extra", "says"), [
    ("expect:\n  no_lost_requests: true\n", "expect.no_lost_requests needs a load"),
    ("  stop_grace: 30s\n", "system.stop_grace is how long a server gets"),
])
def test_what_needs_a_load_is_refused_without_one_naming_the_fix(
    tmp_path: Path, extra: str, says: str
) -> None:
    scenario = f"name: x\nsystem:\n  command: [{sys.executable}, {TINY}]\n{extra}"
    with pytest.raises(SpecError) as info:
        api.loads(scenario, folder=tmp_path)
    assert says in str(info.value)
    assert "load:" in str(info.value)


def test_the_reference_server_keeps_its_load_in_system(tmp_path: Path) -> None:
    scenario = ("name: x\nsystem: {reference: server}\nload: {url: 'http://127.0.0.1:1'}\n"
                "expect: {no_lost_requests: true}\n")
    with pytest.raises(SpecError) as info:
        api.loads(scenario, folder=tmp_path)
    assert "system.load" in str(info.value)


@pytest.mark.parametrize(("url", "says"), [
    ("ftp://127.0.0.1:1", "http://"),
    ("http://127.0.0.1", "port"),
    ("http://127.0.0.1:${port}/v1", "path"),
])
def test_a_bad_url_is_refused(tmp_path: Path, url: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        api.loads(text().replace("'http://127.0.0.1:${port}'", repr(url)), folder=tmp_path)
    assert says in str(info.value)


def test_port_needs_a_command_that_uses_it(tmp_path: Path) -> None:
    scenario = text().replace(", '--port=${port}'", "")
    with pytest.raises(SpecError) as info:
        api.loads(scenario, folder=tmp_path)
    assert "${port}" in str(info.value)


def test_the_twin_is_keyed_by_the_load(tmp_path: Path) -> None:
    one = api.loads(text(), folder=tmp_path).spec
    other = api.loads(text().replace("requests: 12", "requests: 13"), folder=tmp_path).spec
    patient = api.loads(text(load="retries: 3"), folder=tmp_path).spec
    assert baseline_key(one, 0, scenario_dir=tmp_path) != baseline_key(
        other, 0, scenario_dir=tmp_path)
    # How long clients insist never changes what a fault-free server answers.
    assert baseline_key(one, 0, scenario_dir=tmp_path) == baseline_key(
        patient, 0, scenario_dir=tmp_path)


# ------------------------------------------------------------------------ real servers


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_command_started_server_is_driven_and_judged(tmp_path: Path) -> None:
    result = run(tmp_path, text(expect="outputs_match: fault_free\n"
                                "  latency: {ttft_p99: {max: 10s}}"))
    assert result.passed, verdicts(result)
    assert result.metrics["requests"] == 12
    assert result.metrics["lost_requests"] == 0
    assert {"no_lost_requests", "no_duplicated_tokens", "outputs_match",
            "latency.ttft_p99"} <= set(verdicts(result))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("variant", "check", "says"), [
    ("truncate", "no_lost_requests", "did not complete"),
    ("repeat", "no_duplicated_tokens", "already had"),
    ("no_resume", "no_duplicated_tokens", "already had"),
])
def test_a_broken_server_is_caught(tmp_path: Path, variant: str, check: str,
                                   says: str) -> None:
    result = run(tmp_path, text(args=f", --break={variant}"))
    passed, detail = verdicts(result)[check]
    assert not passed, verdicts(result)
    assert says in detail


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_wrong_tokens_fail_outputs_match_against_the_commands_twin(tmp_path: Path) -> None:
    # The twin runs the same command without AFTERSHOCK_INJECT_*: the correct server.
    result = run(tmp_path, text(env="{AFTERSHOCK_INJECT_TINY: wrong}",
                                expect="outputs_match: fault_free"))
    passed, detail = verdicts(result)["outputs_match"]
    assert not passed, detail
    assert verdicts(result)["no_lost_requests"][0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tokens_without_an_index_cannot_prove_no_duplicates(tmp_path: Path) -> None:
    result = run(tmp_path, text(args=", --break=unindexed"))
    assert verdicts(result)["no_lost_requests"][0], verdicts(result)
    passed, detail = verdicts(result)["no_duplicated_tokens"]
    assert not passed
    assert "not observed" in detail
    assert "token_index" in detail


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_that_never_becomes_ready_fails_saying_so(tmp_path: Path) -> None:
    result = run(tmp_path, text(args=", --break=never_ready",
                                load="ready: {path: /v1/models, timeout: 2s}"))
    passed, detail = verdicts(result)["no_lost_requests"]
    assert not passed
    assert "never became ready" in detail
    assert "GET http://127.0.0.1:" in detail
    assert "/v1/models" in detail
    assert "HTTP 503" in detail
    assert result.duration_s < 30  # the run ended at the readiness timeout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_load_can_start_on_an_event_the_server_reports(tmp_path: Path) -> None:
    probe = ("  probes:\n    - {pattern: 'tiny server on', event: serving_ready, stream: stderr}\n")
    scenario = text(load="ready: {event: serving_ready}").replace("  timeout: 60s\n",
                                                              "  timeout: 60s\n" + probe)
    result = run(tmp_path, scenario)
    assert result.passed, verdicts(result)
    assert result.metrics["requests"] == 12


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_event_that_never_comes_fails_saying_which(tmp_path: Path) -> None:
    result = run(tmp_path, text(load="ready: {event: serving_ready, timeout: 1s}"))
    passed, detail = verdicts(result)["no_lost_requests"]
    assert not passed
    assert "never became ready: no `serving_ready` event within 1s" in detail


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_gets_its_stop_grace_after_the_load_and_no_more(tmp_path: Path) -> None:
    """Once the load is served the server is sent SIGTERM and `completes` wants exit 0
    within the scenario's `system.stop_grace` (10 s unless it says). A server that takes
    1.5 s to shut down (a journal's last fsync behind a busy disk, say) shut down cleanly
    within a grace of 3 s; one that never stops is killed once its 2 s are up, not after the
    default 10 s, and fails."""
    from aftershock.harness.run.target import SERVED_STOP_GRACE_S

    assert api.loads(text(), folder=tmp_path).spec.system.stop_grace.total_seconds() \
        == SERVED_STOP_GRACE_S == 10
    slow = run(tmp_path / "slow", text(args=", --stop-s=1.5", system="stop_grace: 3s"))
    assert verdicts(slow)["completes"][0], verdicts(slow)["completes"]
    stuck = run(tmp_path / "stuck", text(args=", --ignore-term", system="stop_grace: 2s"))
    passed, detail = verdicts(stuck)["completes"]
    assert not passed
    assert "-9" in detail, detail
    assert 2 <= stuck.duration_s < SERVED_STOP_GRACE_S, stuck.duration_s
