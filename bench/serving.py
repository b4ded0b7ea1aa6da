"""Serving benchmark: what durability costs and what migration buys, side by side.

``python -m bench.serving`` runs the reference server through the harness (the same
load generator, timeline and metrics as ``aftershock run``), every row once per
repetition, every other repetition in reverse order, so that a loaded machine slows them
alike and a drift along a repetition lands on both sides of each pair:

- ``durable`` vs ``bare``: a fault-free, saturating load with the write-ahead journal
  and KV checksums on, then off. Output tokens per second (client-side: every token
  received / from the first request sent to the last token) give the overhead: per
  repetition, ``1 - durable / bare`` of the two runs next to each other, and its median
  over the repetitions (the verdict; a drift in the machine's load hits both runs of a
  pair alike, not the medians of two rows taken apart).
- ``journal`` and ``checksums``: one of the two on, to split the overhead, each paired
  with the ``bare`` run of its repetition; and the router's own figures for the durable
  runs: CPU per 1000 tokens of the router process and of the workers since they were
  ready (less sensitive to the neighbours than tokens/s), and the journal's time in
  ``write(2)``, its longest write, records per write and fsyncs, from ``serving_stats``.
- ``migrate`` vs ``fail_stop``: the same load, one worker SIGKILLed once 10 requests
  are streaming. ``migrate`` moves its in-flight requests to healthy workers with the
  tokens already emitted; ``fail_stop`` is what most servers do today: every in-flight
  request fails, the stack restarts cold, clients retry. Time to recover is the
  harness's ``time_to_recover_s`` for serving (fault -> every request that was in
  flight has received a token again).

- the router alone (``router_cpu``): CPU per token of a ``Router`` in this process, fed
  by 3 fake workers over socket pairs, each from a thread of its own (8 requests each,
  one token each per 2.7 ms step, 24 streams through the router's stream writer to
  socket pairs read after the run), journal on and off, alternating:
  the journal's cost to the router without the HTTP layer, the workers or the
  neighbours' load in the figure.

Results go to ``bench/results/serving.{json,md}``; docs/serving.md quotes them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aftershock.harness.run.records import RunResult
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.run.timeline import read_events
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.verdict import metrics
from bench.stats import run_order, verdict
from bench.status import code_identity

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

LOAD = """
  load:
    requests: {requests}
    rate: 200
    concurrency: 24
    prompt_tokens: {{min: 48, max: 96}}
    shared_prefixes: 4
    prefix_tokens: 32
    max_tokens: 32
    retries: 1000         # fail_stop: clients retry until the cold-started stack answers
    request_timeout: 180s
"""

ROWS: dict[str, str] = {
    "durable": "journal: true\n  checksums: true",
    "bare": "journal: false\n  checksums: false",
    "journal": "journal: true\n  checksums: false",
    "checksums": "journal: false\n  checksums: true",
    "migrate": "recovery: migrate",
    "fail_stop": "recovery: fail_stop",
}
KILL = """
faults:
  - kind: process.kill
    target: {worker: 0}
    at: {event: first_token, count: 10}
