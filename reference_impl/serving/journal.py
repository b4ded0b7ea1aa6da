"""Write-ahead journal of the router: requests and the tokens emitted for them.

An append-only file, one record per line: ``<crc32 as 8 hex digits> <compact JSON>``.
The checksum covers the JSON bytes, so a torn tail (a crash in the middle of a
write) or a damaged record is detected; replay stops at the first bad record,
ignores the rest, and the journal is truncated there before new records are
appended (records after a bad one cannot be trusted to follow it in order).

Records:

- ``{"r": "req", "id", "prompt": [tokens], "max_tokens"}``: written *before* the
  request is accepted (before the client gets a response), so an acknowledged
  request survives a router crash; written again when a request that ended in an
  error is retried under its id (it starts from scratch);
- ``{"r": "tok", "id", "i": first index, "t": [tokens], "d": [digests]}``, or several
  such runs in one record, ``{"r": "toks", "runs": [[id, i, [tokens], [digests]], ...]}``
  (one per engine step of a worker: one write for the whole batch): written *before* the
  tokens are streamed to anyone, so a client never saw a token the journal lacks. ``d``
  holds each token's logits digest (``engine.logits_digest``), so a request served from the
  journal carries the same digests as it did live; a record without it (an older journal)
  replays with unknown digests (empty strings);
- ``{"r": "fin", "id", "reason": "length" | "error", "error"?}``.

Every record also names its writer, ``"w"``: a random id per opened journal (per router
process). The router sends it with each token (``journal_writer``, with ``journal_offset``),
so a token a power loss took, written again by the restarted router at the same offset with
the same bytes, does not pass for the one the client was shown.

Durability, and why it is split this way: records reach the file through one writer
thread, in the order they were posted (:meth:`Journal.post`, under the caller's lock, so
the order is the order of the caller's decisions). The writer frames what piled up, writes
it with one ``write(2)`` on an ``O_APPEND`` descriptor (no user-space buffer), fsyncs it,
and only then tells the caller which records are durable and at which byte offset each
starts (``on_written``): only then may the caller act on them (acknowledge a request,
stream a token), so what a client saw survives a crash of the router process and a power
loss alike (``storage.lose_unsynced`` on the journal's folder shows it). The caller never
waits for the disk under its own lock: records posted while an fsync runs go in the next
write (group commit: one fsync per batch, however many records it holds). A new journal's
name is made durable too (its folder is fsynced when the file is created), and a reopened
one is fsynced before anything is served from it (a router that died between writing a
batch and fsyncing it left that batch in the kernel only). The stages of
one batch are fault points (``listen``'s ``point``: ``journal_appended`` after the write,
``journal_synced`` after the fsync), so a scenario can crash the router between them.

:meth:`request`, :meth:`tokens`, :meth:`token_runs` and :meth:`finish` write at once, on
the caller's thread (tools, tests, the bench), fsynced by a background thread at most
every ``fsync_interval`` seconds (each at once with 0); a journal has one writer at a time,
so do not mix them with :meth:`post` on one journal.

No compaction: the file grows with every token served. Fine for test runs and the
reference server; a long-lived server would rotate it (finished requests need only
their tokens, which a snapshot could hold).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class JournaledRequest:
    """A request as the journal remembers it (mutable while replaying)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # per token; "" where unknown
    offsets: list[int] = field(default_factory=list)  # per token: its record's byte offset
    finished: bool = False
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Replay:
    """What a journal file held: requests in the order they were accepted."""

    requests: dict[str, JournaledRequest]
    records: int  # good records read
    valid_bytes: int  # length of the good prefix of the file
    ignored_bytes: int  # torn or corrupt tail that was dropped
    writers: dict[int, str] = field(default_factory=dict)  # record offset -> its "w"


