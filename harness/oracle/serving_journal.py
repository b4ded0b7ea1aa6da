"""Whether what a server acknowledged was durable: its journal file against its clients' records.

The reference server sends, with every streamed token, the byte offset of the journal
record holding it (``journal_offset``); the load generator records it per token. After the
load, the harness reads the journal file itself (this module's own parser of its lines,
``<crc32 as 8 hex digits> <JSON>``; nothing of the server's code) and asks, for every token
a client received:

- is the record at that offset there, whole, written by the writer the server named with
  the token (``journal_writer``: every record names its writer, one per server process),
  and does it hold this request's token at this index, with this token and logits digest?
  A token shown before its record was durable is gone after a power loss: the restarted
  server writes something else there, or nothing, or the same token again under its own
  writer (the same bytes otherwise: the writer is what tells them apart). Where records
  name writers and the client was not told one, the token is unplaced (not observed);
- is that record in the request's last generation (no later ``req`` record for the id)? A
  later one means the request was started again from scratch (a redo), not resumed, unless
  the client was told the request failed (an error event: a retry is then what it asked for).

And for every request the server acknowledged (answered 200): does the journal hold its
``req`` record? Where the journal's folder is the harness's lazy filesystem
(``storage.lose_unsynced``), which notes when each fsync of the file returned and the size it
made durable, one more question for every token found: was its record durable *before* the
client received it (an fsync covering it returned earlier, on the same monotonic clock)? A
server that streams first and fsyncs later loses those tokens only to a power loss that lands
in between; this asks it of every token of every run, wherever the power loss lands. The
facts go on the timeline (``journal_checked``), so ``acknowledged_durable`` is judged from the
timeline alone, like every other check.
"""

from __future__ import annotations

import bisect
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The timeline event with what the harness found in the journal.
JOURNAL_CHECKED = "journal_checked"
_EXAMPLES = 5  # of each kind of finding, named in the event


@dataclass(frozen=True, slots=True)
class JournalFile:
    """What a journal file holds: each whole record by its byte offset, up to the first
    damaged line."""

    records: Mapping[int, dict[str, Any]]
    good_bytes: int
    bad_bytes: int  # a torn or damaged tail
    ends: Mapping[int, int] = field(default_factory=dict)  # record offset -> its line's end

    def writer_at(self, offset: int) -> str | None:
        """The writer the record at ``offset`` names, if it names one."""
        record = self.records.get(offset)
        writer = record.get("w") if record is not None else None
        return writer if isinstance(writer, str) else None

    def requests_at(self, offset: int) -> list[tuple[str, int, list[int], list[str]]]:
        """The token runs ``(id, first index, tokens, digests)`` of the record at
        ``offset``; none if there is no token record starting there."""
        record = self.records.get(offset)
        if record is None:
            return []
        if record.get("r") == "tok":
            return [(str(record.get("id")), _int(record.get("i")), _ints(record.get("t")),
                     _strs(record.get("d")))]
        if record.get("r") == "toks" and isinstance(record.get("runs"), list):
            return [(str(r[0]), _int(r[1]), _ints(r[2]), _strs(r[3] if len(r) > 3 else []))
                    for r in record["runs"] if isinstance(r, list) and len(r) >= 3]
        return []


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _ints(value: Any) -> list[int]:
    return [_int(v) for v in value] if isinstance(value, list) else []


def _strs(value: Any) -> list[str]:
    return [v if isinstance(v, str) else "" for v in value] if isinstance(value, list) else []


def parse(data: bytes) -> JournalFile:
    """Every record whose line is whole and whose CRC matches, up to the first that is not."""
    records: dict[int, dict[str, Any]] = {}
    ends: dict[int, int] = {}
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            break
        line = data[offset:end]
        body = line[9:]
        try:
            if len(line) < 10 or line[8:9] != b" " or int(line[:8], 16) != zlib.crc32(body):
                break
            record = json.loads(body)
        except ValueError:
            break
        if not isinstance(record, dict):
            break
        records[offset] = record
        ends[offset] = end + 1
        offset = end + 1
    return JournalFile(records, offset, len(data) - offset, ends)


@dataclass(frozen=True, slots=True)
class Syncs:
    """When each fsync of the journal returned (monotonic seconds) and the size it made
    durable, oldest first, as the harness's lazy filesystem saw them; ``complete`` false
    where its oldest were dropped (then nothing before the first is known)."""

    times: tuple[float, ...]
    sizes: tuple[int, ...]
    complete: bool

    @classmethod
    def of(cls, data: Mapping[str, Any] | None) -> Syncs | None:
        if data is None or not isinstance(data.get("syncs"), list):
            return None
        try:
            pairs = sorted((float(t), int(n)) for t, n in data["syncs"])
        except (TypeError, ValueError):  # not what the lazy filesystem sends: not known
            return None
        return cls(tuple(t for t, _ in pairs), tuple(n for _, n in pairs),
                   bool(data.get("complete")))

    def durable_before(self, t: float) -> int | None:
        """The size durable by fsyncs that returned before ``t``; None: not known."""
        i = bisect.bisect_left(self.times, t)
        if i == 0:
            return 0 if self.complete else None
        return self.sizes[i - 1]

    def durable_from(self, end: int, after: float) -> float | None:
        """When an fsync at or after ``after`` first made ``end`` bytes durable, if one did."""
        for i in range(bisect.bisect_left(self.times, after), len(self.times)):
            if self.sizes[i] >= end:
                return self.times[i]
        return None