"""


def scenario(row: str, requests: int, folder: Path) -> LoadedScenario:
    text = (f"name: bench-{row.replace('_', '-')}\nsystem:\n  reference: server\n"
            f"  workers: 3\n  {ROWS[row]}\n" + LOAD.format(requests=requests))
    text += KILL if row in ("migrate", "fail_stop") else ""
    # Every row is held to the serving checks: nothing lost or repeated, and every token and
    # its logits digest equal to a fault-free run of the same system (one per system and
    # bench run: the twins are cached in the bench's temporary folder). A faster recovery
    # that serves other tokens cannot look good.
    text += ("expect:\n  completes: true\n  no_lost_requests: true\n"
             "  no_duplicated_tokens: true\n")
    if row in ("migrate", "fail_stop"):
        text += "  outputs_match: fault_free\n"
    path = folder / f"{row}.yaml"
    path.write_text(text)
    return LoadedScenario(parse_scenario(text, str(path)), path, text)


OVERHEAD_ROWS = ("durable", "journal", "checksums")  # each against `bare`
OVERHEAD_TARGET = 0.05  # the target for durable against bare


def _ratio(value: object, over: object) -> float | None:
    if isinstance(value, int | float) and isinstance(over, int | float) and over:
        return value / over
    return None


def measure(result: RunResult) -> dict[str, Any]:
    events = read_events(Path(result.run_dir) / "events.jsonl")
    records = metrics.requests(events)
    tokens = sum(len(r.tokens) for r in records)
    first = min((r.sent for r in records), default=None)
    last = max((r.times[-1] for r in records if r.times), default=None)
    m = result.metrics
    # CPU the server spent serving, from its counters fetched when the load was done (the
    # client's serving_stats): the router process, and every worker process since its hello.
    client = next((e.fields for e in reversed(events) if e.event == "serving_stats"
                   and e.source == "client"), {})
    # The journal's figures from the router's own stats at its shutdown (the client's
    # flattened copy lacks that nested part).
    stats = next((e.fields for e in reversed(events) if e.event == "serving_stats"
                  and e.source != "client"), {})
    found = stats.get("journal")
    journal: dict[str, Any] = found if isinstance(found, dict) else {}
    records_n, writes = journal.get("records"), journal.get("writes")

    def per_1k_tokens(value: object) -> float | None:
        return value / tokens * 1e3 if isinstance(value, int | float) and tokens else None

    return {
        "tokens_per_s": tokens / (last - first) if first is not None and last else None,
        "router_cpu_ms_per_1k_tokens": per_1k_tokens(client.get("router_cpu_ms")),
        "worker_cpu_ms_per_1k_tokens": per_1k_tokens(client.get("cpu_ms")),
        # Of which the KV checksums (sealing and verifying), timed where they run.
        "worker_checksum_ms_per_1k_tokens": per_1k_tokens(client.get("checksum_ms")),
        # Of the router's CPU, the journal's own threads (writer and fsync), timed there.
        "journal_cpu_ms_per_1k_tokens": (per_1k_tokens(journal["cpu_s"] * 1e3)
                                         if isinstance(journal.get("cpu_s"), int | float)
                                         else None),
        "journal_write_s": journal.get("write_s"),
        "journal_write_max_ms": (journal["write_max_s"] * 1e3
                                 if isinstance(journal.get("write_max_s"), int | float)
                                 else None),
        "journal_records_per_write": (records_n / writes if isinstance(records_n, int)
                                      and isinstance(writes, int) and writes else None),
        "journal_fsyncs": journal.get("fsyncs"),
        # The workers' batches: tokens per engine step (fewer per step costs more CPU per
        # token), and what a step cost them, all workers together.
        "tokens_per_step": _ratio(client.get("generated_tokens"), client.get("steps")),
        "worker_cpu_ms_per_step": _ratio(client.get("cpu_ms"), client.get("steps")),
        "time_to_recover_s": m.get("time_to_recover_s"),
        "time_to_detect_s": m.get("time_to_detect_s"),
        "lost_requests": m.get("lost_requests"),
        "duplicated_tokens": m.get("duplicated_tokens"),
        "ttft_p50_s": m.get("ttft_p50_s"), "ttft_p99_s": m.get("ttft_p99_s"),
        "tpot_p50_s": m.get("tpot_p50_s"), "tpot_p99_s": m.get("tpot_p99_s"),
        "passed": result.passed,
        "failed_checks": [c.name for c in result.checks if not c.passed],
    }


THREADS = ("streams", "link readers", "journal writer", "journal fsync", "other")


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds of a live ``thread`` of this process (its POSIX CPU clock)."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _router_cpu_once(journal_path: Path | None, workers: int = 3, per_worker: int = 8,
                     tokens: int = 64) -> dict[str, float]:
    """CPU µs of this process per token streamed by a Router (see the module docstring):
    ``total``, and by thread (``THREADS``): the streams (the router's stream writer, which
    frames every token's event and writes it to its client's socket, as for the HTTP
    API), the link readers (here the threads feeding the links), the journal's writer and
    fsync threads, and the rest (link writers, the main thread, the interpreter between
    threads: the total less the others). The clients' sockets are socket pairs read only
    after the run, so no client's CPU is in the figure.

    The served shape: ``workers`` links, each fed by a thread of its own (as each link has
    its reader in the router) with one Outputs message per step of ``per_worker`` requests,
    a step every 2.7 ms (a worker's decode step in ``python -m bench.serving``)."""
    import socket

    from aftershock.reference_impl.serving import _wire
    from aftershock.reference_impl.serving.journal import Journal
    from aftershock.reference_impl.serving.router import (
        Router,
        RouterConfig,
        _Link,
        end_event,
        token_event,
    )

    journal = Journal(journal_path) if journal_path is not None else None
    router = Router(RouterConfig(workers=workers), journal, None)
    pairs = [socket.socketpair() for _ in range(workers)]
    links = [_Link(i + 1, mine) for i, (mine, _) in enumerate(pairs)]
    clients: list[tuple[socket.socket, socket.socket]] = []  # (the router's end, the client's)
    try:
        for index, link in enumerate(links):
            router._dispatch(link, _wire.Hello(index, 0, os.getpid(), "bench", 16, 4096))
        # Prompts without a shared prefix: the router spreads them evenly.
        streams = [router.submit(f"r{i}", f"{i:03d}" + "x" * 40, tokens)
                   for i in range(workers * per_worker)]
        epochs: dict[str, tuple[int, int]] = {}  # request -> (worker, epoch)
        for index, (_, theirs) in enumerate(pairs):
            theirs.settimeout(0.5)
            for message in _wire.read_messages(theirs):
                if message is None:
                    break  # nothing more within 0.5 s: every Add sent is here
                if isinstance(message, _wire.Add):
                    epochs[message.request_id] = (index, message.epoch)
        if len(epochs) != len(streams):
            raise RuntimeError(f"{len(epochs)} of {len(streams)} requests assigned")
        spent_by: dict[str, float] = dict.fromkeys(THREADS, 0.0)
        clients.extend(socket.socketpair() for _ in streams)
        for mine, theirs in clients:
            # What the unread events of a stream need (~20 kB), so no write waits for a read.
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

        def feed(index: int) -> None:
            began = time.thread_time()
            mine = [r for r in streams if epochs[r.id][0] == index]
            for i in range(tokens):
                router._dispatch(links[index], _wire.Outputs(tuple(
                    (r.id, epochs[r.id][1], i, 65, "0123456789abcdef", i + 1 == tokens)
                    for r in mine)))
                time.sleep(0.0027)  # a worker's step
            spent_by["link readers"] += time.thread_time() - began

        # The router's own threads, by name, alive for the whole run.
        names = {"journal-writer": "journal writer", "journal-fsync": "journal fsync",
                 "streams": "streams"}
        own = {t: _thread_cpu_s(t) for t in threading.enumerate() if t.name in names}
        feeders = [threading.Thread(target=feed, args=(i,)) for i in range(workers)]
        began = time.process_time()
        subscribed = [router.subscribe(request, 0, mine, token_event(request.id, "bench"),
                                       end_event)
                      for (mine, _), request in zip(clients, streams, strict=True)]
        for thread in feeders:
            thread.start()
        for thread in feeders:
            thread.join(30)
        for stream in subscribed:
            if not stream.done.wait(30):
                raise RuntimeError("a stream never ended")
        spent = time.process_time() - began
        for thread, before in own.items():
            spent_by[names[thread.name]] += _thread_cpu_s(thread) - before
        counted = 0
        for mine, theirs in clients:
            mine.shutdown(socket.SHUT_WR)
            theirs.setblocking(True)
            data = bytearray()
            while chunk := theirs.recv(1 << 16):
                data += chunk
            counted += data.count(b'"token_index"')
        if counted != len(streams) * tokens:
            raise RuntimeError(f"streamed {counted} of {len(streams) * tokens} tokens")
        spent_by["other"] = spent - sum(spent_by.values())
        return {"total": spent / counted * 1e6,
                **{name: cpu / counted * 1e6 for name, cpu in spent_by.items()}}
    finally:
        router.stop()
        for link in links:
            link.stop_writer()
        for mine, theirs in pairs + clients:
            mine.close()
            theirs.close()
        if journal is not None:
            journal.close()


def router_cpu(folder: Path, repeat: int = 7) -> dict[str, Any]:
    """Router CPU µs per token, journal off and on, alternating: medians and ranges of the
    total, the paired difference, and the median of each thread's part (``by_thread``)."""
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "journal": []}
    with contextlib.redirect_stderr(io.StringIO()):  # the router's "worker 0 ready" lines
        for i in range(repeat):
            runs["bare"].append(_router_cpu_once(None))
            runs["journal"].append(_router_cpu_once(folder / f"router-cpu-{i}.wal"))
    out: dict[str, Any] = {}
    for row, results in runs.items():
        totals = [r["total"] for r in results]
        out[row] = {"median": statistics.median(totals), "min": min(totals),
                    "max": max(totals)}
    out["journal_extra_us"] = out["journal"]["median"] - out["bare"]["median"]
    out["journal_extra_paired_us"] = statistics.median(
        j["total"] - b["total"] for b, j in zip(runs["bare"], runs["journal"], strict=True))
    out["by_thread"] = {row: {name: statistics.median(r[name] for r in results)
                              for name in THREADS} for row, results in runs.items()}
    return out