@dataclass(frozen=True, slots=True)
class JournalStats:
    path: str
    records: int
    bytes: int
    fsyncs: int
    write_s: float  # time spent in write(2), all records
    fsync_s: float  # time spent in fsync, all batches
    writes: int  # write(2) calls: records / writes is how many records a batch held
    write_max_s: float  # the longest write (one waiting behind an fsync shows here)
    # CPU of the journal's own threads: the writer (framing, write(2), telling the caller)
    # and the fsync thread. What the journal costs its process, bar the posting.
    cpu_s: float = 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "path": self.path,
            "records": self.records,
            "bytes": self.bytes,
            "writes": self.writes,
            "fsyncs": self.fsyncs,
            "write_s": round(self.write_s, 6),
            "write_max_s": round(self.write_max_s, 6),
            "fsync_s": round(self.fsync_s, 6),
            "cpu_s": round(self.cpu_s, 6),
        }


def request_record(request_id: str, prompt: Sequence[int], max_tokens: int
                   ) -> dict[str, object]:
    return {"r": "req", "id": request_id, "prompt": list(prompt), "max_tokens": max_tokens}


def tokens_record(request_id: str, start: int, tokens: Sequence[int],
                  digests: Sequence[str]) -> dict[str, object]:
    return {"r": "tok", "id": request_id, "i": start, "t": list(tokens), "d": list(digests)}


def token_runs_record(runs: Sequence[tuple[str, int, Sequence[int], Sequence[str]]]
                      ) -> dict[str, object]:
    """One record for several runs (one per request of an engine step); a single run is a
    plain ``tok`` record."""
    if len(runs) == 1:
        return tokens_record(*runs[0])
    return {"r": "toks", "runs": [[r, i, list(t), list(d)] for r, i, t, d in runs]}


def finish_record(request_id: str, error: str | None = None) -> dict[str, object]:
    record: dict[str, object] = {"r": "fin", "id": request_id,
                                 "reason": "error" if error else "length"}
    if error:
        record["error"] = error
    return record


def _frame(record: dict[str, object], writer: str) -> bytes:
    body = json.dumps({**record, "w": writer}, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of one line (without its newline), or None when it is damaged."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _apply(requests: dict[str, JournaledRequest], record: dict[str, Any],
           offset: int = -1) -> bool:
    """Fold one record into the replay state; False if it makes no sense (a bad record)."""
    try:
        kind, rid = record["r"], str(record.get("id"))
        if kind == "req":
            prompt = tuple(int(t) for t in record["prompt"])
            # A second `req` for an id is a retry of a request that ended in error: it
            # starts again from scratch.
            requests[rid] = JournaledRequest(rid, prompt, int(record["max_tokens"]))
            return True
        if kind == "toks":
            runs = record["runs"]
            return all(_apply(requests, {"r": "tok", "id": r[0], "i": r[1], "t": r[2],
                                         "d": r[3] if len(r) > 3 else None}, offset)
                       for r in runs)
        request = requests[rid]
        if kind == "tok":
            start = int(record["i"])
            tokens = [int(t) for t in record["t"]]
            digests = [str(d) for d in record.get("d") or [""] * len(tokens)]
            if start > len(request.tokens) or len(digests) != len(tokens):
                return False  # a gap (the journal never skips tokens), or a garbled record
            request.tokens[start : start + len(tokens)] = tokens
            request.digests[start : start + len(tokens)] = digests
            request.offsets[start : start + len(tokens)] = [offset] * len(tokens)
            return True
        if kind == "fin":
            request.finished = True
            error = record.get("error")
            request.error = str(error) if error is not None else None
            return True
    except (KeyError, TypeError, ValueError):
        return False
    return False


