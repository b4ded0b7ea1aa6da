"""Acknowledged before durable (issue 47, class 1), in milliseconds: the router's durability
path (its fault points, in order), where it says each token is journaled, resume-only
re-POSTs, and ``acknowledged_durable`` judging a journal file against clients' records.

The whole scenarios (a router crashed at each point, a power loss under the journal, and
the broken variants of tests/broken_serving/) are in tests/test_serving_durability_scenarios.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness.oracle.serving_journal import (
    JOURNAL_CHECKED,
    acknowledged_durable,
    judge,
    parse,
)
from aftershock.harness.run.records import Event
from aftershock.reference_impl.serving.journal import Journal, request_record, tokens_record
from aftershock.reference_impl.serving.router import (
    ApiError,
    Router,
    RouterConfig,
    parse_completion,
    token_event,
)

pytestmark = pytest.mark.timeout(60)


def test_a_batch_is_written_then_fsynced_then_reported_with_its_offsets(tmp_path: Path) -> None:
    """The router's durability path, in order: the journal's fault points come between the
    write and the fsync and between the fsync and telling the router, and the router is told
    only once the batch is durable, with where each record starts."""
    path = tmp_path / "j.wal"
    journal = Journal(path)
    seen: list[str] = []
    reported = threading.Event()

    def point(name: str) -> None:
        seen.append(f"{name} fsyncs={journal.stats().fsyncs}")

    def written(marks: list[tuple[object, int]]) -> None:
        seen.append(f"written fsyncs={journal.stats().fsyncs}")
        data = path.read_bytes()
        for mark, offset in marks:
            assert json.loads(data[offset + 9:].split(b"\n", 1)[0])["id"] == mark
        reported.set()

    journal.listen(written, point=point)
    journal.post(request_record("a", [1, 2], 4), "a")
    assert reported.wait(5)
    journal.close()
    assert seen[:3] == ["journal_appended fsyncs=0", "journal_synced fsyncs=1",
                        "written fsyncs=1"]


def test_a_new_journal_makes_its_name_durable(tmp_path: Path, monkeypatch) -> None:
    """A journal file's name survives a power loss only once its folder is fsynced."""
    synced: list[int] = []
    real = __import__("os").fsync
    monkeypatch.setattr("os.fsync", lambda fd: (synced.append(fd), real(fd))[1])
    Journal(tmp_path / "new.wal").close()
    assert len(synced) >= 2  # the folder, then the file at close


def test_a_reopened_journal_is_durable_before_anything_is_served_from_it(
        tmp_path: Path, monkeypatch) -> None:
    """A router killed between writing a batch and fsyncing it leaves the batch in the
    kernel only; its successor replays it and streams it to resuming clients, so opening
    fsyncs what it replayed (scenarios/serving/crash_router_then_power_loss.yaml)."""
    path = tmp_path / "j.wal"
    first = Journal(path, fsync_interval=3600)
    first.request("a", [1], 2)  # written, never fsynced: the writer died here
    synced: list[int] = []
    real = __import__("os").fsync
    monkeypatch.setattr("os.fsync", lambda fd: (synced.append(fd), real(fd))[1])
    second, replayed = Journal.open(path, fsync_interval=3600)
    try:
        assert "a" in replayed.requests
        assert synced == [second._fd]  # before the caller could serve anything from it
    finally:
        second.close()
        first._closed = True  # died: its descriptor goes without the fsync close() makes
        __import__("os").close(first._fd)


def test_each_token_event_says_where_its_record_is() -> None:
    render = token_event("r1", "m", [0, 120])
    body = json.loads(render(1, 1, 65, "d", False)[6:])
    assert body["choices"][0]["journal_offset"] == 120
    without = json.loads(token_event("r1", "m")(0, 0, 65, "d", False)[6:])
    assert without["choices"][0]["journal_offset"] is None
    assert without["choices"][0]["journal_writer"] is None
    named = token_event("r1", "m", [0, 120], lambda offset: f"w{offset}")
    assert json.loads(named(1, 1, 65, "d", False)[6:])["choices"][0]["journal_writer"] == "w120"


