"""The one JSON-lines tail: whole lines only, the unfinished one kept until its newline,
and one longer than its limit dropped."""

from __future__ import annotations

import json
from pathlib import Path

from aftershock.faults import jsonl


def test_a_tail_gives_whole_lines_and_keeps_the_unfinished_one(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = jsonl.Tail()
    jsonl.append(path, jsonl.encode({"a": 1}) + b'{"b":')
    with open(path, "rb") as handle:
        assert [json.loads(line) for line in tail.read(handle)] == [{"a": 1}]
    jsonl.append(path, b" 2}\n")
    with open(path, "rb") as handle:
        assert [json.loads(line) for line in tail.read(handle)] == [{"b": 2}]
        assert tail.read(handle) == []
    assert tail.offset == path.stat().st_size


def test_a_tail_drops_an_unfinished_line_longer_than_its_limit() -> None:
    tail = jsonl.Tail(line_limit=8)
    assert tail.feed(b"x" * 9) == []
    assert tail.feed(b'x\n{"c":3}\n') == [b"x", b'{"c":3}']  # the rest of it is junk
    assert jsonl.encode({"t": 1.5}) == b'{"t":1.5}\n'