def judge(journal: JournalFile, clients: Sequence[Mapping[str, Any]],
          syncs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The facts of ``journal`` against the clients' request records (the fields of their
    ``request_done``/``request_failed`` events), as JSON for the timeline. ``syncs``: the
    journal's fsyncs (``storage.sync_history``), where the harness's filesystem saw them."""
    starts: dict[str, list[int]] = {}  # request id -> offsets of its `req` records
    for offset, record in journal.records.items():
        if record.get("r") == "req":
            starts.setdefault(str(record.get("id")), []).append(offset)
    tally = _Tally()
    timed = Syncs.of(syncs)
    for client in clients:
        _judge_client(journal, starts, client, tally, timed)
    return {"found": True, "bytes": journal.good_bytes + journal.bad_bytes,
            "records": len(journal.records), "bad_bytes": journal.bad_bytes,
            "tokens_seen": tally.seen, "tokens_proven": tally.proven,
            "tokens_unplaced": tally.unplaced,
            "missing_tokens": tally.counts["missing"], "missing": tally.examples["missing"],
            "redone_requests": tally.counts["redone"], "redone": tally.examples["redone"],
            "unknown_requests": tally.counts["unknown"], "unknown": tally.examples["unknown"],
            # None: the journal's fsyncs were not seen (no lazy filesystem under it).
            "fsyncs_seen": len(timed.times) if timed is not None else None,
            "tokens_timed": tally.timed,
            "early_tokens": tally.counts["early"], "early": tally.examples["early"]}


@dataclass
class _Tally:
    """What the clients' tokens came to: counts, and a few examples of each finding."""

    seen: int = 0
    proven: int = 0
    unplaced: int = 0
    timed: int = 0  # proven tokens whose receipt was checked against the fsyncs
    counts: dict[str, int] = field(
        default_factory=lambda: {"missing": 0, "redone": 0, "unknown": 0, "early": 0})
    examples: dict[str, list[str]] = field(
        default_factory=lambda: {"missing": [], "redone": [], "unknown": [], "early": []})

    def note(self, finding: str, example: str) -> None:
        self.counts[finding] += 1
        if len(self.examples[finding]) < _EXAMPLES:
            self.examples[finding].append(example)


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _judge_client(journal: JournalFile, starts: Mapping[str, list[int]],
                  client: Mapping[str, Any], tally: _Tally, syncs: Syncs | None) -> None:
    """One client's request: each token it received found in the journal where the server
    said it was written, and whether the request was journaled again from scratch."""
    rid = str(client.get("request"))
    tokens = _ints(client.get("tokens"))
    digests = _listed(client.get("digests"))
    offsets = _listed(client.get("journal_offsets"))
    writers = _listed(client.get("journal_writers"))
    times = _listed(client.get("times"))
    if client.get("acknowledged") and rid not in starts:
        tally.note("unknown", f"{rid} (acknowledged; {len(tokens)} tokens received)")
    told_failed = bool(client.get("server_errors"))
    last_start = max(starts.get(rid, [-1]))
    redo_seen = False
    for index, token in enumerate(tokens):
        tally.seen += 1
        where = offsets[index] if index < len(offsets) else None
        if not isinstance(where, int) or isinstance(where, bool):
            tally.unplaced += 1
            continue
        digest = digests[index] if index < len(digests) and digests[index] else ""
        writer = writers[index] if index < len(writers) else None
        verdict = _token_verdict(journal, rid, index, token, where, digest, writer)
        if verdict is None:
            tally.unplaced += 1  # the record names a writer; which one the client saw, unknown
            continue
        if verdict:
            tally.note("missing", verdict)
            continue
        tally.proven += 1
        _time_token(journal, syncs, tally, f"{rid} token {index} ({token}) at offset {where}",
                    where, times[index:index + 1])
        if where < last_start and not told_failed and not redo_seen:
            redo_seen = True
            tally.note("redone", f"{rid}: token {index} the client received is journaled at "
                                 f"offset {where}, and the request was journaled again from "
                                 f"scratch at offset {last_start}")


def _token_verdict(journal: JournalFile, rid: str, index: int, token: int, where: int,
                   digest: str, writer: Any) -> str | None:
    """Whether the journal holds token ``index`` of request ``rid`` at ``where``: "" if it
    does, why not if not, None when it cannot be told (the writer the client saw is unknown)."""
    wrote = journal.writer_at(where)
    if wrote is not None and not isinstance(writer, str):
        return None
    found = _held(journal, where, rid, index)
    if wrote is not None and writer != wrote and found is not None:
        return (f"{rid} token {index} ({token}) at offset {where}: written by another "
                f"process (writer {wrote}; the client was shown writer {writer}'s)")
    if found is None or found[0] != token or (digest and found[1] != digest):
        there = ("nothing: the file is shorter" if where >= journal.good_bytes
                 else "no record starts there" if where not in journal.records
                 else f"not this token (it holds {found})" if found is not None
                 else "a record without this token")
        return f"{rid} token {index} ({token}) at offset {where}: {there}"
    return ""


