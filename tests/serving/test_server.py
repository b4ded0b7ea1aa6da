"""The reference server end to end: real launcher, router, worker processes, sockets, signals.

Every request's tokens are checked against ``engine.generate`` run alone in this process:
index by index, no index twice, none missing, and the logits digest of each token against
the digest of the logits row ``generate`` chose it from (computed here, bitwise). Faults are
caused from here: SIGKILL and SIGSTOP/SIGCONT of the worker holding the most requests (found
through ``GET /v1/stats``), a client that drops its connection, SIGKILL of the launcher
itself. A deliberately broken server (the test-only ``drop_inflight`` patch of
``tests/serving/broken/sitecustomize.py``) shows the same checks failing.

Each server is started once per test and stopped with SIGTERM, after which no process that
carries the server's marker variable may be left.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aftershock.faults import _cgroup
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal
from aftershock.faults.straggle import STRAGGLE

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
BROKEN = Path(__file__).resolve().parent / "broken"  # sitecustomize.py: test-only variants
READY = "AFTERSHOCK_SERVING_READY"
PREFIXES = (
    "You are a terse assistant. Answer in one line. ",
    "System: translate the user's words into French. ",
    "Context: the reactor log for the night shift follows. ",
)
MAX_TOKENS = 32

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- helpers


def marked_pids(marker: str) -> list[int]:
    want = f"AFTERSHOCK_RUN_ID={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_for(predicate: Any, timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Server:
    """``python -m aftershock.reference_impl.serving.server`` as a test fixture."""

    def __init__(self, folder: Path, *args: str, journal: Path | None = None,
                 marker: str | None = None, broken: str | None = None) -> None:
        self.folder = folder
        self.marker = marker or uuid.uuid4().hex
        self.events_path = folder / "events.jsonl"
        self.journal = journal or folder / "journal.wal"
        self.log_path = folder / f"server-{time.monotonic_ns()}.log"
        env = dict(os.environ, AFTERSHOCK_EVENTS=str(self.events_path),
                   AFTERSHOCK_RUN_ID=self.marker, PYTHONUNBUFFERED="1")
        env.pop("AFTERSHOCK_COMMANDS", None)
        if broken:  # a deliberately broken server: the named test-only patches
            env.update(PYTHONPATH=f"{BROKEN}:{REPO}", AFTERSHOCK_INJECT_BROKEN_SERVING=broken)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aftershock.reference_impl.serving.server",
             f"--journal={self.journal}", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True,
        )
        self.url = self._await_ready(timeout=60)
        parts = self.url.split(":")
        self.host, self.port = parts[1].lstrip("/"), int(parts[2])

    def _await_ready(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=0.2):
                    if self.proc.poll() is not None:
                        break
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                buffer += chunk
                for line in buffer.decode().splitlines():
                    if line.startswith(READY):
                        return line.split()[1]
        self.close(check=False)
        raise AssertionError(f"server not ready: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        found = []
        for line in self.events_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return [e for e in found if kind is None or e["event"] == kind]

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def post(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def stats(self) -> dict[str, Any]:
        return self.get("/v1/stats")[1]

    def close(self, check: bool = True) -> int | None:
        """SIGTERM the launcher; it must exit 0 and leave no process behind."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            left = wait_for(lambda: not marked_pids(self.marker) or None, 5,
                            "no process left") if check else None
            for pid in marked_pids(self.marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._log.close()
        if check:
            assert left is None or left
            assert code == 0, self.log()
        return code


@dataclass
class Stream:
    """One client: streams a request, resuming from its offset when asked to."""

    server: Server
    request_id: str
    prompt: str
    max_tokens: int = MAX_TOKENS
    indices: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    drop_after: int | None = None  # close the connection after this many tokens

    def run(self, offset: int = 0) -> Stream:
        body = json.dumps({"prompt": self.prompt, "max_tokens": self.max_tokens,
                           "stream": True, "offset": offset})
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json",
                                  "Idempotency-Key": self.request_id})
            response = conn.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}: {response.read()!r}"
                return self
            for raw in iter(response.readline, b""):
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    return self
                chunk = json.loads(payload)
                if "error" in chunk:
                    self.error = chunk["error"]["message"]
                    return self
                choice = chunk["choices"][0]
                self.indices.append(choice["token_index"])
                self.tokens.extend(choice["token_ids"])
                self.digests.append(choice["logits_digest"])
                self.times.append(time.monotonic())
                if self.drop_after is not None and len(self.tokens) >= self.drop_after:
                    return self  # the client goes away mid-stream
            self.error = "stream ended without [DONE]"
        except (OSError, http.client.HTTPException) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        return self