def test_a_resume_only_post_never_starts_a_request() -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "resume": True}).encode()
    with pytest.raises(ApiError, match="resume needs a request_id"):
        parse_completion(body, None)
    assert parse_completion(body, "r1").resume
    router = Router(RouterConfig(workers=1))
    try:
        with pytest.raises(ApiError) as refused:
            router.submit("r1", "hi", 2, resume=True)
        assert refused.value.status == 404
        assert router.stats()["requests"]["accepted"] == 0
    finally:
        router.stop()


# --- the judge: a journal file against what clients received -----------------------------


def _journal(tmp_path: Path, records: list[dict[str, object]]) -> tuple[bytes, list[int]]:
    """The bytes of a journal holding ``records``, and where each starts."""
    path = tmp_path / "j.wal"
    journal = Journal(path, fsync_interval=0)
    journal.writer = WRITER
    for record in records:
        journal._append(record)
    journal.close()
    data = path.read_bytes()
    starts = [0, *[i + 1 for i, b in enumerate(data) if b == 10][:-1]]
    return data, starts


WRITER = "w-test"  # the writer `_journal`'s records name


def _client(rid: str, tokens: list[int], offsets: list[int | None],
            **fields: Any) -> dict[str, Any]:
    return {"request": rid, "tokens": tokens, "digests": [f"d{t}" for t in tokens],
            "journal_offsets": offsets, "journal_writers": [WRITER] * len(offsets),
            "acknowledged": True, "server_errors": 0, **fields}


def test_tokens_where_the_server_said_are_proven(tmp_path: Path) -> None:
    data, at = _journal(tmp_path, [request_record("a", [1], 3),
                                   tokens_record("a", 0, [5, 6], ["d5", "d6"]),
                                   tokens_record("a", 2, [7], ["d7"])])
    facts = judge(parse(data), [_client("a", [5, 6, 7], [at[1], at[1], at[2]])])
    assert (facts["tokens_seen"], facts["tokens_proven"], facts["missing_tokens"]) == (3, 3, 0)


def test_a_token_shown_before_a_power_loss_took_its_record_is_missing(tmp_path: Path) -> None:
    """After the loss the restarted server wrote something else where the lost record was,
    or nothing: either way the token the client saw is not there."""
    data, at = _journal(tmp_path, [request_record("a", [1], 3),
                                   tokens_record("a", 0, [5], ["d5"]),
                                   tokens_record("b", 0, [9], ["d9"])])
    facts = judge(parse(data), [_client("a", [5, 6, 7], [at[1], at[2], len(data) + 40])])
    assert facts["missing_tokens"] == 2
    assert "a record without this token" in facts["missing"][0]
    assert "the file is shorter" in facts["missing"][1]


def test_a_token_written_again_by_a_restarted_server_does_not_prove_the_one_shown(
        tmp_path: Path) -> None:
    """A power loss took a record the client had been shown; the restarted server wrote the
    same token again at the same offset. Its writer differs, so it proves nothing."""
    path = tmp_path / "j.wal"
    first = Journal(path, fsync_interval=0)
    first._append(request_record("a", [1], 3))
    lost_at = first._size
    first._append(tokens_record("a", 0, [5], ["d5"]))
    first.close()
    assert first.writer_at(lost_at) == first.writer
    shown = _client("a", [5], [lost_at], journal_writers=[first.writer])
    assert judge(parse(path.read_bytes()), [shown])["tokens_proven"] == 1
    import os
    os.truncate(path, lost_at)  # the power loss: the token record never reached the disk
    second, _ = Journal.open(path, fsync_interval=0)
    second._append(tokens_record("a", 0, [5], ["d5"]))
    second.close()
    assert second.writer != first.writer
    facts = judge(parse(path.read_bytes()), [shown])
    assert (facts["tokens_proven"], facts["missing_tokens"]) == (0, 1)
    assert "written by another process" in facts["missing"][0]
    # What the restarted server shows of the replayed records names their first writer.
    reopened, _ = Journal.open(path, fsync_interval=0)
    assert reopened.writer_at(0) == first.writer
    assert reopened.writer_at(lost_at) == second.writer
    reopened.close()
    # Records that name their writer, a client that was not told it: nothing is proven.
    unnamed = judge(parse(path.read_bytes()), [_client("a", [5], [lost_at], journal_writers=[])])
    assert (unnamed["tokens_proven"], unnamed["tokens_unplaced"]) == (0, 1)