def _time_token(journal: JournalFile, syncs: Syncs | None, tally: _Tally, token: str,
                where: int, time: list[Any]) -> None:
    """Count a proven ``token`` (its record at ``where``, received at ``time``: [t], or []
    where the client recorded none) as timed, and as early where the client received it
    before its record was durable; nothing without the journal's fsyncs."""
    received = time[0] if time else None
    if syncs is None or not isinstance(received, int | float) or isinstance(received, bool):
        return
    early = _shown_early(journal, syncs, where, float(received))
    if early is None:
        return
    tally.timed += 1
    if early:
        tally.note("early", f"{token}: {early}")


def _shown_early(journal: JournalFile, syncs: Syncs, where: int, received: float
                 ) -> str | None:
    """Whether the record at ``where`` was durable before a client received its token at
    ``received``: "" if it was, how late it was if not, None where it cannot be told."""
    end = journal.ends.get(where)
    durable = syncs.durable_before(received)
    if end is None or durable is None:
        return None
    if durable >= end:
        return ""
    later = syncs.durable_from(end, received)
    return ("received before its record was durable: no fsync covered it before the run's "
            "end" if later is None else
            f"received {later - received:.3f} s before the fsync that made its record durable")


def _held(journal: JournalFile, offset: int, rid: str, index: int) -> tuple[int, str] | None:
    """(token, digest) the record at ``offset`` holds for ``rid`` at ``index``, if any."""
    for run_id, start, tokens, digests in journal.requests_at(offset):
        if run_id == rid and start <= index < start + len(tokens):
            n = index - start
            return tokens[n], digests[n] if n < len(digests) else ""
    return None


def _findings(facts: Mapping[str, Any]) -> list[str]:
    """What the journal check found wrong, each with its examples."""
    return [f"{facts.get(k)} {what}: " + "; ".join(facts.get(examples) or [])
            for k, what, examples in (
                ("missing_tokens", "tokens a client received are not in the journal where the "
                 "server said", "missing"),
                ("unknown_requests", "acknowledged requests are not in the journal", "unknown"),
                ("redone_requests", "requests were started again from scratch instead of "
                 "resumed from the journal", "redone"),
                ("early_tokens", "tokens a client received before their journal record was "
                 "durable (fsynced)", "early"))
            if facts.get(k)]


def acknowledged_durable(events: Sequence[Any]) -> Any:
    """The ``acknowledged_durable`` check over a run's timeline: the facts the harness found
    in the journal (``journal_checked``), proven only where a request streamed across a
    fault (it had tokens before the fault landed and after it): without one, no recovery was
    put to the test."""
    from aftershock.harness.run.records import CheckResult
    from aftershock.harness.verdict import metrics

    name, expected = "acknowledged_durable", "every token seen and request acknowledged journaled"
    facts = next((e.fields for e in events if e.event == JOURNAL_CHECKED), None)
    if facts is None:
        return CheckResult(name, False, None, expected, "not observed: the harness read no "
                           "journal (the system keeps none, or the load never finished)")
    if not facts.get("found"):
        return CheckResult(name, False, None, expected, "not observed: no journal at "
                           f"{facts.get('path')} ({facts.get('error', 'not found')})")
    seen, unplaced = int(facts.get("tokens_seen") or 0), int(facts.get("tokens_unplaced") or 0)
    bad = _findings(facts)
    observed = f"{facts.get('tokens_proven')}/{seen} tokens proven"
    if bad:
        return CheckResult(name, False, observed, expected, "; ".join(bad))
    if not seen:
        return CheckResult(name, False, observed, expected, "not observed: no client received "
                           "a token")
    if unplaced:
        return CheckResult(name, False, observed, expected, f"not observed: {unplaced} of "
                           f"{seen} tokens came without a journal_offset (or without the "
                           "journal_writer their record names), so where they were "
                           "journaled cannot be proven")
    landed = metrics.fault_landed(events)
    across = [r.id for r in metrics.requests(events) if landed is not None and r.times
              and r.times[0] <= landed < r.times[-1]]
    if not across:
        return CheckResult(name, False, observed, expected, "not observed: no request "
                           "streamed across a fault (tokens before it landed and after), so "
                           "no resume was put to the test")
    return CheckResult(name, True, observed, expected,
                       f"all {seen} tokens clients received are in the journal where the "
                       f"server said{_timed(facts)}; {len(across)} requests streamed across "
                       "the fault, resumed, none started again")


def _timed(facts: Mapping[str, Any]) -> str:
    """What the journal's fsyncs proved of the tokens, for a passing check's message."""
    if facts.get("fsyncs_seen") is None:
        return ""
    return (f"; {facts.get('tokens_timed')} of them durable before they were received "
            f"({facts.get('fsyncs_seen')} fsyncs of the journal seen)")