def median(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return statistics.median(numbers) if numbers else None


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row, results in runs.items():
        out[row] = {}
        for key in results[0] if results else ():
            values = [r[key] for r in results if isinstance(r[key], int | float)]
            if values:  # "passed" too: its min says whether every repetition passed
                out[row][key] = {"median": median(values), "min": min(values),
                                 "max": max(values)}
    return out


CPU_PARTS = {"server": ("router_cpu_ms_per_1k_tokens", "worker_cpu_ms_per_1k_tokens"),
             "router": ("router_cpu_ms_per_1k_tokens",),
             "workers": ("worker_cpu_ms_per_1k_tokens",)}


def cpu_overheads(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per repetition, ``row / bare - 1`` in CPU per 1000 tokens, for each overhead row and
    each part (``CPU_PARTS``: router and workers together, and each alone): the median,
    range and pairs over the repetitions where both were measured. What durability costs
    the server's CPU; unlike tokens/s, not a wall-clock figure."""
    out: dict[str, dict[str, Any]] = {}
    bare = runs.get("bare", [])
    for row in OVERHEAD_ROWS:
        parts: dict[str, Any] = {}
        for part, keys in CPU_PARTS.items():
            pairs = [sum(r[k] for k in keys) / sum(b[k] for k in keys) - 1
                     for r, b in zip(runs.get(row, []), bare, strict=False)
                     if all(isinstance(x.get(k), int | float) for x in (r, b) for k in keys)
                     and sum(b[k] for k in keys) > 0]
            if pairs:
                parts[part] = {"median": statistics.median(pairs), "min": min(pairs),
                               "max": max(pairs), "pairs": pairs}
        if parts:
            out[row] = parts
    return out


def overheads(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per repetition, ``1 - row / bare`` in tokens/s for each overhead row: its median
    and range over the repetitions where both ran."""
    out: dict[str, dict[str, Any]] = {}
    bare = runs.get("bare", [])
    for row in OVERHEAD_ROWS:
        pairs = [1 - r["tokens_per_s"] / b["tokens_per_s"]
                 for r, b in zip(runs.get(row, []), bare, strict=False)
                 if r.get("tokens_per_s") and b.get("tokens_per_s")]
        if pairs:
            out[row] = {"median": statistics.median(pairs), "min": min(pairs),
                        "max": max(pairs), "pairs": pairs}
    return out


def verdicts(summary: dict[str, dict[str, Any]],
             paired: dict[str, dict[str, Any]] | None = None,
             cpu: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The targets' verdicts: throughput overhead, recovery ratio, and, given ``cpu``
    (``cpu_overheads``), the overhead in the server's CPU per token, under the same rule
    (its pairs must resolve it), so that a cost the wall clock cannot resolve on a noisy
    host can still be shown over the limit. Never met on CPU alone: time spent waiting
    (a write behind an fsync, a token held for its record) costs throughput and no CPU."""
    def med(row: str, key: str) -> float | None:
        entry = summary.get(row, {}).get(key)
        return entry["median"] if entry else None

    def correct(row: str) -> bool:
        entry = summary.get(row, {}).get("passed")
        return entry is not None and entry["min"] == 1  # every repetition passed every check

    def unproven(*rows: str) -> str | None:
        """Why these rows prove nothing: not run, or a run that failed its checks (a fast
        or cheap run with wrong outputs is not a measurement)."""
        missing = [row for row in rows if row not in summary]
        if missing:
            return f"not measured (no {' or '.join(missing)} runs)"
        failed = [row for row in rows if not correct(row)]
        if failed:
            return f"not measured ({', '.join(failed)}: a run failed its checks)"
        return None

    def overhead_verdict(entry: dict[str, Any] | None,
                         missing: str) -> tuple[bool | None, str | None]:
        """The pairs must resolve the target: a median under it from repetitions spread
        across it (+20% next to -5%) is noise, not a measurement, and is not shown met
        (bench.stats: the median's interval must be within the limit)."""
        note = unproven("durable", "bare")
        if note is not None:
            return None, note
        if entry is None:
            return None, f"not measured ({missing})"
        return verdict(entry["pairs"], OVERHEAD_TARGET, scale=100.0, unit="%", digits=1)

    durable = (paired or {}).get("durable")
    overhead = durable["median"] if durable else None
    met, note = overhead_verdict(durable, "no paired repetitions")
    migrate, fail = med("migrate", "time_to_recover_s"), med("fail_stop", "time_to_recover_s")
    ratio = migrate / fail if migrate is not None and fail else None
    why = unproven("migrate", "fail_stop")
    if why is None and ratio is None:
        why = "not measured (no time to recover)"
    out = [
        {"target": "journal + checksums cost <= 5% of fault-free throughput (median of the "
                   "paired repetitions)",
         "value": overhead, "met": met, "note": note},
        {"target": "time to recover <= 1/10 of fail-stop (every run's outputs checked)",
         "value": ratio, "met": None if why else ratio is not None and ratio <= 0.1,
         "note": why},
    ]
    if cpu is not None:
        server = cpu.get("durable", {}).get("server")
        cpu_met, cpu_note = overhead_verdict(server, "no paired CPU figures")
        if cpu_met:  # CPU shows what work costs, not what waiting costs: only "over"
            cpu_met, cpu_note = None, ("not resolved in CPU: under the limit, but CPU does "
                                       "not count waits; the throughput line decides")
        out.append({"target": "journal + checksums cost <= 5% of the server's CPU per token "
                              "(router and workers; median of the paired repetitions)",
                    "value": server["median"] if server else None, "met": cpu_met,
                    "note": cpu_note})
    return out


def markdown(record: dict[str, Any]) -> str:
    def cell(row: str, key: str, scale: float = 1.0, digits: int = 2) -> str:
        entry = record["summary"].get(row, {}).get(key)
        if not entry:
            return "-"
        return (f"{entry['median'] * scale:.{digits}f} "
                f"({entry['min'] * scale:.{digits}f}-{entry['max'] * scale:.{digits}f})")

    lines = [
        f"Command: `{record['command']}`, {record['repeat']} repetitions, "
        f"{record['duration_s']:.0f} s, load average (1 min) "
        f"{record.get('loadavg_start', [float('nan')])[0]:.1f} at the start, "
        f"{record['loadavg_end'][0]:.1f} at the end. Median (min-max).",
        "",
        "| row | tokens/s | TTFT p50 ms | TTFT p99 ms | per-token p99 ms | time to recover s "
        "| lost requests | duplicated tokens | checks passed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, results in record["runs"].items():
        passed = sum(1 for r in results if r.get("passed"))
        failed = sorted({c for r in results for c in r.get("failed_checks", [])})
        checks = f"{passed}/{len(results)}" + (f" (failed: {', '.join(failed)})" if failed else "")
        lines.append(
            f"| {row} | {cell(row, 'tokens_per_s', digits=0)} | {cell(row, 'ttft_p50_s', 1e3, 0)}"
            f" | {cell(row, 'ttft_p99_s', 1e3, 0)} | {cell(row, 'tpot_p99_s', 1e3, 0)}"
            f" | {cell(row, 'time_to_recover_s')} | {cell(row, 'lost_requests', digits=0)}"
            f" | {cell(row, 'duplicated_tokens', digits=0)} | {checks} |")
    lines.append("")
    alone = record.get("router_cpu")
    if alone:
        lines += [f"Router alone (`router_cpu`, {alone['repeat']} runs each): CPU per token "
                  f"streamed {alone['bare']['median']:.1f} µs "
                  f"({alone['bare']['min']:.1f}-{alone['bare']['max']:.1f}) without the "
                  f"journal, {alone['journal']['median']:.1f} µs "
                  f"({alone['journal']['min']:.1f}-{alone['journal']['max']:.1f}) with it: "
                  f"the journal costs the router {alone['journal_extra_us']:.1f} µs a token"
                  + (f" ({alone['journal_extra_paired_us']:.1f} µs, median of the pairs)."
                     if "journal_extra_paired_us" in alone else "."),
                  ""]
        threads = alone.get("by_thread")
        if threads:
            lines += ["By thread, µs per token (medians): "
                      + "; ".join(f"{row}: " + ", ".join(f"{name} {part[name]:.1f}"
                                                         for name in THREADS)
                                  for row, part in threads.items()) + ".", ""]
    def spread(e: dict[str, Any]) -> str:
        return f"{e['median']:+.1%} ({e['min']:+.1%} to {e['max']:+.1%})"

    cpu = record.get("cpu_overheads", {})
    if cpu:
        lines += ["CPU per 1000 tokens against `bare` in the same repetition, median "
                  "(min-max): the server (router and workers), the router, the workers:", "",
                  *(f"- {row}: " + "; ".join(f"{part} {spread(e)}" for part, e in parts.items())
                    for row, parts in cpu.items()), ""]
    paired = record.get("overheads", {})
    if paired:
        lines += ["Throughput cost against `bare` in the same repetition, median (min-max) "
                  "[each repetition]:", "",
                  *(f"- {row}: {spread(entry)} ["
                    + ", ".join(f"{p:+.1%}" for p in entry["pairs"]) + "]"
                    for row, entry in paired.items()), ""]
    if any(record["summary"].get(row, {}).get("router_cpu_ms_per_1k_tokens")
           for row in record["summary"]):
        lines += [
            "Where the time goes, median (min-max): CPU ms per 1000 tokens served, of the "
            "router process and of all workers together (since they were ready), of the "
            "router's in the journal's threads (writer, fsync) and of the workers' in KV "
            "checksums (sealing, verifying), each timed where it runs; the "
            "workers' tokens per engine step and CPU ms per step; the journal's time in "
            "write(2), its longest write, records per write, fsyncs:",
            "",
            "| row | router CPU ms / 1k tokens | of which journal | workers CPU ms / 1k "
            "tokens | of which checksums | tokens per step | workers CPU ms / step "
            "| journal write s | longest write ms | records per write | fsyncs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in record["runs"]:
            lines.append(
                f"| {row} | {cell(row, 'router_cpu_ms_per_1k_tokens', digits=0)}"
                f" | {cell(row, 'journal_cpu_ms_per_1k_tokens', digits=1)}"
                f" | {cell(row, 'worker_cpu_ms_per_1k_tokens', digits=0)}"
                f" | {cell(row, 'worker_checksum_ms_per_1k_tokens', digits=1)}"
                f" | {cell(row, 'tokens_per_step', digits=2)}"
                f" | {cell(row, 'worker_cpu_ms_per_step', digits=2)}"
                f" | {cell(row, 'journal_write_s', digits=3)}"
                f" | {cell(row, 'journal_write_max_ms', digits=1)}"
                f" | {cell(row, 'journal_records_per_write', digits=2)}"
                f" | {cell(row, 'journal_fsyncs', digits=0)} |")
        lines.append("")
    for v in record["verdicts"]:
        value = "-" if v["value"] is None else f"{v['value']:.3f}"
        note = v.get("note") or ""
        # "In this run": one run's interval does not cover what changes between runs of
        # the same code (bench/results/history-2026-12.md, "Run J"); a target's status reads
        # all of them.
        said = ("met in this run" + (f" ({note})" if note else "") if v["met"] else
                (note or "not measured") if v["met"] is None else
                "NOT met" + (f" ({note})" if note else ""))
        lines.append(f"- {v['target']}: {value} -> {said}")
    return "\n".join(lines) + "\n"


def _put_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=80,
                        help="requests per run of the faulted rows (migrate, fail_stop)")
    parser.add_argument("--overhead-requests", type=int, default=240,
                        help="requests per run of the fault-free rows: a longer window than "
                        "80 (about 1 s of serving) so start and end matter less")
    parser.add_argument("--only", action="append", default=[], choices=sorted(ROWS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = args.only or list(ROWS)
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    started = time.monotonic()
    loadavg_start = os.getloadavg()
    code = code_identity()  # what the runs measure: `python -m bench.status` compares by it
    command = "python -m bench.serving" + (
        f" --repeat {args.repeat}" if args.repeat != 3 else "") + (
        f" --requests {args.requests}" if args.requests != 80 else "") + (
        f" --overhead-requests {args.overhead_requests}"
        if args.overhead_requests != 240 else "") + "".join(
        f" --only {r}" for r in args.only)
    cache_was = os.environ.get("AFTERSHOCK_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="aftershock-bench-serving-") as tmp, \
            contextlib.ExitStack() as restore:
        folder = Path(tmp)
        # The fault-free twins outputs_match needs: run once per system and seed in this
        # bench run (never taken from, nor left in, the user's cache). Put back afterwards:
        # the folder is gone then, and a caller in the same process (a test) keeps its own.
        os.environ["AFTERSHOCK_CACHE_DIR"] = str(folder / "cache")
        restore.callback(_put_env, "AFTERSHOCK_CACHE_DIR", cache_was)
        alone = {**router_cpu(folder, repeat=7), "repeat": 7} if "durable" in rows else None
        for rep in range(args.repeat):
            for row in run_order(rows, rep):
                requests = (args.overhead_requests if row in (*OVERHEAD_ROWS, "bare")
                            else args.requests)
                loaded = scenario(row, requests, folder)
                result = run_scenario(loaded, run_dir=folder / f"{row}-{rep}", seed=rep,
                                      use_cache=True)
                measured = measure(result)
                runs[row].append(measured)
                shown = {k: round(v, 3) if isinstance(v, float) else v
                         for k, v in measured.items()}
                print(f"[{rep + 1}/{args.repeat}] {row}: {shown}", flush=True)
    summary = summarise(runs)
    paired = overheads(runs)
    cpu = cpu_overheads(runs)
    record = {"command": command, "repeat": args.repeat, "requests": args.requests,
              "overhead_requests": args.overhead_requests,
              "duration_s": round(time.monotonic() - started, 1),
              "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
              "cpus": os.cpu_count(), "code": code, "runs": runs, "summary": summary,
              "overheads": paired, "cpu_overheads": cpu, "router_cpu": alone,
              "verdicts": verdicts(summary, paired, cpu)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "serving" if not args.only and args.repeat >= 3 else "serving-partial"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    table = markdown(record)
    (args.out / f"{stem}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
