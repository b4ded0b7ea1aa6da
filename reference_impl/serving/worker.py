"""An engine worker: runs one ``Engine`` and serves the router over one TCP link.

``python -m aftershock.reference_impl.serving.worker --router HOST:PORT --worker I ...``; the router
process (``server.WorkerKeeper``) starts it. Threads and what each may touch:

- the main thread owns the engine: it applies the router's messages between steps, calls
  ``probe.fault_point("decode", step)`` before every step (in-process memory faults fire
  there), runs the step and sends its tokens;
- a reader thread turns the router's lines into messages on a queue;
- a heartbeat thread sends the step counter, whether the engine has work, and the engine's
  counters every ``--heartbeat`` seconds. It never calls into the engine (the main thread
  publishes what it needs), and it keeps beating through a long step, so the router can
  tell a busy engine (heartbeats, steps advancing) from a dead one (no heartbeats) and from
  a wedged one (heartbeats, no step for ``--wedged-after``). A step is short by the
  engine's design: a long prefill is chunked over steps (``EngineConfig.max_step_tokens``).
  Each beat also carries the engine thread's scheduler account (CPU time and time spent
  runnable, waiting for a CPU), so that a step slowed by a busy machine is not taken for
  a stuck one.
  Finer progress signals were measured and dropped: counting every torch call of a step
  (a ``TorchFunctionMode``, ~1000 calls per step) cost a few percent of throughput, and
  sampling the engine thread's innermost frame gave false alarms (a freed frame's address
  is reused by the next call of the same function);
- the Xid watcher (``aftershock.reference_impl.health.XidWatcher``, real NVML or the simulation):
  an Xid whose action is not ``none`` is reported to the router, then the process exits.

When the link breaks, or the router sends ``Reset``, the worker drops every request (the
router has moved them already) and reconnects as a fresh worker. It exits when it cannot
reach the router for ``--reconnect-for`` seconds, and at once when the router process dies
(``PR_SET_PDEATHSIG``), so no worker outlives its server.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence

from aftershock.harness import probe
from aftershock.reference_impl import health
from aftershock.reference_impl.serving import _wire
from aftershock.reference_impl.serving._lifetime import die_with_parent


def _log(worker: int, message: str) -> None:
    print(f"[worker {worker} pid {os.getpid()}] {message}", file=sys.stderr, flush=True)


def schedstat(tid: int) -> tuple[float | None, float | None]:
    """Seconds thread ``tid`` of this process has run, and has waited runnable for a CPU
    (the run queue, or a CPU quota's throttling), from the kernel's scheduler account."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as account:
            ran, waited = account.read(256).split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None, None


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from aftershock.reference_impl.serving.engine import Engine, EngineConfig
        from aftershock.reference_impl.serving.model import ModelConfig

        if args.threads:
            torch.set_num_threads(args.threads)
        self.args = args
        self.index: int = args.worker
        device = args.device
        if device == "cuda":
            device = f"cuda:{self.index % max(torch.cuda.device_count(), 1)}"
        self.model = ModelConfig(seed=args.seed)
        config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              max_batch=args.max_batch,
                              batch_invariant=not args.no_batch_invariant)
        if args.verify is not None:  # else the engine's default
            config = dataclasses.replace(config, verify=args.verify)
        self.engine = Engine(self.model, config, device=device)
        self.engine.on_checksum_failure = self._checksum_failure
        self.epochs: dict[str, int] = {}  # request id -> epoch of its assignment here
        # Published by the main thread for the heartbeat thread (plain attribute writes).
        self.steps = 0
        self.busy = False
        self.stats: dict[str, float] = {}
        self._cpu_at_hello = time.process_time()  # reset at hello: serving, not start-up
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._engine_tid = threading.get_native_id()  # the main thread runs the engine

    # -- reports
    def _checksum_failure(self, block: int, request_id: str, where: str) -> None:
        probe.detected("kv_checksum", block=block, request=request_id, on=where,
                       worker=self.index)

    def on_xid(self, code: int, action: str) -> None:
        """From the Xid watcher thread."""
        probe.emit("xid_action", code=code, action=action)
        _log(self.index, f"Xid {code}: action {action}")
        if action == "none":
            return
        with contextlib.suppress(OSError):
            self.send(_wire.XidReport(code, action))
        os._exit(1)  # the GPU is not to be used again by this process

    def send(self, message: _wire.Message) -> None:
        with self._send_lock:
            if self._sock is None:
                raise OSError("no link")
            self._sock.sendall(_wire.encode(message))

    # -- the link
    def run(self) -> None:
        host, _, port = self.args.router.rpartition(":")
        unreachable_since: float | None = None
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=2.0)
            except OSError as exc:
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.args.reconnect_for:
                    _log(self.index, f"router unreachable for {self.args.reconnect_for}s "
                         f"({exc}): exiting")
                    return
                time.sleep(0.1)
                continue
            unreachable_since = None
            reason = self._session(sock)
            self._drop_all()
            _log(self.index, f"link closed ({reason}); reconnecting as a fresh worker")

    def _session(self, sock: socket.socket) -> str:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbox: queue.SimpleQueue[_wire.Message | None] = queue.SimpleQueue()
        lost = threading.Event()
        with self._send_lock:
            self._sock = sock
        reader = threading.Thread(target=self._read, args=(sock, inbox, lost), daemon=True,
                                  name="link-rx")
        beater = threading.Thread(target=self._beat, args=(lost,), daemon=True,
                                  name="heartbeat")
        try:
            self._cpu_at_hello = time.process_time()
            self.send(_wire.Hello(self.index, self.args.generation, os.getpid(),
                                  self.engine.model_id, self.args.block_size,
                                  self.model.max_seq))
            reader.start()
            beater.start()
            return self._loop(inbox, lost)
        except OSError as exc:
            return f"send failed: {exc}"
        finally:
            lost.set()
            with self._send_lock:
                self._sock = None
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if reader.is_alive():
                reader.join(timeout=2.0)
            sock.close()

    def _read(self, sock: socket.socket, inbox: queue.SimpleQueue[_wire.Message | None],
              lost: threading.Event) -> None:
        try:
            for message in _wire.read_messages(sock):
                if message is not None:
                    inbox.put(message)
        except (OSError, _wire.ProtocolError) as exc:
            _log(self.index, f"link error: {exc}")
        lost.set()
        inbox.put(None)

    def _beat(self, lost: threading.Event) -> None:
        while not lost.is_set():
            try:
                cpu_s, wait_s = schedstat(self._engine_tid)
                self.send(_wire.Heartbeat(self.steps, self.busy, len(self.epochs),
                                          self.stats, cpu_s, wait_s))
            except OSError:
                lost.set()
                return
            lost.wait(self.args.heartbeat)

    # -- the engine loop
    def _loop(self, inbox: queue.SimpleQueue[_wire.Message | None],
              lost: threading.Event) -> str:
        engine = self.engine
        while True:
            idle = not self.epochs
            while True:
                try:
                    # Idle: wait for work (briefly, to notice a lost link). Busy: only
                    # take what is already there, the next step is waiting.
                    message = inbox.get(timeout=0.05) if idle else inbox.get_nowait()
                except queue.Empty:
                    break
                idle = False
                if message is None:
                    return "link lost"
                if isinstance(message, _wire.Reset):
                    return f"reset by the router: {message.reason}"
                self._apply(message)
            if lost.is_set():
                return "link lost"
            self.busy = bool(self.epochs)
            if not self.epochs:
                continue
            probe.fault_point("decode", self.steps + 1)
            outputs = engine.step()
            if self.args.step_sleep:
                time.sleep(self.args.step_sleep)  # a slower engine step, for short test runs
            self.steps += 1
            items = []
            for out in outputs:
                epoch = self.epochs.get(out.request_id)
                if epoch is None:
                    continue
                items.append((out.request_id, epoch, out.index, out.token, out.digest,
                              out.finished))
                if out.finished:
                    del self.epochs[out.request_id]
            stats = engine.stats()
            self.stats = {name: getattr(stats, name, 0) for name in _wire.ENGINE_COUNTERS}
            self.stats["cpu_ms"] = round((time.process_time() - self._cpu_at_hello) * 1e3)
            self.busy = bool(self.epochs)
            if items:
                self.send(_wire.Outputs(tuple(items)))

    def _apply(self, message: _wire.Message) -> None:
        if isinstance(message, _wire.Add):
            if message.request_id in self.epochs:
                self.engine.abort(message.request_id)
                del self.epochs[message.request_id]
            try:
                self.engine.add(message.request_id, message.prompt, message.max_tokens,
                                emitted=message.emitted)
            except ValueError as exc:
                self.send(_wire.Rejected(message.request_id, message.epoch, str(exc)))
                return
            self.epochs[message.request_id] = message.epoch
        elif (isinstance(message, _wire.Abort)
              and self.epochs.pop(message.request_id, None) is not None):
            self.engine.abort(message.request_id)

    def _drop_all(self) -> None:
        for request_id in list(self.epochs):
            with contextlib.suppress(KeyError, ValueError):
                self.engine.abort(request_id)
        self.epochs.clear()
        self.busy = False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m aftershock.reference_impl.serving.worker",
        description="One engine worker of the reference server (started by its router "
        "process).")
    parser.add_argument("--router", required=True, help="HOST:PORT of the router's link socket")
    parser.add_argument("--worker", type=int, required=True, help="worker index")
    parser.add_argument("--workers", type=int, required=True, help="how many workers in all")
    parser.add_argument("--generation", type=int, default=0, help="respawn count of this index")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="the router process's pid: exit if it is gone already")
    parser.add_argument("--seed", type=int, default=0, help="model seed")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size, tokens")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool")
    parser.add_argument("--max-batch", type=int, default=16, help="requests per engine step")
    parser.add_argument("--verify", default=None, choices=("off", "hit", "read"),
                        help="when the engine verifies KV block checksums (default: the "
                        "engine's)")
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="allow batch-dependent kernels (outputs may differ by batch)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: worker I uses GPU I modulo the GPU count")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--heartbeat", type=float, default=0.1, help="seconds between beats")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds added to every engine step")
    parser.add_argument("--reconnect-for", type=float, default=3.0,
                        help="exit when the router stays unreachable this long")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    die_with_parent(args.parent_pid)
    probe.set_rank(args.worker)
    probe.hello(world=args.workers, generation=args.generation, role="worker")
    worker = Worker(args)
    engine = worker.engine
    probe.install(model=engine.model, tensors={
        "kv:shared_prefix": engine.shared_prefix_block,
        "kv:idle_prefix": engine.idle_prefix_block,
        "kv:cache": lambda: engine.kv,
    })
    # This worker's GPU is the one its LOCAL_RANK names (set to the index by its spawner).
    health.XidWatcher(gpu=int(os.environ.get("LOCAL_RANK", args.worker)),
                      on_xid=worker.on_xid).start()
    worker.run()
    probe.emit("exit", code=0)


if __name__ == "__main__":
    main()
