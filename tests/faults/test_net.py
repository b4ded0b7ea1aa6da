"""net.reset and net.partition on real TCP connections between real processes over loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.faults import _cgroup, _nft
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, pending
from aftershock.faults.net import PARTITION, RESET

ROOT = Path(__file__).resolve().parents[2]


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN) to destroy sockets and load nftables rules")


def _need_nft() -> None:
    _need_root()
    if not any(p and os.access(p, os.X_OK) for p in (shutil.which("nft"), "/usr/sbin/nft")):
        pytest.skip("nft not installed: apt-get install nftables")
    v2 = _cgroup.v2_mount()
    if v2 is None or not v2.is_relative_to("/sys/fs/cgroup"):
        pytest.skip("no cgroup2 mount under /sys/fs/cgroup (net.partition new_connections)")


def _spawn(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child {proc.pid} exited (rc={proc.poll()}) without answering"
    return line.strip()


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        proc.kill()
        with proc:  # closes its pipes and reaps it
            pass


ECHO_SERVER = """
    import socket, threading
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    print(srv.getsockname()[1], flush=True)
    def serve(conn):
        while data := conn.recv(4096):
            conn.sendall(data)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

CLIENT = """
    import errno, socket, sys
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    sock.sendall(b"ping"); assert sock.recv(4) == b"ping"
    print("READY", flush=True)
    sock.settimeout(20)
    try:
        data = sock.recv(4)
        print("EOF" if not data else "DATA", flush=True)
    except OSError as exc:
        print(errno.errorcode.get(exc.errno, str(exc)), flush=True)
"""


@pytest.mark.timeout(60)
def test_reset_breaks_the_connection_of_the_target(tmp_path: Path) -> None:
    _need_root()
    server = _spawn(ECHO_SERVER)
    client: subprocess.Popen[str] | None = None
    try:
        port = int(_line(server))
        client = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CLIENT), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert _line(client) == "READY"
        ref = ProcessRef.of(client.pid)
        assert ref is not None
        journal = Journal.create("reset", tmp_path)
        applied = RESET.inject(ref, {}, journal)
        assert applied.journal_id is None
        assert "reset 1 of 1" in applied.detail
        assert _line(client) in ("ECONNABORTED", "ECONNRESET", "EOF")
        assert pending(journal.path) == []
    finally:
        _stop(server, *([client] if client else []))


NODE = """
    import json, socket, struct, sys, threading, time
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    ok = {}
    def serve(conn):
        try:
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass
    def accept():
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    def ping(port):
        # One 8-byte sequence number at a time; a late echo of an old one is skipped.
        sock = socket.create_connection(("127.0.0.1", port)); sock.settimeout(0.1)
        ok[port], seq, buf = 0, 0, b""
        while True:
            seq += 1; sock.sendall(struct.pack("!Q", seq)); deadline = time.time() + 0.5
            while time.time() < deadline:
                try:
                    buf += sock.recv(64)
                except TimeoutError:
                    continue
                got = []
                while len(buf) >= 8:
                    got.append(struct.unpack("!Q", buf[:8])[0]); buf = buf[8:]
                if seq in got:
                    ok[port] += 1; break
            time.sleep(0.02)
    threading.Thread(target=accept, daemon=True).start()
    print(srv.getsockname()[1], flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "peers":
            for port in map(int, arg.split(",")):
                threading.Thread(target=ping, args=(port,), daemon=True).start()
            while len(ok) < len(arg.split(",")):
                time.sleep(0.01)
            print("{}", flush=True)
        elif cmd == "status":
            print(json.dumps(ok), flush=True)
        elif cmd == "dial":
            try:
                socket.create_connection(("127.0.0.1", int(arg)), timeout=1).close()
                print(json.dumps("ok"), flush=True)
            except OSError as exc:
                print(json.dumps(type(exc).__name__), flush=True)
"""


def _ask(proc: subprocess.Popen[str], command: str) -> object:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(_line(proc))


def _progress(nodes: list[subprocess.Popen[str]], seconds: float) -> dict[tuple[int, int], int]:
    """Round trips each node completed with each peer port during ``seconds``."""
    before = [_ask(n, "status") for n in nodes]
    time.sleep(seconds)
    after = [_ask(n, "status") for n in nodes]
    deltas: dict[tuple[int, int], int] = {}
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert isinstance(a, dict)
        assert isinstance(b, dict)
        for port in a:
            deltas[(i, int(port))] = a[port] - b[port]
    return deltas


