"""Warm launchers: a reference system's launcher forked from an interpreter that has already
imported what it needs, instead of a fresh ``python`` that imports torch again every run.

A search runs the same launcher dozens of times (``aftershock explore``: the reference
trainer's torchrun, ``aftershock.reference_impl.launch``), and a fresh interpreter spends
seconds of CPU importing torch before the job does anything. Where a :class:`Launch` names
modules to preload (``Launch.warm``), the harness keeps one server process per
environment that imported them once (``python -m aftershock.harness.run.warm``), and each
run's launcher is a fork of it, set up as ``subprocess.Popen`` would have set up a fresh
one: its own session, the run's cgroup, working directory, environment and standard
streams, and its /proc/PID/environ and cmdline showing the run's (the harness and its
faults read them as evidence: ``aftershock.reference_impl._forked.publish``).

A server is kept per environment, but for the variables the harness sets per run
(:data:`PER_RUN`): any other (a scenario's ``env:``) could change what the interpreter did
as it started. A run whose start-up code differs from the harness's (its own PYTHONPATH, as
a test's deliberately broken variant has: a sitecustomize that reads the run's variables)
gets a fresh process. ``AFTERSHOCK_WARM=0`` turns this off.

The server forks with no thread running, is told nothing it did not get from the harness
on its own socket pair, and exits when the harness's end closes (the harness exited or
died). The launchers it forked are the runs' processes: found, stopped and killed like a
fresh launcher's, by their run's cgroup and run id.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aftershock.faults import contract
from aftershock.harness import probe

ENV_OFF = "AFTERSHOCK_WARM"
#: Set by the harness for each run (harness/run/target.py, ``LocalTarget.env``): read by the
#: job when it runs, never while an interpreter starts, so they may differ from the server's.
PER_RUN = frozenset({probe.EVENTS_ENV, probe.OUTPUT_ENV, probe.RUN_ID_ENV, probe.COMMANDS_ENV,
                     contract.NVML_DIR_ENV, "TMPDIR"})
#: What decides which code an interpreter runs as it starts (a sitecustomize on the path,
#: which may read the run's variables): a run whose values differ from the harness's own
#: gets a fresh process.
START_UP = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONNOUSERSITE",
            "PYTHONSAFEPATH", "PYTHONPLATLIBDIR", "PYTHONEXECUTABLE")
MAX_SERVERS = 2  # per harness process: a search uses one; tests alternate a few
START_S = 120.0  # how long a server may take to import what it preloads
MESSAGE = 1 << 20


class WarmError(RuntimeError):
    """The server could not start the launcher (its cgroup, its working directory)."""


def usable(env: Mapping[str, str]) -> bool:
    """Whether a run with ``env`` may be forked from a server."""
    return (env.get(ENV_OFF, "1") != "0" and os.path.isdir("/proc/self/fd")
            and all(env.get(name) == os.environ.get(name) for name in START_UP))


def _key(preload: Sequence[str], env: Mapping[str, str], cwd: Path
         ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], str]:
    return (tuple(preload), tuple(sorted((k, v) for k, v in env.items() if k not in PER_RUN)),
            str(cwd))


class WarmProcess:
    """A launcher the server forked, as much of ``subprocess.Popen`` as the harness uses."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        # Tells when it ended should its server die first (then no one reports how).
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # ended and reaped already: the server reports it

    def _end(self, code: int) -> None:
        if self._ended.is_set():
            return
        self.returncode = code
        self._ended.set()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def _orphaned(self) -> None:
        """Its server died: wait for its end, which counts as killed, never as a success
        (its exit status went to the server)."""
        fd = self._pidfd
        if fd is not None:
            with contextlib.suppress(OSError, ValueError):
                select.select([fd], [], [])
        self._end(-signal.SIGKILL)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm launcher {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


@dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    lock: threading.Lock
    replies: queue.Queue[dict[str, Any]]
    live: dict[int, WarmProcess]
    ended: dict[int, int]  # exits that came before their launcher was registered
    dead: bool = False
    lock_live: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> None:
        """The server's messages: replies to a start, and launchers' exits."""
        buffer = b""
        while True:
            try:
                data = self.sock.recv(MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    pid, code = int(message["exit"]), int(message["code"])
                    with self.lock_live:
                        found = self.live.pop(pid, None)
                        if found is None:
                            self.ended[pid] = code
                    if found is not None:
                        found._end(code)
                else:
                    self.replies.put(message)
        # The server is gone: a launcher it forked has no one to report its end. Its exit
        # status is lost; once it ends, it counts as killed, never as a success.
        self.dead = True
        self.replies.put({"error": "the warm launcher server exited"})
        with self.lock_live:
            orphans = list(self.live.values())
            self.live.clear()
        for orphan in orphans:
            threading.Thread(target=orphan._orphaned, name=f"warm-orphan-{orphan.pid}",
                             daemon=True).start()


_servers: dict[tuple[Any, ...], _Server] = {}
_servers_lock = threading.Lock()
#: Environments whose server could not start (a preload failed, or timed out): their runs
#: start fresh, without a server importing for seconds and failing again every run.
_failed: set[tuple[Any, ...]] = set()


def start(preload: Sequence[str], argv: Sequence[str], *, env: Mapping[str, str], cwd: Path,
          cgroup: Path | None) -> WarmProcess | None:
    """The launcher ``argv`` (``[python, -u, -m, module, ...]``) forked from a warm server,
    or None where this run cannot have one (then the caller starts it fresh). Raises
    WarmError when the server could not set the fork up as asked."""
    if not usable(env) or len(argv) < 4 or argv[1:3] != ["-u", "-m"]:
        return None
    server = _server(preload, env, cwd)
    if server is None:
        return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd),
                   "cgroup": None if cgroup is None else str(cgroup)}
        with server.lock:
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                socket.send_fds(server.sock, [json.dumps(request).encode() + b"\n"],
                                [null, out_w, err_w])
            except OSError:
                return None
            finally:
                os.close(null)
            try:
                reply = server.replies.get(timeout=30.0)
            except queue.Empty:
                reply = {"error": "the warm launcher server did not answer in 30 s"}
    finally:
        os.close(out_w)
        os.close(err_w)
    if "pid" not in reply:
        os.close(out_r)
        os.close(err_r)
        if server.dead:
            return None
        raise WarmError(str(reply.get("error")))
    proc = WarmProcess(int(reply["pid"]), os.fdopen(out_r, "rb", buffering=0),
                       os.fdopen(err_r, "rb", buffering=0))
    with server.lock_live:
        code = server.ended.pop(proc.pid, None)
        if code is None:
            server.live[proc.pid] = proc
    if code is not None:
        proc._end(code)
    return proc