def start_all(streams: list[Stream]) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return threads


def join_all(threads: list[threading.Thread], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client is still waiting"


def workload(tag: str, count: int = 12) -> list[tuple[str, str]]:
    """(request id, prompt): three shared prefixes; the same prompts in every test, so the
    ground truth is computed once."""
    return [(f"{tag}-{i:02d}", f"{PREFIXES[i % len(PREFIXES)]}Question {i}: what is {i * 7}?")
            for i in range(count)]


_truth_cache: dict[tuple[str, int], tuple[list[int], list[str]]] = {}


def _ground_truth(prompt: str, max_tokens: int) -> tuple[list[int], list[str]]:
    """``prompt`` run alone in a fresh engine: its tokens, and the digest of the logits row
    of each (BLAKE2b-64 of the float32 values, little-endian, as docs/serving.md defines
    it; computed here, not by the server's code)."""
    import hashlib
    import struct

    import torch

    from aftershock.reference_impl.serving.engine import generate
    from aftershock.reference_impl.serving.model import ModelConfig, encode

    torch.set_num_threads(1)  # 2 cores, shared with the server under test
    key = (prompt, max_tokens)
    if key not in _truth_cache:
        rows: list[torch.Tensor] = []
        tokens = list(generate(encode(prompt), max_tokens, ModelConfig(seed=0), logits=rows))
        digests = [hashlib.blake2b(struct.pack(f"<{row.numel()}f", *row.tolist()),
                                   digest_size=8).hexdigest() for row in rows]
        _truth_cache[key] = (tokens, digests)
    return _truth_cache[key]


def truth(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The tokens of ``prompt`` run alone in a fresh engine: the ground truth."""
    return _ground_truth(prompt, max_tokens)[0]


def truth_digests(prompt: str, max_tokens: int = MAX_TOKENS) -> list[str]:
    return _ground_truth(prompt, max_tokens)[1]


def assert_exact(streams: list[Stream]) -> None:
    """Every token at its index, once, equal to the ground truth, and chosen from bitwise
    the ground truth's logits."""
    for s in streams:
        assert s.error is None, f"{s.request_id}: {s.error}"
        assert s.done, s.request_id
        assert s.indices == list(range(s.max_tokens)), f"{s.request_id}: {s.indices}"
        assert s.tokens == truth(s.prompt, s.max_tokens), s.request_id
        assert s.digests == truth_digests(s.prompt, s.max_tokens), s.request_id


def busiest(server: Server) -> dict[str, Any]:
    workers = server.stats()["workers"]
    return max(workers, key=lambda w: (w["requests"], -w["worker"]))


def all_streaming(streams: list[Stream], at_least: int) -> bool:
    return all(len(s.tokens) >= at_least for s in streams)


def full_strength(server: Server, timeout: float = 40) -> list[dict[str, Any]]:
    """Wait until every worker is ready (a respawned one takes seconds to start)."""
    return wait_for(lambda: (lambda w: w if all(x["state"] == "ready" for x in w) else None)(
        server.stats()["workers"]), timeout, "every worker ready")


# --------------------------------------------------------------------------- tests
# One server for the tests below, in file order: each starts from a server at full strength.


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("serve"), "--workers=3", "--step-sleep=0.03")
    try:
        yield started
    finally:
        started.close(check=False)  # the last test SIGKILLs it; it checks its successor


def test_ready_health_and_api_errors(server: Server) -> None:
    ready = server.events("serving_ready")
    assert [(e["url"], e["workers"]) for e in ready] == [(server.url, 3)]
    assert sorted(e["worker"] for e in server.events("worker_started")) == [0, 1, 2]
    assert server.get("/health/live")[0] == 200
    assert server.get("/health/ready")[0] == 200
    assert server.get("/nowhere")[0] == 404
    status, body = server.post({"prompt": PREFIXES[0] + "api", "max_tokens": 4,
                                "request_id": "api-1"})
    assert status == 200
    assert body["choices"][0]["token_ids"] == truth(PREFIXES[0] + "api", 4)
    status, body = server.post({"prompt": PREFIXES[0] + "api", "max_tokens": 7,
                                "request_id": "api-1"})
    assert (status, body["error"]["param"]) == (409, "max_tokens")
    status, body = server.post({"prompt": "x", "max_tokens": 5000})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    status, body = server.post({"prompt": ["a"], "max_tokens": 3})
    assert (status, body["error"]["param"]) == (400, "prompt")
    stats = server.stats()
    assert stats["requests"]["accepted"] == 1
    assert stats["journal"]["enabled"] is True
    assert {"prefix_hit_rate", "recomputed_tokens"} <= set(stats["engine"])


def test_long_prefill_is_not_a_wedge(server: Server) -> None:
    """4000 prompt positions at once (8 steps' worth of prefill): a busy engine, never taken
    for a wedged one (--wedged-after 2 s) or a dead one."""
    prompts = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(1000)) for i in range(4)]
    streams = [Stream(server, f"long-{i}", p, max_tokens=2) for i, p in enumerate(prompts)]
    began = time.monotonic()
    join_all(start_all(streams))
    assert all(s.done for s in streams), [s.error for s in streams]
    assert not server.events("failure_detected"), f"{time.monotonic() - began:.1f} s"