def test_a_request_started_again_from_scratch_is_a_redo(tmp_path: Path) -> None:
    records = [request_record("a", [1], 2), tokens_record("a", 0, [5], ["d5"]),
               request_record("a", [1], 2), tokens_record("a", 0, [5], ["d5"]),
               tokens_record("a", 1, [6], ["d6"])]
    data, at = _journal(tmp_path, records)
    client = _client("a", [5, 6], [at[1], at[4]])
    assert judge(parse(data), [client])["redone_requests"] == 1
    # A client the server told the request failed asked for the retry: not a redo.
    told = judge(parse(data), [{**client, "server_errors": 1}])
    assert told["redone_requests"] == 0


def test_an_acknowledged_request_the_journal_lacks_is_unknown(tmp_path: Path) -> None:
    data, _ = _journal(tmp_path, [request_record("a", [1], 2)])
    facts = judge(parse(data), [_client("b", [], [])])
    assert facts["unknown_requests"] == 1
    assert judge(parse(data), [_client("b", [], [], acknowledged=False)])["unknown_requests"] == 0


def test_a_token_received_before_its_record_was_fsynced_is_early(tmp_path: Path) -> None:
    """The journal's fsyncs as the harness's lazy filesystem saw them (when each returned,
    the size it made durable): a token whose record no fsync had covered when the client
    received it was shown before it was durable, whether or not a power loss then took it."""
    data, at = _journal(tmp_path, [request_record("a", [1], 3),
                                   tokens_record("a", 0, [5], ["d5"]),
                                   tokens_record("a", 1, [6], ["d6"]),
                                   tokens_record("a", 2, [7], ["d7"])])
    ends = [*at[1:], len(data)]  # where each record's line ends
    # Durable through token 5's record at 1.0, through 6's at 2.0; 7's never.
    syncs = {"syncs": [[1.0, ends[1]], [2.0, ends[2]]], "complete": True}
    client = _client("a", [5, 6, 7], [at[1], at[2], at[3]], times=[1.5, 1.9, 2.5])
    facts = judge(parse(data), [client], syncs)
    assert (facts["tokens_proven"], facts["tokens_timed"], facts["early_tokens"]) == (3, 3, 2)
    assert facts["fsyncs_seen"] == 2
    assert facts["early"] == [
        f"a token 1 (6) at offset {at[2]}: received 0.100 s before the fsync that made its "
        "record durable",
        f"a token 2 (7) at offset {at[3]}: received before its record was durable: no fsync "
        "covered it before the run's end"]
    # Received only after the fsync returned: durable first, as a correct server does.
    late = judge(parse(data), [_client("a", [5, 6], [at[1], at[2]], times=[1.5, 2.01])], syncs)
    assert (late["tokens_timed"], late["early_tokens"]) == (2, 0)
    # At the very instant the fsync returned is not after it.
    same = judge(parse(data), [_client("a", [5, 6], [at[1], at[2]], times=[1.5, 2.0])], syncs)
    assert same["early_tokens"] == 1
    # Where the oldest fsyncs were dropped, a token received before the first kept one is
    # not judged; without the fsyncs (no lazy filesystem) none is.
    cut = judge(parse(data), [_client("a", [5], [at[1]], times=[0.5])],
                {"syncs": [[1.0, ends[1]]], "complete": False})
    assert (cut["tokens_timed"], cut["early_tokens"]) == (0, 0)
    blind = judge(parse(data), [client])
    assert (blind["fsyncs_seen"], blind["tokens_timed"], blind["early_tokens"]) == (None, 0, 0)
    garbled = judge(parse(data), [client], {"syncs": [["x", 1], [1.0]], "complete": True})
    assert (garbled["fsyncs_seen"], garbled["tokens_timed"]) == (None, 0)


def _events(facts: dict[str, Any] | None, *, fault_at: float | None,
            times: list[float]) -> list[Event]:
    events = [Event(0.0, "request_sent", "client", {"request": "a"})]
    if fault_at is not None:
        events.append(Event(fault_at, "fault_injected", "harness", {"kind": "process.kill"}))
    events.append(Event(9.0, "request_done", "client", {
        "request": "a", "sent": 0.0, "tokens": [5] * len(times), "times": times,
        "max_tokens": len(times)}))
    if facts is not None:
        events.append(Event(9.5, JOURNAL_CHECKED, "harness", facts))
    return events


GOOD = {"found": True, "tokens_seen": 2, "tokens_proven": 2, "tokens_unplaced": 0,
        "missing_tokens": 0, "redone_requests": 0, "unknown_requests": 0}


