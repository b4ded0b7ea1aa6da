"""The router's write-ahead journal: round trip, torn and damaged tails, idempotent request ids.

No processes, no torch: a Router built on a replayed journal serves what the journal holds
without any worker, which is how a restarted router answers a client that resumes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from aftershock.reference_impl.serving.journal import (
    Journal,
    bench,
    finish_record,
    replay,
    request_record,
    stall_bench,
    tokens_record,
)
from aftershock.reference_impl.serving.router import (
    ApiError,
    Chunk,
    End,
    Router,
    RouterConfig,
    encode,
    parse_completion,
)

pytestmark = pytest.mark.timeout(30)


def _write(path: Path) -> None:
    journal = Journal(path)
    journal.request("a", [1, 2, 3], 4)
    journal.request("b", encode("héllo"), 3)
    journal.token_runs([("a", 0, [10], ["d-a0"]), ("b", 0, [7], ["d-b0"])])
    journal.tokens("a", 1, [11], ["d-a1"])
    journal.tokens("a", 2, [12, 13], ["d-a2", "d-a3"])
    journal.finish("a")
    journal.close()


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    _write(path)
    found = replay(path)
    assert found.records == 6
    assert found.ignored_bytes == 0
    assert found.valid_bytes == path.stat().st_size
    a, b = found.requests["a"], found.requests["b"]
    assert (a.prompt, a.max_tokens, a.tokens, a.finished, a.error) == (
        (1, 2, 3), 4, [10, 11, 12, 13], True, None)
    assert a.digests == ["d-a0", "d-a1", "d-a2", "d-a3"]
    assert (b.prompt, b.tokens, b.digests, b.finished) == (
        tuple("héllo".encode()), [7], ["d-b0"], False)
    assert list(found.requests) == ["a", "b"]  # acceptance order


def test_a_record_without_digests_replays_them_unknown(tmp_path: Path) -> None:
    """A journal written before tokens carried digests: its tokens replay, their digests
    are unknown (empty), so nothing downstream can take them for verified."""
    path = tmp_path / "j.wal"
    journal = Journal(path)
    journal.request("a", [1], 4)
    journal._append({"r": "tok", "id": "a", "i": 0, "t": [5, 6]})
    journal._append({"r": "toks", "runs": [["a", 2, [7]]]})
    journal.tokens("a", 3, [8], ["d3"])
    journal.close()
    found = replay(path).requests["a"]
    assert (found.tokens, found.digests) == ([5, 6, 7, 8], ["", "", "", "d3"])


def test_error_finish_and_fsync_each(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    journal = Journal(path, fsync_interval=0)
    journal.request("x", [1], 2)
    journal.finish("x", "worker 1 failed; retry")
    stats = journal.stats()
    journal.close()
    assert stats.records == 2
    assert stats.fsyncs == 2  # fsync_interval=0: one per record
    assert replay(path).requests["x"].error == "worker 1 failed; retry"


def test_torn_tail_is_ignored_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    _write(path)
    whole = path.stat().st_size
    with path.open("ab") as handle:  # a crash in the middle of a write
        handle.write(b'0badf00d {"r":"tok","id":"b","i":1,"t":[8')
    found = replay(path)
    assert found.records == 6
    assert found.valid_bytes == whole
    assert found.ignored_bytes == path.stat().st_size - whole
    assert found.requests["b"].tokens == [7]
    # Reopening cuts the torn tail, so the next record is not glued to garbage.
    journal, again = Journal.open(path)
    assert again.ignored_bytes > 0
    assert path.stat().st_size == whole
    journal.tokens("b", 1, [8], ["d-b1"])
    journal.close()
    after = replay(path)
    assert after.ignored_bytes == 0
    assert after.requests["b"].tokens == [7, 8]


def test_damaged_record_stops_replay(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    _write(path)
    lines = path.read_bytes().splitlines(keepends=True)
    # Change one token of the third record without fixing its checksum: a bit rot.
    assert b'"a",0,[10]' in lines[2]
    lines[2] = lines[2].replace(b'"a",0,[10]', b'"a",0,[19]')
    path.write_bytes(b"".join(lines))
    found = replay(path)
    assert found.records == 2  # everything after the damaged record is distrusted
    assert found.requests["a"].tokens == []
    assert found.ignored_bytes == sum(len(line) for line in lines[2:])


def test_a_gap_in_tokens_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    journal = Journal(path)
    journal.request("a", [1], 8)
    journal.tokens("a", 0, [5], ["d0"])
    journal.tokens("a", 2, [6], ["d2"])  # index 1 never journaled: impossible in a sound one
    journal.close()
    found = replay(path)
    assert found.requests["a"].tokens == [5]
    assert found.records == 2


def _router_on(path: Path) -> tuple[Router, Journal]:
    journal, found = Journal.open(path)
    return Router(RouterConfig(workers=1), journal, found), journal


def _drain(router: Router, request: object, offset: int = 0) -> tuple[list[int], End]:
    items = list(router.stream(request, offset))  # type: ignore[arg-type]
    end = items.pop()
    assert isinstance(end, End)
    assert all(isinstance(c, Chunk) for c in items)
    return [c.index for c in items], end  # type: ignore[union-attr]


def test_idempotent_request_id_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "j.wal"
    _write(path)
    router, journal = _router_on(path)
    try:
        # No worker is connected: a known id is still served, from the journal.
        request = router.submit("a", "\x01\x02\x03", 4)
        indices, end = _drain(router, request, offset=2)
        assert indices == [2, 3]
        assert end.error is None
        assert [(c.token, c.digest) for c in router.stream(request)
                if isinstance(c, Chunk)] == [
            (10, "d-a0"), (11, "d-a1"), (12, "d-a2"), (13, "d-a3")]
        assert router.submit("a", "\x01\x02\x03", 4) is request  # never a second generation
        with pytest.raises(ApiError) as conflict:
            router.submit("a", "other", 4)
        assert (conflict.value.status, conflict.value.param) == (409, "prompt")
        with pytest.raises(ApiError) as conflict:
            router.submit("a", "\x01\x02\x03", 5)
        assert (conflict.value.status, conflict.value.param) == (409, "max_tokens")
        # A new request needs a worker.
        with pytest.raises(ApiError) as unavailable:
            router.submit("new", "hello", 4)
        assert unavailable.value.status == 503
        stats = router.stats()
        assert stats["requests"]["resumed_from_journal"] == 1  # "b" waits for a worker
        assert stats["requests"]["pending"] == 1
        assert stats["journal"]["enabled"] is True
    finally:
        router.stop()
        journal.close()


def test_parse_completion_names_the_field() -> None:
    ok = parse_completion(b'{"prompt": "hi", "max_tokens": 3, "stream": true, "model": "x"}',
                          "key-1")
    assert (ok.prompt, ok.max_tokens, ok.stream, ok.request_id, ok.offset) == (
        "hi", 3, True, "key-1", 0)
    cases = {
        b"not json": None,
        b"[]": None,
        b'{"prompt": 3}': "prompt",
        b'{"prompt": "x", "max_tokens": 0}': "max_tokens",
        b'{"prompt": "x", "max_tokens": true}': "max_tokens",
        b'{"prompt": "x", "stream": "yes"}': "stream",
        b'{"prompt": "x", "offset": -1}': "offset",
        b'{"prompt": "x", "max_tokens": 2, "offset": 3}': "offset",
        b'{"prompt": "x", "request_id": ""}': "request_id",
    }
    for body, param in cases.items():
        with pytest.raises(ApiError) as bad:
            parse_completion(body, None)
        assert bad.value.status == 400
        assert bad.value.param == param, body
    with pytest.raises(ApiError) as bad:
        parse_completion(b'{"prompt": "x", "request_id": "a"}', "b")
    assert bad.value.param == "request_id"


def test_bench_measures_something(tmp_path: Path) -> None:
    result = bench(str(tmp_path), records=200)
    assert set(result) == {"write_only_us", "batched_fsync_us", "fsync_each_us"}
    assert all(v > 0 for v in result.values())
    assert not os.listdir(tmp_path)
    json.dumps(result)


def test_posted_records_are_written_in_order_and_then_reported(tmp_path: Path) -> None:
    """The writer thread keeps the order of the posts (a replay needs a request's records in
    order), reports each mark only once its record is in the file and fsynced, with the byte
    offset its record starts at, and close() writes what was still queued."""
    path = tmp_path / "j.wal"
    journal = Journal(path)
    reported: list[object] = []

    def written(marks: list[tuple[object, int]]) -> None:
        on_disk = replay(path)
        data = path.read_bytes()
        for mark, offset in marks:  # each reported record is already in the file, there
            assert on_disk.records > int(str(mark)), mark
            assert data[offset + 9:].startswith(b'{"r":'), (mark, offset)
        assert journal.stats().fsyncs >= 1  # durable before it is reported
        reported.extend(mark for mark, _ in marks)

    journal.listen(written)
    journal.post(request_record("a", [1, 2], 40), 0)
    for i in range(40):
        journal.post(tokens_record("a", i, [i], [f"d{i}"]), i + 1)
    journal.post(finish_record("a"), 41)
    journal.close()
    assert reported == list(range(42))
    found = replay(path)
    assert found.records == 42
    assert found.requests["a"].tokens == list(range(40))
    assert found.requests["a"].finished
    stats = journal.stats()
    assert stats.records == 42
    assert 1 <= stats.writes <= 42  # batches: one write(2) for what piled up


def test_the_journal_counts_its_own_threads_cpu(tmp_path: Path) -> None:
    """``cpu_s``: the CPU of the writer thread (framing, write(2), the listener) and of the
    fsync thread, what the bench reports as the journal's part of the router's CPU. A
    listener that burns CPU shows in it; records appended on the caller's thread do not."""
    journal = Journal(tmp_path / "direct.wal")
    for i in range(200):
        journal.tokens("a", i, [i], [f"d{i}"])
    journal.close()
    direct = journal.stats().cpu_s  # only the fsync thread's, if it ran

    journal = Journal(tmp_path / "posted.wal")

    written = threading.Event()

    def busy(marks: list[tuple[object, int]]) -> None:
        until = time.thread_time() + 0.002  # 2 ms of CPU per batch, on the writer thread
        while time.thread_time() < until:
            pass
        written.set()

    journal.listen(busy)
    for i in range(20):
        journal.post(tokens_record("a", i, [i], [f"d{i}"]), i)
        assert written.wait(30)  # one batch a record, however slow the machine
        written.clear()
    journal.close()
    stats = journal.stats()
    assert stats.writes == 20
    assert stats.cpu_s >= 0.002 * stats.writes  # every batch's listener CPU is in it
    assert direct < 0.002 * stats.writes


def test_stall_bench_measures_both_ways(tmp_path: Path) -> None:
    result = stall_bench(str(tmp_path), seconds=0.2)
    assert set(result) == {"append", "post", "post_to_written"}
    assert all(r["p50_us"] > 0 and r["max_us"] >= r["p99_us"] >= r["p50_us"]
               for r in result.values())
    assert result["post"]["records"] > 10
    assert not os.listdir(tmp_path)
