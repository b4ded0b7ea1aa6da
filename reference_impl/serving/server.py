"""The reference server's launcher: ``python -m aftershock.reference_impl.serving.server``.

Two levels of supervision, so that any part of the server can crash and come back:

- The launcher (the process users start) binds the HTTP socket once and keeps one *router
  process* alive on it: it starts it, and when it dies (a crash, a kill) starts it again,
  generation + 1, on the same socket and the same journal. Clients that connect meanwhile
  wait in the socket's backlog rather than being refused; the new router replays the
  journal, serves finished requests from it and resumes unfinished ones, so a client that
  re-POSTs its ``request_id`` with ``offset`` = tokens received gets exactly the rest.
  It reports a router death as ``failure_detected`` with ``cause: router_exit``.
- The router process (``--router-process``: started by the launcher, never by hand) runs
  the router (HTTP API, worker links, health monitor, journal) and keeps ``--workers``
  engine worker processes alive: it spawns them, respawns one that died (a new process for
  the same worker index, generation + 1; not for a drained index), kills one the router
  found wedged, and in ``--recovery fail_stop`` restarts them all. When every worker is
  ready it prints ``AFTERSHOCK_SERVING_READY <url>`` on stdout (the only line the server
  writes there, once per router generation; logs go to stderr) and emits ``serving_ready``.

A router crash takes its workers with it (they die with the process that spawned them), so
the new router starts its workers cold; the journal, not the workers, carries the requests
over. Keeping workers alive across a router restart would save that cold start at the cost
of a supervisor that owns workers and router alike; not built.

SIGTERM / SIGINT: the router process stops accepting, ends the streams, kills the workers,
flushes the journal, emits ``serving_stats`` and exits 0; the launcher passes the signal on,
waits for it and exits with its code. No process outlives the launcher, even a SIGKILLed
one: each child dies with its parent (``PR_SET_PDEATHSIG``), and workers exit when the
router's link is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from aftershock._root import child_pythonpath
from aftershock.faults import process_state
from aftershock.harness import probe
from aftershock.reference_impl.serving._lifetime import StopRequest, die_with_parent
from aftershock.reference_impl.serving.journal import Journal
from aftershock.reference_impl.serving.router import (
    RECOVERIES,
    Router,
    RouterConfig,
    fault_points,
    flat_stats,
    http_server,
)

READY_LINE = "AFTERSHOCK_SERVING_READY"
# A dead worker's replacement waits at most this long for the requests moved off it to
# stream again on the healthy workers (WorkerKeeper._held).
RESPAWN_HOLD_S = 2.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m aftershock.reference_impl.serving.server",
        description="Aftershock's reference LLM server: a router with an OpenAI-style API in "
        "front of engine worker processes, with failure detection, request migration and a "
        "write-ahead journal.",
    )
    add = parser.add_argument
    add("--workers", type=int, default=3, help="engine worker processes (default 3)")
    add("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    add("--port", type=int, default=0, help="HTTP port; 0 picks a free one (default)")
    add("--seed", type=int, default=0, help="model seed: the weights (default 0)")
    add("--block-size", type=int, default=16, help="KV cache block size, tokens (default 16)")
    add("--num-blocks", type=int, default=512, help="KV blocks per worker (default 512)")
    add("--max-batch", type=int, default=16,
        help="requests per engine step, per worker (default 16)")
    add("--journal", default=None, metavar="PATH",
        help="write-ahead journal; an existing one is replayed (finished requests are "
        "served from it, unfinished ones resumed). Default "
        "$AFTERSHOCK_OUTPUT_DIR/journal/journal.wal, "
        "else a new temporary file")
    add("--no-journal", action="store_true", help="run without a journal")
    add("--no-checksums", action="store_true",
        help="engine: never verify KV block checksums (same as --verify off)")
    add("--verify", default=None, choices=("off", "hit", "read"),
        help="engine: when KV block checksums are verified: on prefix-cache hits, on every "
        "read of a block, or never (default: the engine's default)")
    add("--no-batch-invariant", action="store_true",
        help="engine: allow batch-dependent kernels; a request's tokens may then depend on "
        "its batch, and a migrated request may change course")
    add("--device", default="cpu", choices=("cpu", "cuda"),
        help="engine device; cuda: worker I uses GPU I modulo the GPU count (default cpu)")
    add("--threads", type=int, default=1,
        help="torch threads per worker (default 1: the kernel's tiles are small, and more "
        "threads spin against each other)")
    add("--heartbeat", type=float, default=0.1, help="seconds between worker heartbeats (0.1)")
    add("--dead-after", type=float, default=1.0,
        help="no heartbeat this long: the worker is dead (1.0)")
    add("--wedged-after", type=float, default=2.0,
        help="busy without engine progress this long, blocked or on a CPU (time waiting for a "
        "CPU does not count): the worker is wedged (2.0); must exceed the CPU time of the "
        "longest legitimate engine step")
    add("--recovery", default="migrate", choices=RECOVERIES,
        help="migrate: move a failed worker's requests, with their emitted tokens, to healthy "
        "workers; fail_stop: the baseline: error out every in-flight request and restart all "
        "workers cold (clients retry from scratch)")
    add("--step-sleep", type=float, default=0.0,
        help="seconds added to every engine step, to make short runs long enough to hit")
    # Set by the launcher for the router process it starts; not for users.
    add("--router-process", action="store_true", help=argparse.SUPPRESS)
    add("--http-fd", type=int, default=None, help=argparse.SUPPRESS)
    add("--router-generation", type=int, default=0, help=argparse.SUPPRESS)
    add("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.router_process and args.http_fd is None:
        parser.error("--router-process needs --http-fd")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    for name in ("heartbeat", "dead_after", "wedged_after"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.dead_after <= args.heartbeat:
        parser.error("--dead-after must be longer than --heartbeat")
    return args


class WorkerKeeper:
    """In the router process: spawns, watches and respawns the worker processes.

    Every spawn happens on the supervisor thread: the workers' PR_SET_PDEATHSIG fires when
    the *thread* that forked them ends, so that thread must live as long as the process.
    Router callbacks (kill, restart_all) only leave a note for it; they run under the
    router's lock and must not block.
    """

    def __init__(self, args: argparse.Namespace, router: Router, link: tuple[str, int]) -> None:
        self.args = args
        self.router = router
        self.link = link
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._generation = dict.fromkeys(range(args.workers), -1)
        self._started_at: dict[int, float] = {}
        self._backoff = dict.fromkeys(range(args.workers), 0.0)
        self._respawn_at = dict.fromkeys(range(args.workers), 0.0)
        self._hold_until = dict.fromkeys(range(args.workers), 0.0)
        self._restart_all = threading.Event()
        self._stop = threading.Event()
        self._quiet = False
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._common = [
            f"--router={link[0]}:{link[1]}", f"--workers={args.workers}",
            f"--parent-pid={os.getpid()}", f"--seed={args.seed}",
            f"--block-size={args.block_size}", f"--num-blocks={args.num_blocks}",
            f"--max-batch={args.max_batch}", f"--device={args.device}",
            f"--threads={args.threads}", f"--heartbeat={args.heartbeat}",
            *([f"--verify={'off' if args.no_checksums else args.verify}"]
              if args.no_checksums or args.verify else []),
            f"--step-sleep={args.step_sleep}",
            # A worker outlives a router restart this long before it gives up.
            f"--reconnect-for={max(3.0, 3 * args.dead_after)}",
        ]
        self._common += ["--no-batch-invariant"] * args.no_batch_invariant

    def start(self) -> None:
        self._thread.start()

    # -- router callbacks (called with the router's lock held: never block)
    def process_gone(self, index: int) -> bool:
        """Whether the process of ``index`` has ended. Reads /proc rather than reaping:
        the supervisor thread reaps, and a zombie already counts as gone."""
        with self._lock:
            proc = self._procs.get(index)
        if proc is None or proc.returncode is not None:
            return True
        return process_state(proc.pid) in (None, "Z", "X")

    def kill(self, index: int) -> None:
        with self._lock:
            proc = self._procs.get(index)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def restart_all(self) -> None:
        self._restart_all.set()

    def quiesce(self) -> None:
        """Shutdown has begun: respawn nothing, report no exit (a flag: signal-safe)."""
        self._quiet = True

    # -- the supervisor thread
    def _spawn(self, index: int) -> None:
        generation = self._generation[index] + 1
        self._generation[index] = generation
        env = dict(os.environ)
        # The worker index is its rank for the harness (targets by RANK) and picks its GPU
        # (LOCAL_RANK, for real and simulated NVML and for gpu.xid's default).
        env.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(self.args.workers),
                   LOCAL_WORLD_SIZE=str(self.args.workers))
        env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
        argv = [
            sys.executable,
            "-m",
            "aftershock.reference_impl.serving.worker",
            f"--worker={index}",
            f"--generation={generation}",
            *self._common,
        ]
        # Worker stdout goes to our stderr: our stdout carries only the READY line.
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno())
        with self._lock:
            self._procs[index] = proc
        self._started_at[index] = time.monotonic()
        self.router.worker_started(index, proc.pid, generation)

    def _reap(self, index: int, proc: subprocess.Popen[bytes], code: int) -> None:
        with self._lock:
            if self._procs.get(index) is proc:
                del self._procs[index]
        self.router.worker_exited(index, code)
        lived = time.monotonic() - self._started_at.get(index, 0.0)
        # A worker that keeps dying at start must not spin: back off up to 5 s.
        self._backoff[index] = 0.0 if lived > 10 else min(max(self._backoff[index] * 2, 0.25), 5.0)
        self._respawn_at[index] = time.monotonic() + self._backoff[index]
        self._hold_until[index] = time.monotonic() + RESPAWN_HOLD_S

    def _held(self, index: int, now: float) -> bool:
        """Whether the respawn of ``index`` waits for the moved requests to stream again.

        A replacement's start (``import torch``, ~4 s of CPU) takes a core from the workers
        re-prefilling the requests moved off the dead one, on a small host exactly when
        recovery is being timed. It still starts for real, at most RESPAWN_HOLD_S later."""
        return now < self._hold_until[index] and self.router.resuming()

    def _supervise(self) -> None:
        for index in range(self.args.workers):
            self._spawn(index)
        while not self._stop.is_set():
            if self._quiet:
                self._stop.wait(0.02)
                continue
            if self._restart_all.is_set():
                self._restart_all.clear()
                with self._lock:
                    procs = dict(self._procs)
                for proc in procs.values():
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                for index, proc in procs.items():
                    self._reap(index, proc, proc.wait())
                    self._respawn_at[index] = 0.0  # a cold restart is not a crash loop
                    self._hold_until[index] = 0.0  # and nothing was moved: start at once
            with self._lock:
                procs = dict(self._procs)
            for index, proc in procs.items():
                code = proc.poll()
                if code is not None:
                    self._reap(index, proc, code)
            now = time.monotonic()
            for index in range(self.args.workers):
                if (
                    index not in self._procs
                    and now >= self._respawn_at[index]
                    and not self._held(index, now)
                    and not self._restart_all.is_set()  # it respawns them all itself
                    and not self._stop.is_set()
                    and not self.router.drained(index)
                ):
                    self._spawn(index)
            self._stop.wait(0.02)

    def stop(self) -> None:
        """Kill every worker and wait for it: nothing is left running."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in procs:
            proc.wait()


