"""The harness's serving side without the reference server: the load generator against
small real HTTP servers that misbehave on purpose, and the serving metrics and checks
on hand-written timelines."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness.run.loadgen import LoadGenerator, plan
from aftershock.harness.run.records import Event
from aftershock.harness.run.timeline import Timeline, read_events
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import Load
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import Outcome, evaluate

# A server's behaviour per request: (request id, offset, attempt) -> token indexes to send,
# and whether to end the stream with [DONE].
Behaviour = Callable[[str, int, int], tuple[list[int], bool]]


def _token(index: int, request: str) -> int:
    return (sum(request.encode()) * 31 + index * 7) % 256


def _digest(index: int, request: str) -> str | None:
    """The server's logits digest of a token; request ids ending in 2 get none."""
    return None if request.endswith("2") else f"{request}:{index}"


@pytest.fixture
def serve() -> Iterator[Callable[[Behaviour], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(behaviour: Behaviour,
              finish: Callable[[dict[str, Any]], tuple[int | None, str | None]] | None = None
              ) -> str:
        """``finish(body)``: (end the stream after this many tokens, the last one's
        finish_reason); the stream then ends with [DONE]. Default: as ``behaviour`` says."""
        attempts: dict[str, int] = {}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rid, offset = body["request_id"], body["offset"]
                attempts[rid] = attempts.get(rid, 0) + 1
                indexes, done = behaviour(rid, offset, attempts[rid])
                end, reason = finish(body) if finish is not None else (None, None)
                if end is not None:
                    indexes, done = [i for i in indexes if i < end], True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in indexes:
                    last = done and i == indexes[-1]
                    chunk = {"choices": [{"index": 0, "token_index": i,
                                          "token_ids": [_token(i, rid)], "text": "x",
                                          "logits_digest": _digest(i, rid),
                                          "finish_reason": reason if last else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if done:
                    self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


LOAD = Load(requests=6, rate=200.0, concurrency=3, max_tokens=5, retries=3,
            request_timeout=timedelta(seconds=10))


def _run(url: str, tmp_path: Path, load: Load = LOAD) -> list[Event]:
    timeline = Timeline(tmp_path / "events.jsonl")
    generator = LoadGenerator(url, load, seed=3, timeline=timeline)
    generator.start()
    assert generator.done.wait(30)
    generator.stop()
    timeline.close()
    return read_events(tmp_path / "events.jsonl")


def test_plan_is_seeded_and_shares_prefixes() -> None:
    load = Load(requests=8, shared_prefixes=2, prefix_tokens=10)
    first, again, other = plan(load, 1), plan(load, 1), plan(load, 2)
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert first[0].prompt[:10] == first[2].prompt[:10] != first[1].prompt[:10]
    assert all(load.prompt_tokens.min <= len(r.prompt) <= load.prompt_tokens.max
               for r in first)


def test_a_correct_server_loses_and_repeats_nothing(serve, tmp_path) -> None:
    url = serve(lambda rid, offset, attempt: (list(range(offset, 5)), True))
    m = metrics.serving(_run(url, tmp_path))
    assert (m["requests"], m["lost_requests"], m["duplicated_tokens"]) == (6, 0, 0)
    assert m["ttft_p50_s"] is not None
    assert m["tpot_p99_s"] is not None


def test_client_records_each_tokens_logits_digest(serve, tmp_path) -> None:
    url = serve(lambda rid, offset, attempt: (list(range(offset, 5)), True))
    outputs = metrics.outputs(_run(url, tmp_path))
    assert len(outputs) == 6
    for rid, output in outputs.items():
        assert output.tokens == tuple(_token(i, rid) for i in range(5))
        assert output.digests == tuple(_digest(i, rid) for i in range(5))
    assert any(None in o.digests for o in outputs.values())  # a server that sent none


def test_client_resumes_a_broken_stream_from_its_offset(serve, tmp_path) -> None:
    seen: list[tuple[int, int]] = []

    def flaky(rid: str, offset: int, attempt: int) -> tuple[list[int], bool]:
        seen.append((attempt, offset))
        if attempt == 1:
            return [0, 1], False  # the connection drops after two tokens
        return list(range(offset, 5)), True

    events = _run(serve(flaky), tmp_path)
    m = metrics.serving(events)
    assert (m["lost_requests"], m["duplicated_tokens"]) == (0, 0)
    assert (2, 2) in seen  # the second attempt asked for token 2 onwards
    done = [e for e in events if e.event == "request_done"]
    assert all(e.fields["resumes"] == 1 and len(e.fields["tokens"]) == 5 for e in done)


def test_client_counts_a_server_that_repeats_tokens(serve, tmp_path) -> None:
    # A broken server that restarts every stream from token 0 whatever the offset.
    def from_zero(rid: str, offset: int, attempt: int) -> tuple[list[int], bool]:
        return ([0, 1], False) if attempt == 1 else (list(range(5)), True)

    m = metrics.serving(_run(serve(from_zero), tmp_path))
    assert m["duplicated_tokens"] == 6 * 2
    assert m["lost_requests"] == 0


def test_client_gives_up_and_the_request_is_lost(serve, tmp_path) -> None:
    def drops(rid: str, offset: int, attempt: int) -> tuple[list[int], bool]:
        return ([], False) if rid.endswith("1") else (list(range(offset, 5)), True)

    m = metrics.serving(_run(serve(drops), tmp_path))
    assert m["lost_requests"] == 1
    assert m["lost_tokens"] == 5


def _eos_server(serve_http: Callable[..., str]) -> str:
    """Ends every stream at token 3 of 5 with `finish_reason: stop` (an end-of-sequence token,
    as a real model emits), unless the body asks for `ignore_eos` (vLLM's, SGLang's)."""
    return serve_http(lambda rid, offset, attempt: (list(range(offset, 5)), True),
                      finish=lambda body: (None, "length") if body.get("ignore_eos")
                      else (3, "stop"))


def test_a_request_the_server_ended_early_is_lost_and_the_check_says_why(
        serve, tmp_path) -> None:
    """A stream that the server ends before `max_tokens`, saying `stop`, may be an EOS or a
    recovery that cut it short: the check cannot tell them apart, so it stays lost, and the
    message says what happened and how to make the server generate every token."""
    events = _run(_eos_server(serve), tmp_path)
    m = metrics.serving(events)
    assert (m["lost_requests"], m["ended_early_requests"]) == (6, 6)
    [check] = [r for r in evaluate(parse_scenario(SERVER).expect, outcome=Outcome(0, False, 1.0),
                                   metrics=m, faults=[], digests={}, baseline=None,
                                   events=events)
               if r.name == "no_lost_requests"]
    assert not check.passed
    assert "6 of them the server ended early, saying finish_reason 'stop'" in check.message
    assert "extra_body: {ignore_eos: true}" in check.message


def test_extra_body_goes_into_every_request(serve, tmp_path) -> None:
    load = LOAD.model_copy(update={"extra_body": {"ignore_eos": True}})
    m = metrics.serving(_run(_eos_server(serve), tmp_path, load))
    assert (m["lost_requests"], m["ended_early_requests"]) == (0, 0)


@pytest.mark.parametrize("key", ["prompt", "max_tokens", "stream", "request_id", "offset"])
def test_extra_body_cannot_set_what_the_client_sends(key: str) -> None:
    with pytest.raises(ValueError, match=f"extra_body.*{key}.*the load generator sets it"):
        Load(extra_body={key: 1})


def test_extra_body_is_in_the_twin_key_only_when_given() -> None:
    from aftershock.harness.run.loadgen import twin_key

    assert "extra_body" not in twin_key(Load())
    assert twin_key(Load(extra_body={"ignore_eos": True}))["extra_body"] == {"ignore_eos": True}


# ---------------------------------------------------------- metrics on written timelines


def ev(t: float, event: str, source: str = "client", **fields: object) -> Event:
    return Event(t=t, event=event, source=source, fields=dict(fields))


def done(rid: str, sent: float, times: list[float], tokens: list[int] | None = None,
         digests: list[str | None] | None = None, **extra: object) -> Event:
    tokens = tokens if tokens is not None else list(range(len(times)))
    digests = digests if digests is not None else [f"d{t}" for t in tokens]
    return ev(times[-1] if times else sent, "request_done", request=rid, sent=sent,
              tokens=tokens, times=times, digests=digests, max_tokens=len(tokens),
              duplicates=0, **extra)


def out(tokens: list[int], digests: list[str | None] | None = None) -> metrics.Output:
    """A fault-free twin's output; digests as ``done`` makes them unless given."""
    return metrics.Output(tuple(tokens), tuple(digests if digests is not None
                                               else [f"d{t}" for t in tokens]))


def test_time_to_recover_is_the_slowest_request_in_flight_at_the_fault() -> None:
    events = [
        ev(0.0, "load_started"),
        ev(0.0, "request_sent", request="a"), ev(0.0, "request_sent", request="b"),
        ev(0.0, "request_sent", request="c"), ev(2.5, "request_sent", request="d"),
        ev(0.0, "request_sent", request="e"),
        ev(1.0, "fault_injected", "harness", kind="process.kill"),
        ev(1.2, "failure_detected", "process", cause="worker_exit"),
        done("a", 0.0, [0.1, 0.9]),            # finished before the fault: not affected
        done("b", 0.0, [0.1, 0.5, 1.05, 1.1]),  # on a healthy worker: 0.05 s
        done("c", 0.0, [0.1, 0.6, 1.8, 1.9]),   # migrated: 0.8 s
        # A token the dying worker had already sent arrives after the fault; the stall
        # that follows it is what the request waited: 0.7 s.
        done("e", 0.0, [0.1, 0.95, 1.02, 1.7, 1.75]),
        done("d", 2.5, [2.6, 2.7]),             # sent after the fault
    ]
    m = metrics.serving(sorted(events, key=lambda e: e.t))
    assert m["time_to_recover_s"] == pytest.approx(0.8)
    without_c = [r for r in metrics.requests(events) if r.id != "c"]
    assert metrics.serving_time_to_recover(without_c, 1.0) == pytest.approx(0.7)
    # A fault that landed after the load was served hit nothing: no recovery to measure.
    assert metrics.serving_time_to_recover(metrics.requests(events), 9.0) is None
    assert m["time_to_detect_s"] == pytest.approx(0.2)
    assert m["ttft_p50_s"] == pytest.approx(0.1)
    assert m["lost_requests"] == 0


def test_a_request_that_never_resumes_has_no_recovery_and_is_lost() -> None:
    events = [
        ev(0.0, "load_started"), ev(0.0, "request_sent", request="a"),
        ev(1.0, "fault_injected", "harness", kind="process.kill"),
        ev(9.0, "request_failed", request="a", sent=0.0, tokens=[1], times=[0.5],
           max_tokens=4, duplicates=0, error="gave up"),
    ]
    m = metrics.serving(events)
    assert m["time_to_recover_s"] is None
    assert (m["lost_requests"], m["lost_tokens"]) == (1, 3)


def _failed(request: str, sent: float, times: list[float], max_tokens: int = 4) -> Event:
    return ev(9.0, "request_failed", request=request, sent=sent,
              tokens=list(range(len(times))), times=times, max_tokens=max_tokens,
              duplicates=0, error="HTTP 503: no worker is ready")


LATENCY = """
name: s
system: {reference: server}
expect:
  latency: {ttft_p50: {max: 1s}, ttft_p99: {max: 1s}, tpot_p50: {max: 1s}, tpot_p99: {max: 1s}}
"""


def _latency(events: list[Event]) -> dict[str, Any]:
    results = evaluate(parse_scenario(LATENCY).expect, outcome=Outcome(0, False, 1.0),
                       metrics=metrics.serving(events), faults=[], digests={}, baseline=None,
                       events=events)
    return {r.name: r for r in results if r.name.startswith("latency.")}


def test_a_request_that_never_got_a_first_token_fails_every_ttft_budget_it_counts_in() -> None:
    # A fail-stop whose workers never came back (a real run, tests/serving/
    # test_serving_checks.py): 6 of 16 requests got their first tokens before the kill, and
    # the other 10 never got one. A time to first token taken over the 6 alone passed a
    # 1 s p99 budget, though most requests never saw a token at all.
    served = [done(f"r{i}", 0.0, [0.05, 0.06]) for i in range(6)]
    never = [_failed(f"n{i}", 0.1, []) for i in range(10)]
    events = [ev(0.0, "load_started"), *served, *never]
    checks = _latency(events)
    for name in ("latency.ttft_p50", "latency.ttft_p99"):
        assert not checks[name].passed, checks[name]
        assert "10 of 16 requests never got a first token" in checks[name].message
    m = metrics.serving(events)
    assert m["requests_without_first_token"] == 10
    assert m["ttft_p99_s"] is None
    assert m["ttft_p50_s"] is None
    # A percentile still means what it says: one request in 100 without a first token is
    # the 1% a p99 leaves out; two are not.
    most = [done(f"r{i}", 0.0, [0.05, 0.06]) for i in range(98)]
    one = _latency([ev(0.0, "load_started"), *most, done("r98", 0.0, [0.05]),
                    _failed("n0", 0.1, [])])
    assert one["latency.ttft_p50"].passed
    assert one["latency.ttft_p99"].passed
    two = _latency([ev(0.0, "load_started"), *most, _failed("n0", 0.1, []),
                    _failed("n1", 0.1, [])])
    assert two["latency.ttft_p50"].passed
    assert not two["latency.ttft_p99"].passed
    assert "2 of 100 requests never got a first token" in two["latency.ttft_p99"].message


def test_a_request_whose_tokens_stopped_fails_the_time_between_tokens() -> None:
    # Two requests stream a token every 50 ms; a third stops after two tokens and fails:
    # the wait for its third token never ended, which no time-between-tokens budget admits.
    events = [ev(0.0, "load_started"), done("a", 0.0, [0.05, 0.1, 0.15, 0.2]),
              done("b", 0.0, [0.05, 0.1, 0.15, 0.2]), _failed("c", 0.0, [0.05, 0.1])]
    checks = _latency(events)
    assert checks["latency.tpot_p50"].passed
    assert not checks["latency.tpot_p99"].passed, checks["latency.tpot_p99"]
    assert "1 of 3 requests stopped streaming" in checks["latency.tpot_p99"].message
    m = metrics.serving(events)
    assert m["requests_stalled"] == 1
    assert m["tpot_p50_s"] == pytest.approx(0.05)
    assert m["tpot_p99_s"] is None
    # Every request served whole: both budgets are measured.
    whole = [ev(0.0, "load_started"), done("a", 0.0, [0.05, 0.1, 0.15, 0.2])]
    assert all(c.passed for c in _latency(whole).values())


SERVER = """
name: s
system: {reference: server}
faults:
  - {kind: process.kill, target: {worker: 0}, at: {event: first_token, count: 2}}
expect:
  no_lost_requests: true
  no_duplicated_tokens: true
  outputs_match: fault_free
  latency: {ttft_p99: {max: 1s}}
"""


def _results(events: list[Event], baseline: dict[str, metrics.Output]) -> dict[str, Any]:
    expect = parse_scenario(SERVER).expect
    results = evaluate(expect, outcome=Outcome(0, False, 1.0), metrics=metrics.serving(events),
                       faults=[], digests={}, baseline=None, events=events,
                       outputs=metrics.outputs(events), baseline_outputs=baseline)
    return {r.name: r for r in results}


def _checks(events: list[Event], baseline: dict[str, metrics.Output]) -> dict[str, bool]:
    return {name: r.passed for name, r in _results(events, baseline).items()}


def test_serving_checks_pass_on_a_good_run_and_each_fails_on_its_fault() -> None:
    good = [ev(0.0, "load_started"), ev(0.0, "request_sent", request="a"),
            done("a", 0.0, [0.2, 0.3], [7, 8])]
    assert _checks(good, {"a": out([7, 8])}) == {
        "completes": True, "no_lost_requests": True, "no_duplicated_tokens": True,
        "outputs_match": True, "latency.ttft_p99": True}
    changed = _checks(good, {"a": out([7, 9])})
    assert not changed["outputs_match"]
    assert changed["no_lost_requests"]
    slow = [*good[:2], done("a", 0.0, [1.5, 1.6], [7, 8])]
    assert not _checks(slow, {"a": out([7, 8])})["latency.ttft_p99"]
    repeated = [*good[:2], ev(0.3, "request_done", request="a", sent=0.0, tokens=[7, 8],
                              times=[0.2, 0.3], digests=["d7", "d8"], max_tokens=2,
                              duplicates=2)]
    assert not _checks(repeated, {"a": out([7, 8])})["no_duplicated_tokens"]
    lost = good[:2]
    result = _checks(lost, {"a": out([7, 8])})
    assert not result["no_lost_requests"]
    assert not result["outputs_match"]


def test_outputs_match_compares_the_logits_not_only_the_tokens() -> None:
    """Equal tokens chosen from different logits (a numerics change greedy decoding hides)
    fail the check; so do tokens whose digests are unknown in either run: not observed."""
    sent = [ev(0.0, "load_started"), ev(0.0, "request_sent", request="a"),
            ev(0.0, "request_sent", request="b")]
    run = [*sent, done("a", 0.0, [0.2, 0.3], [7, 8]), done("b", 0.0, [0.2], [5])]
    same = {"a": out([7, 8]), "b": out([5])}
    assert _results(run, same)["outputs_match"].passed

    numerics = _results(run, {"a": out([7, 8], ["d7", "other"]), "b": out([5])})
    check = numerics["outputs_match"]
    assert not check.passed
    assert check.observed == "1/2 requests identical"
    assert "1 requests have the fault-free tokens but not its logits" in check.message
    assert "first a at token 1" in check.message

    # The run's server sent no digest for b's token: b is not verified, so not passed.
    blind = [*sent, done("a", 0.0, [0.2, 0.3], [7, 8]), done("b", 0.0, [0.2], [5], [None])]
    check = _results(blind, same)["outputs_match"]
    assert not check.passed
    assert "logits digests not observed (first b, 1 tokens)" in check.message
    # A baseline cached before digests existed (a bare token list) cannot vouch either.
    legacy = {"a": metrics.Output.from_json([7, 8]), "b": metrics.Output.from_json([5])}
    assert not _results(run, legacy)["outputs_match"].passed
    assert metrics.Output.from_json(out([7, 8]).to_json()) == out([7, 8])

    tokens = _results(run, {"a": out([7, 9]), "b": out([5])})["outputs_match"]
    assert not tokens.passed
    assert "1 requests differ in their tokens; first a at token 1" in tokens.message


def test_serving_checks_need_the_server_and_training_checks_the_trainer() -> None:
    from aftershock.harness.errors import SpecError

    with pytest.raises(SpecError, match=r"expect\.params_match needs a training system"):
        parse_scenario("name: s\nsystem: {reference: server}\nexpect: {params_match: fault_free}")
    with pytest.raises(SpecError, match=r"expect\.outputs_match needs a load: add a `load:`"):
        parse_scenario("name: s\nsystem: {reference: trainer}\nexpect: {outputs_match: fault_free}")


def test_twin_key_ignores_test_hooks_and_client_patience_but_not_the_rest() -> None:
    """Broken variants injected through AFTERSHOCK_INJECT_* (which the twin runs without) and
    how long clients retry share the correct server's fault-free twin; other env does not."""
    from aftershock.harness.run.runner import baseline_key

    base = "name: s\nsystem: {reference: server, %s}\n"
    spec = parse_scenario(base % "env: {PYTHONPATH: /x}")
    hooked = parse_scenario(base % "env: {PYTHONPATH: /x, AFTERSHOCK_INJECT_BROKEN_SERVING: a}")
    patient = parse_scenario(base % "env: {PYTHONPATH: /x}, load: {retries: 500, "
                             "request_timeout: 5m}")
    other_env = parse_scenario(base % "env: {PYTHONPATH: /y}")
    assert baseline_key(spec, 0) == baseline_key(hooked, 0) == baseline_key(patient, 0)
    assert baseline_key(spec, 0) != baseline_key(other_env, 0)


def test_requests_the_load_never_sent_are_lost() -> None:
    # The server died at the fault between two arrivals: the 6 requests sent before it had
    # all finished, and the run ended with the server, before the load generator sent the
    # other 10 of the 16 it planned. "All 6 requests completed" would pass a server that
    # never served again; the 10 never sent are lost, and they never got a first token.
    served = [done(f"r{i}", 0.1 * i, [0.1 * i + 0.05, 0.1 * i + 0.06]) for i in range(6)]
    events = [ev(0.0, "load_started", requests=16),
              *[ev(0.1 * i, "request_sent", request=f"r{i}") for i in range(6)], *served,
              ev(0.7, "fault_injected", "harness", kind="process.kill"),
              ev(0.8, "run_end", "harness", exit_code=1)]
    m = metrics.serving(events)
    assert (m["requests"], m["unsent_requests"], m["lost_requests"]) == (16, 10, 10)
    assert m["requests_without_first_token"] == 10
    assert m["ttft_p99_s"] is None
    result = _results(events, {})["no_lost_requests"]
    assert not result.passed, result
    assert "10 of 16 requests did not complete" in result.message
    assert "10 were never sent" in result.message
    assert "16 of 16" not in _latency(events)["latency.ttft_p99"].message
    assert "10 of 16 requests never got a first token" in \
        _latency(events)["latency.ttft_p99"].message
    # A load served whole: every planned request was sent, nothing is lost.
    whole = [ev(0.0, "load_started", requests=6), *served]
    assert metrics.serving(whole)["lost_requests"] == 0
    assert _results(whole, {})["no_lost_requests"].passed


def _in_flight(rid: str, sent: float, times: list[float]) -> list[Event]:
    return [ev(sent, "request_sent", request=rid), done(rid, sent, times)]


def test_time_to_recover_waits_for_the_requests_every_fault_hit() -> None:
    # Worker 0 is killed at 1.0 and its request streams again at 1.5; worker 1 is frozen at
    # 2.0 and its request never gets another token. Recovery from the first fault alone
    # (0.5 s) is no recovery of the run.
    events = sorted([
        ev(0.0, "load_started", requests=2),
        *_in_flight("a", 0.0, [0.1, 0.9, 1.5, 1.6]),
        ev(0.0, "request_sent", request="b"),
        _failed("b", 0.0, [0.1, 1.9]),
        ev(1.0, "fault_injected", "harness", kind="process.kill"),
        ev(2.0, "fault_injected", "harness", kind="process.freeze"),
    ], key=lambda e: e.t)
    assert metrics.serving(events)["time_to_recover_s"] is None
    # Had b streamed again at 2.7, the run recovered from both 1.7 s after the first fault.
    healed = [e for e in events if e.fields.get("request") != "b" or e.event == "request_sent"]
    healed.append(done("b", 0.0, [0.1, 1.9, 2.7, 2.8]))
    assert metrics.serving(sorted(healed, key=lambda e: e.t))["time_to_recover_s"] == \
        pytest.approx(1.7)


def test_a_request_that_streamed_once_more_and_then_died_did_not_recover() -> None:
    # Killed at 1.0: request a gets one more token at 1.5 from the replacement, which then
    # dies too, and a never finishes. Its last wait never ended: no recovery, whatever
    # the token at 1.5 looked like.
    events = [ev(0.0, "load_started", requests=1), ev(0.0, "request_sent", request="a"),
              ev(1.0, "fault_injected", "harness", kind="process.kill"),
              _failed("a", 0.0, [0.1, 0.9, 1.5])]
    assert metrics.serving(events)["time_to_recover_s"] is None
    finished = [*events[:3], done("a", 0.0, [0.1, 0.9, 1.5, 1.6])]
    assert metrics.serving(finished)["time_to_recover_s"] == pytest.approx(0.5)


RECOVER = """
name: s
system: {reference: server}
faults: [{kind: process.kill, target: {role: router}, at: {time: 1s}}]
expect:
  time_to_recover: {max: 30s}
"""


def _recover(events: list[Event]) -> Any:
    results = evaluate(parse_scenario(RECOVER).expect, outcome=Outcome(0, False, 1.0),
                       metrics=metrics.serving(events), faults=[], digests={}, baseline=None,
                       events=events)
    (check,) = [r for r in results if r.name == "time_to_recover"]
    return check


def test_a_server_not_observed_recovering_says_which_request_shows_it() -> None:
    # A power loss under the journal at 1.0 takes request b's only record: b never gets
    # another token, while a streams again. The reason named a trainer's ("no step was
    # reported after the fault"), which a server never reports.
    start = [ev(0.0, "load_started", requests=2), ev(0.0, "request_sent", request="a"),
             ev(0.0, "request_sent", request="b"),
             ev(1.0, "fault_injected", "harness", kind="storage.lose_unsynced", applied_at=1.0),
             done("a", 0.0, [0.1, 0.9, 1.5, 1.6])]
    check = _recover([*start, _failed("b", 0.0, [0.1, 0.5])])
    assert not check.passed
    assert check.message.startswith("recovery was not observed"), check.message
    assert "step" not in check.message, check.message
    assert "b, in flight at the fault, never got another token" in check.message, check.message
    # One more token, then it died: the wait that followed never ended.
    check = _recover([*start, _failed("b", 0.0, [0.1, 0.5, 1.4])])
    assert "b, in flight at the fault, never finished (3 of 4 tokens)" in check.message, \
        check.message
    # A request sent after the fault that never came back.
    check = _recover([*start, done("b", 0.0, [0.1, 1.2, 1.3]),
                      ev(1.5, "request_sent", request="c"), _failed("c", 1.5, [])])
    assert "c, sent after the fault, was never served whole" in check.message, check.message
    # A fault after the last request was served hit nothing a client could see.
    late = [ev(0.0, "load_started", requests=1), ev(0.0, "request_sent", request="a"),
            done("a", 0.0, [0.1, 0.2]),
            ev(1.0, "fault_injected", "harness", kind="process.kill", applied_at=1.0)]
    check = _recover(late)
    assert "no request was in flight at the fault" in check.message, check.message
    # Recovered: the budget judges it, and no reason is given.
    check = _recover([*start, done("b", 0.0, [0.1, 0.5, 1.7, 1.8])])
    assert check.passed, check.message
    assert check.observed == pytest.approx(0.7)


def test_a_server_that_serves_no_new_request_after_the_fault_did_not_recover() -> None:
    # Request a, in flight at the kill, moves and finishes; request c, sent after the kill,
    # never gets a token (the router stopped accepting work). Every request the fault hit
    # streamed again, yet the server never served again.
    events = [ev(0.0, "load_started", requests=2), ev(0.0, "request_sent", request="a"),
              ev(1.0, "fault_injected", "harness", kind="process.kill"),
              done("a", 0.0, [0.1, 0.9, 1.5, 1.6]), ev(1.5, "request_sent", request="c"),
              _failed("c", 1.5, [])]
    assert metrics.serving(events)["time_to_recover_s"] is None
    served = [*events[:-1], done("c", 1.5, [1.7, 1.8])]
    assert metrics.serving(served)["time_to_recover_s"] == pytest.approx(0.5)


def test_no_duplicated_tokens_needs_the_server_to_stream_after_the_fault() -> None:
    # Killed at 1.0 with request a in flight, and never a token again: no token was sent
    # twice because none was sent at all.
    events = [ev(0.0, "load_started", requests=1), ev(0.0, "request_sent", request="a"),
              ev(1.0, "fault_injected", "harness", kind="process.kill", applied_at=1.0),
              _failed("a", 0.0, [0.1, 0.9])]
    result = _results(events, {})["no_duplicated_tokens"]
    assert not result.passed, result
    assert result.message.startswith("not observed: no token arrived after the fault")
    # The same request resumed after the fault: now there is something to count.
    resumed = [*events[:3], done("a", 0.0, [0.1, 0.9, 1.5, 1.6])]
    assert _results(resumed, {})["no_duplicated_tokens"].passed
    # A fault after the load was served hit nothing in flight: nothing to resume, and
    # every token was counted.
    after = [ev(0.0, "load_started", requests=1), *_in_flight("a", 0.0, [0.1, 0.2]),
             ev(1.0, "fault_injected", "harness", kind="process.kill")]
    assert _results(after, {})["no_duplicated_tokens"].passed


def test_no_lost_requests_quotes_the_first_failure(serve, tmp_path) -> None:
    """The check says why requests were lost, not only how many: the first failure's error,
    as its client recorded it (a server whose chunks carry no `token_ids` loses every
    request, and only the error says so)."""
    def drops(rid: str, offset: int, attempt: int) -> tuple[list[int], bool]:
        return ([], False) if rid.endswith("1") else (list(range(offset, 5)), True)

    events = _run(serve(drops), tmp_path, LOAD.model_copy(update={"retries": 0}))
    [check] = [r for r in evaluate(parse_scenario(SERVER).expect, outcome=Outcome(0, False, 1.0),
                                   metrics=metrics.serving(events), faults=[], digests={},
                                   baseline=None, events=events)
               if r.name == "no_lost_requests"]
    assert not check.passed
    assert "the first failed request, req-3-00001: stream ended after 0 tokens" \
        in check.message, check.message