def _server(preload: Sequence[str], env: Mapping[str, str], cwd: Path) -> _Server | None:
    key = _key(preload, env, cwd)
    with _servers_lock:
        if key in _failed:
            return None
        found = _servers.get(key)
        if found is not None and not found.dead and found.proc.poll() is None:
            return found
        if found is not None:
            _stop(_servers.pop(key))
        # The oldest idle servers make room; one with a launcher still running stays.
        idle = [k for k, s in _servers.items() if not s.live]
        while len(_servers) >= MAX_SERVERS and idle:
            _stop(_servers.pop(idle.pop(0)))
        server = _spawn(preload, {k: v for k, v in env.items() if k not in PER_RUN}, cwd)
        if server is not None:
            _servers[key] = server
        else:
            _failed.add(key)
        return server


def _spawn(preload: Sequence[str], env: dict[str, str], cwd: Path) -> _Server | None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__, str(theirs.fileno()), *preload],
            cwd=cwd, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        ours.close()
        return None
    finally:
        theirs.close()
    server = _Server(proc, ours, threading.Lock(), queue.Queue(), {}, {})
    threading.Thread(target=server.read, name="warm-launchers", daemon=True).start()
    try:
        ready = server.replies.get(timeout=START_S)
    except queue.Empty:
        ready = {}
    if not ready.get("ready"):
        _stop(server)
        return None
    return server


def _stop(server: _Server) -> None:
    with contextlib.suppress(OSError):
        server.sock.shutdown(socket.SHUT_RDWR)
    server.sock.close()
    try:
        server.proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@atexit.register
def stop_all() -> None:
    with _servers_lock:
        while _servers:
            _stop(_servers.pop(next(iter(_servers))))


# ------------------------------------------------------------------------- the server


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _child(request: dict[str, Any], fds: Sequence[int], ready: int,
           keep: Sequence[int]) -> None:
    """In the fork: become the launcher the request describes, then run it. Never returns."""
    from aftershock.reference_impl import _forked

    code = 1
    try:
        os.setsid()
        if request["cgroup"]:
            with open(os.path.join(request["cgroup"], "cgroup.procs"), "wb",
                      buffering=0) as procs:
                procs.write(b"0\n")
        os.chdir(request["cwd"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # The server's socket and selector: objects of the server's frames, which may close
        # their descriptors one day; /dev/null in their place, so that closes nothing of ours.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in keep:
            os.dup2(null, fd, inheritable=False)
        os.close(null)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        import tempfile

        tempfile.tempdir = None  # computed again from the run's TMPDIR
        argv = request["argv"]
        _forked.publish(argv, env)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.write(ready, b"ok")
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.write(ready, f"{exc}".encode()[:4000] or b"failed")
        os._exit(127)
    os.close(ready)
    import runpy
    import traceback

    module = argv[3]
    sys.argv = [module, *argv[4:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:  # as an interpreter does: print it, exit 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int],
          pidfds: dict[int, int], keep: Sequence[int]) -> None:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _child(request, fds, ready_w, [sock.fileno(), *keep, *pidfds.values()])
    os.close(ready_w)
    for fd in fds:
        os.close(fd)
    with os.fdopen(ready_r, "rb") as said:
        answer = said.read()
    if answer == b"ok":
        pidfds[pid] = os.pidfd_open(pid)
        _send(sock, {"pid": pid})
        return
    os.waitpid(pid, 0)
    _send(sock, {"error": answer.decode(errors="replace") or "the fork died setting up"})


def serve(fd: int, preload: Sequence[str]) -> None:
    """The server: import ``preload``, then fork a launcher per request on socket ``fd``
    and report each one's exit, until the harness's end of the socket closes."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's Ctrl-C is for the harness
    try:
        import importlib

        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:  # said to the harness, which starts fresh
        _send(sock, {"error": f"cannot preload: {exc}"})
        return
    if threading.active_count() > 1:
        _send(sock, {"error": "a preloaded module started a thread: forking is not safe"})
        return
    _send(sock, {"ready": True})
    pidfds: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    buffer = b""
    pending: list[int] = []
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 8)
                except OSError:
                    data, fds = b"", []
                if not data:
                    return
                pending += fds
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    given, pending = pending[:3], pending[3:]
                    _fork(sock, json.loads(line), given, pidfds, [selector.fileno()])
                    for pid, pidfd in pidfds.items():
                        if pidfd not in selector.get_map():
                            selector.register(pidfd, selectors.EVENT_READ, pid)
            else:
                pid = key.data
                selector.unregister(key.fileobj)
                os.close(pidfds.pop(pid))
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