def test_a_starved_worker_is_busy_not_wedged(tmp_path: Path) -> None:
    """A worker held to a thirtieth of a CPU (a cgroup quota: it waits on the run queue)
    takes seconds per engine step, longer than --wedged-after, yet is never taken for a
    wedged one: it is not stuck, it is waiting for a CPU. Only a step that blocks, or
    spins for --wedged-after of CPU without finishing, is a wedge."""
    mount = _cgroup.v1_mount("cpu")
    if os.geteuid() != 0 or mount is None or not _cgroup.writable(mount):
        pytest.skip("no writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu) as root")
    server = Server(tmp_path, "--workers=1", "--dead-after=5", "--wedged-after=1")
    try:
        worker = full_strength(server)[0]
        ref = ProcessRef.of(worker["pid"])
        assert ref is not None
        applied = STRAGGLE.inject(ref, {"factor": 30, "method": "cgroup"},
                                  Journal.create("straggle", tmp_path))
        try:
            prompt = "".join(chr(97 + (j * 5) % 26) for j in range(1000))
            streams = [Stream(server, "starved-0", prompt, max_tokens=2)]
            began = time.monotonic()
            join_all(start_all(streams), timeout=240)
        finally:
            STRAGGLE.revert(applied.undo)
        assert all(s.done for s in streams), [s.error for s in streams]
        # 1000 prompt positions at 512 a step: 2 steps before the first token. Over 2
        # seconds to it means at least one step longer than --wedged-after (1 s).
        first = streams[0].times[0] - began
        assert first > 2, f"not starved: the first token came after {first:.1f} s"
        assert not server.events("failure_detected"), server.events("failure_detected")
    finally:
        server.close(check=False)