def replay(path: str | os.PathLike[str]) -> Replay:
    """Read a journal: every request up to the first torn or damaged record."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Replay({}, 0, 0, 0)
    requests: dict[str, JournaledRequest] = {}
    writers: dict[int, str] = {}
    offset = records = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            break  # torn tail: the last write never completed
        record = _parse(data[offset:end])
        if record is None or not _apply(requests, record, offset):
            break
        if isinstance(record.get("w"), str):
            writers[offset] = record["w"]
        records += 1
        offset = end + 1
    return Replay(requests, records, offset, len(data) - offset, writers)


class Journal:
    """Appends records; thread-safe. Open with :meth:`open` to replay what was there."""

    def __init__(self, path: str | os.PathLike[str], *, fsync_interval: float = 0.05) -> None:
        self.path = str(path)
        self.fsync_interval = fsync_interval
        created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:  # the file's name is durable only once its folder is fsynced
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self._size = os.fstat(self._fd).st_size  # where the next record starts (one writer)
        # This journal's records name it ("w"); records before `_opened_at` were written
        # by earlier writers (`writer_at`).
        self.writer = os.urandom(6).hex()
        self._opened_at = self._size
        self._earlier: dict[int, str] = {}
        self._lock = threading.Lock()  # writes (and the fd's life)
        self._sync_lock = threading.Lock()  # a batched fsync: never blocks an append
        self._count_lock = threading.Lock()  # the counters: stats() never waits for a write
        self._dirty = threading.Event()
        self._closed = False
        self._records = self._bytes = self._fsyncs = self._writes = 0
        self._write_s = self._fsync_s = self._write_max_s = self._cpu_s = 0.0
        self._syncer: threading.Thread | None = None
        if fsync_interval > 0:
            self._syncer = threading.Thread(target=self._sync_loop, name="journal-fsync",
                                            daemon=True)
            self._syncer.start()
        # The writer thread (started by the first `listen`): records posted, not yet written.
        self._queue: list[tuple[dict[str, object], object]] = []
        self._posted = threading.Condition()
        self._on_written: Callable[[list[tuple[object, int]]], None] | None = None
        self._point: Callable[[str], None] = _no_point
        self._writer: threading.Thread | None = None
        self._stop_writer = False
        self.failed: OSError | None = None  # a write failed: nothing posted is written any more

    @classmethod
    def open(cls, path: str | os.PathLike[str], *,
             fsync_interval: float = 0.05) -> tuple[Journal, Replay]:
        """Replay ``path``, cut off its torn or damaged tail, and open it for appending,
        with what it replayed made durable: a predecessor that died between writing a
        batch and fsyncing it left that batch in the kernel only, and the caller is about
        to serve from it."""
        found = replay(path)
        if found.ignored_bytes:
            os.truncate(path, found.valid_bytes)
        journal = cls(path, fsync_interval=fsync_interval)
        journal._earlier = dict(found.writers)
        journal.sync()
        return journal, found

    def writer_at(self, offset: int) -> str | None:
        """The writer named by the record at ``offset``: this journal's own for what it
        wrote, the replayed record's for what was there (None: that record named none)."""
        return self.writer if offset >= self._opened_at else self._earlier.get(offset)

    # -- records, written at once on the caller's thread
    def request(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        self._append(request_record(request_id, prompt, max_tokens))

    def tokens(self, request_id: str, start: int, tokens: Sequence[int],
               digests: Sequence[str]) -> None:
        """Tokens ``start``.. of a request, with the logits digest of each."""
        self._append(tokens_record(request_id, start, tokens, digests))

    def token_runs(self, runs: Sequence[tuple[str, int, Sequence[int], Sequence[str]]]
                   ) -> None:
        """Several ``(request_id, start, tokens, digests)`` runs in one record (one write)."""
        if runs:
            self._append(token_runs_record(runs))

    def finish(self, request_id: str, error: str | None = None) -> None:
        self._append(finish_record(request_id, error))

    def _append(self, record: dict[str, object]) -> None:
        self._write([_frame(record, self.writer)])

    def _write(self, lines: list[bytes], *, sync: bool | None = None) -> int:
        """Whole lines, in one write(2) (more only if the kernel takes part of it); the byte
        offset the first one starts at. ``sync``: fsync before returning (default: when
        ``fsync_interval`` is 0)."""
        data = b"".join(lines)
        with self._lock:
            if self._closed:
                raise ValueError("journal is closed")
            began = time.perf_counter()
            start = self._size
            view, writes = memoryview(data), 0
            while view:
                view = view[os.write(self._fd, view):]
                writes += 1
            self._size += len(data)
            took = time.perf_counter() - began
            if self.fsync_interval <= 0 if sync is None else sync:
                self._fsync_locked()
        with self._count_lock:
            self._write_s += took
            self._write_max_s = max(self._write_max_s, took)
            self._writes += writes
            self._records += len(lines)
            self._bytes += len(data)
        self._dirty.set()
        return start

    # -- records through the writer thread
    def listen(self, on_written: Callable[[list[tuple[object, int]]], None], *,
               point: Callable[[str], None] | None = None) -> None:
        """Write posted records on a thread of the journal's own; after each batch is written
        and fsynced call ``on_written`` with ``(mark, byte offset of its record)`` for each
        of its records, in the order they were posted. ``on_written`` runs on the writer
        thread and may take the caller's lock: post under that lock (posting never waits),
        but never :meth:`close` under it. ``point(name)`` is called between the stages of a
        batch (``journal_appended``: written, not yet fsynced; ``journal_synced``: fsynced,
        the caller not yet told), where a fault may stop the process."""
        with self._posted:
            if self._writer is not None:
                raise RuntimeError("the journal already has a listener")
            self._on_written = on_written
            self._point = point or _no_point
            self._writer = threading.Thread(target=self._write_loop, name="journal-writer",
                                            daemon=True)
            self._writer.start()

    def post(self, record: dict[str, object], mark: object) -> None:
        """Queue ``record`` for the writer; never waits for the disk. ``mark`` comes back
        through ``on_written`` once the record is written."""
        with self._posted:
            if self.failed is not None:
                raise self.failed
            if self._writer is None or self._stop_writer:
                raise ValueError("the journal has no writer (listen first) or is closing")
            self._queue.append((record, mark))
            self._posted.notify()

    def _write_loop(self) -> None:
        assert self._on_written is not None
        while True:
            with self._posted:
                while not self._queue and not self._stop_writer:
                    self._posted.wait()
                batch, self._queue = self._queue, []
                if not batch:
                    return  # stopping, and everything posted is written
            began = time.thread_time()
            # Framing here, not in post: the JSON and CRC stay off the caller's lock.
            lines = [_frame(record, self.writer) for record, _ in batch]
            try:
                offset = self._write(lines, sync=False)
                self._point("journal_appended")
                self.sync()  # durable before anyone is told: a power loss keeps what was shown
                self._point("journal_synced")
            except OSError as exc:
                self.failed = exc
                print(f"[journal] write failed, nothing more is written: {exc}",
                      file=sys.stderr, flush=True)
                return
            placed: list[tuple[object, int]] = []
            for line, (_, mark) in zip(lines, batch, strict=True):
                placed.append((mark, offset))
                offset += len(line)
            try:
                self._on_written(placed)
            except Exception:  # a listener bug must not stop the journal
                traceback.print_exc()
            self._count_cpu(began)

    def _count_cpu(self, began: float) -> None:
        took = time.thread_time() - began
        with self._count_lock:
            self._cpu_s += took

    def _stop_writing(self) -> None:
        """Write what was posted, then end the writer thread."""
        with self._posted:
            self._stop_writer = True
            self._posted.notify()
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=10.0)

    # -- durability
    def _fsync_locked(self) -> None:
        began = time.perf_counter()
        os.fsync(self._fd)
        took = time.perf_counter() - began
        with self._count_lock:
            self._fsync_s += took
            self._fsyncs += 1

    def sync(self) -> None:
        """fsync now. Appends go on meanwhile: fsync(2) and write(2) on one descriptor may
        run at the same time, so an fsync held under the write lock would stall every record
        behind a disk flush."""
        with self._sync_lock:
            if self._closed:
                return
            self._dirty.clear()
            self._fsync_locked()

    def _sync_loop(self) -> None:
        while True:
            self._dirty.wait()
            time.sleep(self.fsync_interval)  # group commit: one fsync for what piled up
            if self._closed:
                return
            began = time.thread_time()
            self.sync()
            self._count_cpu(began)

    def stats(self) -> JournalStats:
        with self._count_lock:
            return JournalStats(self.path, self._records, self._bytes, self._fsyncs,
                                self._write_s, self._fsync_s, self._writes,
                                self._write_max_s, self._cpu_s)

    def close(self) -> None:
        """Write what was posted, fsync, close."""
        self._stop_writing()
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._fsync_locked()
            self._closed = True
            os.close(self._fd)
        self._dirty.set()  # wake the syncer so it sees _closed and ends
        if self._syncer is not None:
            self._syncer.join(timeout=1.0)