def test_acknowledged_durable_passes_only_with_a_request_across_a_fault() -> None:
    assert acknowledged_durable(_events(GOOD, fault_at=1.5, times=[1.0, 2.0])).passed
    no_fault = acknowledged_durable(_events(GOOD, fault_at=None, times=[1.0, 2.0]))
    assert not no_fault.passed
    assert "not observed" in no_fault.message
    after = acknowledged_durable(_events(GOOD, fault_at=3.0, times=[1.0, 2.0]))
    assert not after.passed
    assert "no request streamed across a fault" in after.message


def test_acknowledged_durable_says_not_observed_without_its_evidence() -> None:
    assert "not observed" in acknowledged_durable(
        _events(None, fault_at=1.5, times=[1.0, 2.0])).message
    unplaced = {**GOOD, "tokens_unplaced": 2}
    result = acknowledged_durable(_events(unplaced, fault_at=1.5, times=[1.0, 2.0]))
    assert not result.passed
    assert "without a journal_offset" in result.message
    missing = {"found": False, "path": "/x/journal.wal", "error": "FileNotFoundError"}
    assert "not observed: no journal" in acknowledged_durable(
        _events(missing, fault_at=1.5, times=[1.0, 2.0])).message


def test_acknowledged_durable_names_what_is_missing() -> None:
    bad = {**GOOD, "missing_tokens": 1, "missing": ["a token 1 (5) at offset 9: nothing"]}
    result = acknowledged_durable(_events(bad, fault_at=1.5, times=[1.0, 2.0]))
    assert not result.passed
    assert "1 tokens a client received are not in the journal" in result.message
    assert "a token 1 (5) at offset 9" in result.message


def test_acknowledged_durable_fails_tokens_shown_before_they_were_durable() -> None:
    early = {**GOOD, "fsyncs_seen": 12, "tokens_timed": 2, "early_tokens": 1,
             "early": ["a token 1 (5) at offset 9: received 0.040 s before the fsync that "
                       "made its record durable"]}
    result = acknowledged_durable(_events(early, fault_at=1.5, times=[1.0, 2.0]))
    assert not result.passed
    assert "1 tokens a client received before their journal record was durable (fsynced): " \
        "a token 1 (5) at offset 9: received 0.040 s before" in result.message, result.message
    timed = {**early, "early_tokens": 0, "early": []}
    result = acknowledged_durable(_events(timed, fault_at=1.5, times=[1.0, 2.0]))
    assert result.passed, result.message
    assert "2 of them durable before they were received (12 fsyncs of the journal seen)" \
        in result.message, result.message


# --- a client that never submits a request twice ------------------------------------------


def test_a_client_that_never_resubmits_loses_a_request_the_server_forgot(tmp_path: Path
                                                                         ) -> None:
    """``resubmit: false``: after the server acknowledged a request, a broken stream is only
    resumed (``resume: true``); a 404 to that is the request lost, at once, not retried."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from aftershock.harness.run.loadgen import Load, LoadGenerator
    from aftershock.harness.run.timeline import Timeline, read_events

    bodies: list[dict[str, Any]] = []

    class Forgetful(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) > 1:  # the restarted server no longer has it
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "not known"}}')
                return
            self.send_response(200)
            self.end_headers()
            chunk = {"choices": [{"token_ids": [65], "token_index": 0, "logits_digest": "d",
                                  "journal_offset": 7}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")  # then breaks

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forgetful)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        load = Load(requests=1, max_tokens=3, retries=5, resubmit=False)
        timeline = Timeline(tmp_path / "events.jsonl")
        generator = LoadGenerator(f"http://127.0.0.1:{server.server_address[1]}", load,
                                  seed=0, timeline=timeline)
        generator.start()
        assert generator.done.wait(30)
    finally:
        server.shutdown()
        server.server_close()
    assert "resume" not in bodies[0]
    assert bodies[1]["resume"] is True
    assert bodies[1]["offset"] == 1
    assert len(bodies) == 2  # lost at once: no more attempts
    (failed,) = [e for e in read_events(tmp_path / "events.jsonl")
                 if e.event == "request_failed"]
    assert "acknowledged, then lost" in failed.fields["error"]
    assert failed.fields["journal_offsets"] == [7]
    assert failed.fields["acknowledged"] is True