def test_kill_busiest_worker_migrates(server: Server) -> None:
    """SIGKILL the worker with the most requests mid-stream: every request completes with
    exactly the tokens it gets alone, no index twice, none missing."""
    full_strength(server)
    # The server is shared: judge only this test's failures and moves.
    earlier = len(server.events("failure_detected"))
    recovered = len(server.events("recovery_done"))
    migrations = server.stats()["migrations"]
    streams = [Stream(server, rid, prompt) for rid, prompt in workload("kill")]
    threads = start_all(streams)
    wait_for(lambda: all_streaming(streams, 4), 30, "every stream under way")
    victim = busiest(server)
    assert victim["requests"] > 0
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    join_all(threads)
    assert_exact(streams)

    detected = [e for e in server.events("failure_detected")[earlier:]
                if e.get("worker") == victim["worker"]]
    assert [e["cause"] for e in detected] == ["worker_exit"], detected
    mine = {s.request_id for s in streams}
    moved = {e["request_id"]: e for e in server.events("request_migrated")
             if e["request_id"] in mine}
    assert moved
    assert set(moved) == set(detected[0]["requests"])
    for event in moved.values():
        assert event["from_worker"] == victim["worker"]
        assert event["to_worker"] != victim["worker"]
        assert event["emitted"] >= 4
    assert [e["worker"] for e in server.events("recovery_done")[recovered:]] == [victim["worker"]]
    # Kill -> the first token computed by the new worker (index == tokens emitted before).
    by_id = {s.request_id: s for s in streams}
    resumed = [by_id[rid].times[by_id[rid].indices.index(event["emitted"])] - killed_at
               for rid, event in moved.items()]
    print(f"\nkill -> first token from the new worker, {len(resumed)} migrated requests: "
          f"max {max(resumed) * 1000:.0f} ms; kill -> detection "
          f"{(detected[0]['t'] - killed_at) * 1000:.0f} ms; router (detection -> first "
          f"token): {server.stats()['migration_first_token_s']}")
    stats = server.stats()
    assert stats["migrations"] - migrations == len(moved)
    assert stats["engine"]["recomputed_tokens"] > 0
    # The dead worker comes back: a new process at the same index, generation 1.
    wait_for(lambda: any(e["worker"] == victim["worker"] and e["generation"] == 1
                         for e in server.events("worker_started")), 10, "a respawn")


def test_client_resumes_by_request_id_and_offset(server: Server) -> None:
    rid, prompt = "resume-01", f"{PREFIXES[0]}Question 0: what is 0?"
    accepted = server.stats()["requests"]["accepted"]
    first = Stream(server, rid, prompt, drop_after=5).run()
    assert first.error is None
    assert not first.done
    assert len(first.tokens) == 5
    rest = Stream(server, rid, prompt).run(offset=5)
    assert rest.done
    assert rest.indices == list(range(5, MAX_TOKENS))
    assert first.tokens + rest.tokens == truth(prompt)
    assert first.digests + rest.digests == truth_digests(prompt)
    # Finished, then asked again: served from memory, never generated a second time.
    status, whole = server.post({"prompt": prompt, "max_tokens": MAX_TOKENS,
                                 "request_id": rid})
    assert status == 200
    assert whole["choices"][0]["token_ids"] == truth(prompt)
    assert whole["choices"][0]["logits_digests"] == truth_digests(prompt)
    assert server.stats()["requests"]["accepted"] == accepted + 1


def test_freeze_busiest_worker_is_fenced(server: Server) -> None:
    """SIGSTOP the busiest worker: its heartbeats stop, its requests move. SIGCONT: what it
    computed meanwhile arrives and is fenced; it rejoins as a fresh worker."""
    full_strength(server)
    before = server.stats()
    # The server is shared by the module's tests: count only this test's recoveries.
    recovered = len(server.events("recovery_done"))
    streams = [Stream(server, rid, prompt) for rid, prompt in workload("freeze")]
    threads = start_all(streams)
    wait_for(lambda: all_streaming(streams, 4), 30, "every stream under way")
    victim = busiest(server)
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        detected = wait_for(lambda: [e for e in server.events("failure_detected")
                                     if e.get("pid") == victim["pid"]], 10, "the freeze seen")
        assert detected[0]["cause"] == "heartbeat"
        wait_for(lambda: len(server.events("recovery_done")) == recovered + 1, 10,
                 "its requests moved")
        time.sleep(0.3)  # the others stream on while it is frozen
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    join_all(threads)
    assert_exact(streams)
    # The woken worker drops everything and reconnects: same process, a new link.
    workers = full_strength(server, 10)
    assert workers[victim["worker"]]["pid"] == victim["pid"]
    assert workers[victim["worker"]]["link"] != victim["link"]
    stats = server.stats()
    assert stats["fenced_tokens"] > before["fenced_tokens"], stats  # its stale last step
    assert stats["migrations"] - before["migrations"] == len(detected[0]["requests"])