def _journal(args: argparse.Namespace) -> str | None:
    if args.no_journal:
        return None
    if args.journal:
        return str(args.journal)
    folder = probe.output_dir()
    if folder:  # a folder of its own: a power loss can be aimed at it (storage.lose_unsynced)
        journal = Path(folder) / "journal"
        journal.mkdir(parents=True, exist_ok=True)
        return str(journal / "journal.wal")
    fd, path = tempfile.mkstemp(prefix="aftershock-journal-", suffix=".wal")
    os.close(fd)
    return path


def serve(args: argparse.Namespace) -> int:
    """The router process: the router on the launcher's HTTP socket, and its workers."""
    die_with_parent(args.parent_pid)
    # The harness signals the whole process group: the workers are dying too. The handler
    # says so at once, before their exits look like failures to recover from, and sets
    # flags only (StopRequest: a second SIGTERM, the launcher's, can interrupt it anywhere).
    stop = StopRequest()
    signal.signal(signal.SIGTERM, stop.on_signal)
    signal.signal(signal.SIGINT, stop.on_signal)

    generation = args.router_generation
    probe.hello(world=args.workers, generation=generation, role="router")
    path = _journal(args)
    journal, replayed = Journal.open(path) if path else (None, None)
    print(
        f"[server] router generation {generation} (pid {os.getpid()}), journal: {path or 'off'}",
        file=sys.stderr,
        flush=True,
    )
    config = RouterConfig(
        workers=args.workers,
        dead_after=args.dead_after,
        wedged_after=args.wedged_after,
        recovery=args.recovery,
    )
    keeper: WorkerKeeper | None = None
    router = Router(
        config,
        journal,
        replayed,
        process_gone=lambda i: keeper is None or keeper.process_gone(i),
        kill=lambda i: keeper.kill(i) if keeper else None,
        restart_all=lambda: keeper.restart_all() if keeper else None,
        faults=fault_points(),
    )
    stop.also(router.quiesce)
    link = router.listen("127.0.0.1")
    http = http_server(router, sock=socket.socket(fileno=args.http_fd))
    host, port = http.server_address[:2]
    assert isinstance(host, str)  # an AF_INET socket: its address is text
    url = f"http://{host}:{port}"
    serving = threading.Thread(
        target=http.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True
    )
    serving.start()
    keeper = WorkerKeeper(args, router, link)
    stop.also(keeper.quiesce)
    keeper.start()
    announced = False
    try:
        while not stop.requested:
            if not announced and router.ready.wait(0.1):
                announced = True
                probe.emit("serving_ready", url=url, workers=args.workers, generation=generation)
                if generation:
                    probe.recovered(
                        role="router",
                        generation=generation,
                        resumed=router.stats()["requests"]["resumed_from_journal"],
                    )
                print(f"{READY_LINE} {url}", flush=True)
            elif announced:
                stop.wait(0.5)
    finally:
        # Each part timed, and said on stderr: a shutdown that overran the harness's grace
        # period then shows where its time went.
        print("[server] stopping", file=sys.stderr, flush=True)
        took: dict[str, float] = {}
        began = time.monotonic()
        # Stop accepting first, so no request is accepted that the journal will not see.
        http.shutdown()
        took["http"], began = time.monotonic() - began, time.monotonic()
        router.stop()
        keeper.stop()
        http.server_close()
        took["workers"], began = time.monotonic() - began, time.monotonic()
        if journal is not None:
            journal.close()
            took["journal"] = time.monotonic() - began
        stats = router.stats()
        probe.emit("serving_stats", **flat_stats(stats))
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in took.items())
        print(
            f"[server] stopped ({parts}): {stats['requests']}, {stats['migrations']} "
            f"migrations, {stats['failures']} failures",
            file=sys.stderr,
            flush=True,
        )
    return 0