def _no_point(name: str) -> None:
    return None


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench(folder: str, *, records: int = 5000) -> dict[str, float]:
    """Cost of one token record, microseconds: write only, batched fsync, fsync per record."""
    result: dict[str, float] = {}
    for name, interval in (("write_only_us", 3600.0), ("batched_fsync_us", 0.05),
                           ("fsync_each_us", 0.0)):
        path = Path(folder) / f"bench-{name}.wal"
        journal = Journal(path, fsync_interval=interval)
        count = records if interval else max(records // 10, 100)
        began = time.perf_counter()
        for i in range(count):
            journal.tokens("cmpl-bench-000000", i, [i % 256], ["0123456789abcdef"])
        elapsed = time.perf_counter() - began
        journal.close()
        path.unlink()
        result[name] = round(elapsed / count * 1e6, 2)
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] * 1e6, 1),
            "max_us": round(ordered[-1] * 1e6, 1)}


def stall_bench(folder: str, *, seconds: float = 4.0, every: float = 0.002
                ) -> dict[str, dict[str, float]]:
    """What an appender waits for, with the batched fsync running: a token record (8
    tokens) every ``every`` seconds for ``seconds``, written on the caller's thread
    (``append``: what the router's lock was held for) or posted to the writer thread
    (``post``: what it is held for now; ``post_to_written``: post -> ``on_written``, the
    extra time before a stream may show the record). Microseconds."""
    tokens, digests = list(range(8)), ["0123456789abcdef"] * 8
    result: dict[str, dict[str, float]] = {}
    for mode in ("append", "post"):
        path = Path(folder) / f"stall-{mode}.wal"
        journal = Journal(path)
        posted: dict[int, float] = {}
        visible: list[float] = []

        def written(marks: list[tuple[object, int]], posted: dict[int, float] = posted,
                    visible: list[float] = visible) -> None:
            now = time.perf_counter()
            visible.extend(now - posted[m] for m, _ in marks if isinstance(m, int))

        if mode == "post":
            journal.listen(written)
        waits: list[float] = []
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            record = tokens_record("cmpl-bench-000000", n * 8, tokens, digests)
            began = time.perf_counter()
            if mode == "post":
                posted[n] = began
                journal.post(record, n)
            else:
                journal._append(record)
            waits.append(time.perf_counter() - began)
            n += 1
            time.sleep(every)
        stats = journal.stats()
        journal.close()
        path.unlink()
        result[mode] = {**_percentiles(waits), "records": n, "fsyncs": stats.fsyncs,
                        "write_max_us": round(stats.write_max_s * 1e6, 1)}
        if visible:
            result["post_to_written"] = _percentiles(visible)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true", help="measure the cost of a record")
    parser.add_argument("--dir", default=None, help="folder for the bench file (default: tmp)")
    parser.add_argument("path", nargs="?", help="journal to summarise")
    args = parser.parse_args(argv)
    if args.bench:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            print(json.dumps(bench(folder)))
            print(json.dumps(stall_bench(folder)))
        return
    if not args.path:
        parser.error("give a journal PATH or --bench")
    found = replay(args.path)
    done = sum(r.finished for r in found.requests.values())
    print(json.dumps({"requests": len(found.requests), "finished": done,
                      "records": found.records, "ignored_bytes": found.ignored_bytes}))


if __name__ == "__main__":
    main()