def test_router_process_crash_is_restarted_on_its_journal(server: Server) -> None:
    """SIGKILL the router process mid-stream: its workers die with it, the launcher starts a
    new router on the same address and journal, which resumes the requests. Clients resume
    by request_id + offset and get exactly the tokens they lacked."""
    (router,) = [e for e in server.events("hello") if e.get("role") == "router"]
    workers = [w["pid"] for w in full_strength(server)]
    streams = [Stream(server, rid, prompt) for rid, prompt in workload("router", 6)]
    threads = start_all(streams)
    wait_for(lambda: all_streaming(streams, 4), 30, "every stream under way")
    os.kill(router["pid"], signal.SIGKILL)
    join_all(threads, timeout=20)
    assert all(s.error for s in streams)  # every stream broke with the router
    wait_for(lambda: not any(alive(pid) for pid in workers), 5,
             "the workers gone with their router")
    # The workers see the router's socket close at once; the launcher writes its event
    # when its wait() returns, which on a busy machine can come later.
    (detected,) = wait_for(lambda: [e for e in server.events("failure_detected")
                                    if e["cause"] == "router_exit"], 10,
                           "the launcher's router_exit event")
    assert (detected["pid"], detected["generation"]) == (router["pid"], 0)
    for s in streams:  # the same URL: the launcher kept the socket
        received = len(s.tokens)
        rest = Stream(server, s.request_id, s.prompt).run(offset=received)
        assert rest.done, rest.error
        assert rest.indices == list(range(received, MAX_TOKENS))
        assert s.tokens + rest.tokens == truth(s.prompt), s.request_id
        assert s.digests + rest.digests == truth_digests(s.prompt), s.request_id
    # The new router's event is written by its own thread, which on a busy machine can
    # come after the first requests it resumed.
    (again,) = wait_for(lambda: [e for e in server.events("hello") if e.get("role") == "router"
                                 and e["generation"] == 1], 10, "the new router's hello")
    assert alive(again["pid"])
    assert server.stats()["requests"]["resumed_from_journal"] == len(streams)
    (recovered,) = wait_for(lambda: [e for e in server.events("recovery_done")
                                     if e.get("role") == "router"], 10,
                            "the new router's recovery_done")
    assert recovered["resumed"] == len(streams)


def test_router_crash_resumes_from_journal(server: Server, tmp_path: Path) -> None:
    """SIGKILL the launcher mid-stream: its router and workers die with it. A new launcher
    on the same journal resumes the requests; clients resume by request_id + offset and get
    exactly the tokens they would have got. SIGTERM then leaves nothing running."""
    workers = [w["pid"] for w in full_strength(server)]
    streams = [Stream(server, rid, prompt) for rid, prompt in workload("crash", 6)]
    threads = start_all(streams)
    wait_for(lambda: all_streaming(streams, 4), 30, "every stream under way")
    os.kill(server.proc.pid, signal.SIGKILL)
    join_all(threads, timeout=20)
    assert all(s.error for s in streams)  # every stream broke with the router
    wait_for(lambda: not any(alive(pid) for pid in workers), 5,
             "the workers gone with their launcher")
    again = Server(tmp_path, "--workers=1", journal=server.journal)
    try:
        assert again.stats()["requests"]["resumed_from_journal"] == len(streams)
        for s in streams:
            received = len(s.tokens)
            rest = Stream(again, s.request_id, s.prompt).run(offset=received)
            assert rest.done, rest.error
            assert rest.indices == list(range(received, MAX_TOKENS))
            assert s.tokens + rest.tokens == truth(s.prompt), s.request_id
            assert s.digests + rest.digests == truth_digests(s.prompt), s.request_id
        assert again.stats()["requests"]["accepted"] == 0  # nothing generated twice
    finally:
        again.close()


def test_broken_drop_inflight_fails_the_check(tmp_path: Path) -> None:
    """The kill test against a router that drops a failed worker's requests (a test-only
    patch): requests end short, so the exact output check above fails, as it must."""
    server = Server(tmp_path, "--workers=2", "--step-sleep=0.03", broken="drop_inflight")
    try:
        streams = [Stream(server, rid, prompt) for rid, prompt in workload("drop", 8)]
        threads = start_all(streams)
        wait_for(lambda: all_streaming(streams, 4), 30, "every stream under way")
        victim = busiest(server)
        os.kill(victim["pid"], signal.SIGKILL)
        join_all(threads)
        short = [s for s in streams if len(s.tokens) < MAX_TOKENS]
        assert len(short) == victim["requests"] > 0
        with pytest.raises(AssertionError):
            assert_exact(streams)
    finally:
        server.close()