class Launcher:
    """The launcher: owns the HTTP socket, keeps one router process alive on it.

    Runs on the main thread (the router's ``PR_SET_PDEATHSIG`` is tied to the thread that
    spawned it). A router that dies within 10 s of its start, again and again, is restarted
    after a growing pause (0.25 s, doubling to 5 s) instead of spinning; the first restart
    is immediate, since clients are waiting.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        argv: Sequence[str],
        sock: socket.socket,
        journal: str | None,
    ) -> None:
        self.args = args
        self.argv = list(argv)
        self.sock = sock
        self.journal = journal
        self.stop = StopRequest()
        self.proc: subprocess.Popen[bytes] | None = None
        self._backoff = 0.0

    def on_signal(self, signum: int, frame: object) -> None:
        """Flags and non-blocking calls only: a second signal may interrupt it anywhere."""
        self.stop.on_signal(signum, frame)
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # a no-op twice if it was the group's signal

    def _spawn(self, generation: int) -> subprocess.Popen[bytes]:
        fd = self.sock.fileno()
        argv = [
            sys.executable,
            "-m",
            "aftershock.reference_impl.serving.server",
            *self.argv,
            "--router-process",
            f"--http-fd={fd}",
            f"--router-generation={generation}",
            f"--parent-pid={os.getpid()}",
            *([f"--journal={self.journal}"] if self.journal else ["--no-journal"]),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=(fd,))

    def run(self) -> int:
        generation = 0
        while True:
            started = time.monotonic()
            self.proc = proc = self._spawn(generation)
            if self.stop.requested:
                self.on_signal(signal.SIGTERM, None)  # the signal came while it was starting
            code = proc.wait()
            if self.stop.requested:
                return code
            probe.detected(
                "router_exit", role="router", pid=proc.pid, generation=generation, returncode=code
            )
            print(
                f"[server] router generation {generation} (pid {proc.pid}) exited with "
                f"{code}; restarting it on the same socket and journal",
                file=sys.stderr,
                flush=True,
            )
            if time.monotonic() - started > 10:
                self._backoff = 0.0
            if self.stop.wait(self._backoff):
                return code
            self._backoff = min(max(self._backoff * 2, 0.25), 5.0)
            generation += 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.router_process:
        return serve(args)
    try:
        # Bound once, here: every router generation serves the same address, and clients
        # connecting while none runs wait in the backlog.
        sock = socket.create_server((args.host, args.port), backlog=256)
    except OSError as exc:
        print(f"[server] cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(args, argv, sock, _journal(args))
    signal.signal(signal.SIGTERM, launcher.on_signal)
    signal.signal(signal.SIGINT, launcher.on_signal)
    try:
        return launcher.run()
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