@pytest.fixture(params=["own group", "in a run's group"])
def three_nodes(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[list[subprocess.Popen[str]], list[int]]]:
    """Three nodes pinging each other; the third, the one to partition, either where the
    test runs or (as under the harness) inside a run's own cgroup."""
    nodes = [_spawn(NODE) for _ in range(3)]
    run_group: Path | None = None
    try:
        if request.param == "in a run's group" and os.geteuid() == 0:
            run_group, why = _cgroup.run_group_dir(f"testnet{os.getpid()}")
            if run_group is None:
                pytest.skip(f"no cgroup for a run here: {why}")
            run_group.mkdir()
            _cgroup.move(nodes[2].pid, run_group)
        ports = [int(_line(n)) for n in nodes]
        for i, node in enumerate(nodes):
            _ask(node, "peers " + ",".join(str(p) for j, p in enumerate(ports) if j != i))
        yield nodes, ports
    finally:
        _stop(*nodes)
        if run_group is not None:
            _cgroup.kill_tree(run_group, 5)
            _cgroup.remove_tree(run_group)


@pytest.mark.timeout(60)
def test_partition_cuts_one_process_off_and_heals(
    tmp_path: Path, three_nodes: tuple[list[subprocess.Popen[str]], list[int]]
) -> None:
    _need_nft()
    nodes, ports = three_nodes
    a, _, c = nodes
    assert all(v > 0 for v in _progress(nodes, 0.5).values())
    ref = ProcessRef.of(c.pid)
    assert ref is not None
    home = _cgroup.group_of(c.pid, None)
    journal = Journal.create("partition", tmp_path)
    applied = PARTITION.inject(ref, {}, journal)
    table = applied.undo["table"]
    try:
        assert table in _nft.tables()
        time.sleep(0.6)  # let round trips in flight time out
        during = _progress(nodes, 1.0)
        assert during[(0, ports[1])] > 0, during  # a -> b still fine
        assert during[(1, ports[0])] > 0, during  # b -> a still fine
        cut = {k: v for k, v in during.items() if ports[2] == k[1] or k[0] == 2}
        assert all(v == 0 for v in cut.values()), during
        assert Path(applied.undo["cgroup"]).parent == Path(applied.undo["home"])
        # New connections both ways are cut too: the listener by its mark, c's new socket by
        # its cgroup.
        assert _ask(a, f"dial {ports[2]}") == "TimeoutError"
        assert _ask(c, f"dial {ports[0]}") == "TimeoutError"
        assert _ask(a, f"dial {ports[1]}") == "ok"
    finally:
        PARTITION.revert(applied.undo)
        assert applied.journal_id is not None
        journal.done(applied.journal_id)
    PARTITION.revert(applied.undo)  # idempotent
    assert table not in _nft.tables()
    assert not Path(applied.undo["cgroup"]).exists()
    assert _cgroup.group_of(c.pid, None) == home
    assert _ask(a, f"dial {ports[2]}") == "ok"
    # Established connections resume on TCP's next retransmission (exponential backoff).
    deadline = time.monotonic() + 20
    while True:
        after = _progress(nodes, 0.5)
        if all(v > 0 for v in after.values()):
            break
        assert time.monotonic() < deadline, f"traffic did not resume: {after}"


LISTENER = """
    import socket, sys, time
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
    print(srv.getsockname()[1], flush=True)
    sys.stdin.readline()  # "close"
    srv.close()
    print("closed", flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_partition_frees_a_port_as_soon_as_the_target_releases_it(tmp_path: Path) -> None:
    """The rules match the target's sockets, not port numbers: once it closed its listener,
    an unrelated server on that port and its clients are not cut off."""
    _need_nft()
    target = _spawn(LISTENER)
    try:
        port = int(_line(target))
        ref = ProcessRef.of(target.pid)
        assert ref is not None
        journal = Journal.create("partition-port", tmp_path)
        applied = PARTITION.inject(ref, {}, journal)
        try:
            with pytest.raises(TimeoutError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            assert target.stdin is not None
            target.stdin.write("close\n")
            target.stdin.flush()
            assert _line(target) == "closed"
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", port))
                other.listen()
                with socket.create_connection(("127.0.0.1", port), timeout=2) as client:
                    served, _ = other.accept()
                    with served:
                        client.sendall(b"ping")
                        served.settimeout(2)
                        assert served.recv(4) == b"ping"
        finally:
            PARTITION.revert(applied.undo)
    finally:
        _stop(target)
