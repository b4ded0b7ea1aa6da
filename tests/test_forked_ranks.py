"""Ranks forked by torchrun from the warm launcher (reference_impl/launch.py,
reference_impl/_forked.py) must look like fresh processes to everything the harness reads
as evidence: /proc environ and cmdline, the process tree, the sockets they hold."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from _helpers import ROOT

from aftershock.reference_impl import _forked, launch


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_a_fork_shows_the_environment_and_command_line_it_published() -> None:
    said, told = os.pipe()  # child -> parent: published
    wait, done = os.pipe()  # parent -> child: read, you may go
    pid = os.fork()
    if pid == 0:
        try:
            _forked.publish(["python", "-m", "some.rank", "--flag=1"], {"RANK": "3", "A": "b=c"})
            os.write(told, b"ok")
            os.read(wait, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(said, 2) == b"ok"
        assert _cmdline(pid) == ["python", "-m", "some.rank", "--flag=1"]
        assert _environ(pid) == {"RANK": "3", "A": "b=c"}
    finally:
        os.write(done, b"x")
        os.waitpid(pid, 0)
        for fd in (said, told, wait, done):
            os.close(fd)
    assert _forked.supported()


def test_the_launcher_forks_only_the_trainer_and_only_where_it_may() -> None:
    torchrun = ["--standalone", "--nproc-per-node=2"]
    trainer = [*torchrun, "-m", "aftershock.reference_impl.trainer", "--steps=5"]
    forked = launch.torchrun_argv(trainer, fork=True)
    assert forked[:2] == torchrun
    assert forked[2:4] == ["--run-path", "--start-method=fork"]
    assert forked[4].endswith("reference_impl/_rank.py")
    assert forked[5:] == ["--steps=5"]
    assert launch.torchrun_argv(trainer, fork=False) == trainer
    other = [*torchrun, "-m", "my.own.job"]
    assert launch.torchrun_argv(other, fork=True) == other


def _sockets(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def test_a_rank_torchrun_forked_shows_its_rank_and_holds_none_of_the_launchers_sockets(
        tmp_path: Path) -> None:
    """Before, a forked rank held the launcher's rendezvous store: `net.reset` on the rank
    reset the launcher's store too, and torchrun could not restart the world."""
    argv = [sys.executable, "-u", "-m", "aftershock.reference_impl.launch", "--standalone",
            "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1",
            "-m", "aftershock.reference_impl.trainer", "--replicas=2", "--shards=1",
            "--steps=2000", "--checkpoint-every=0", f"--checkpoint-dir={tmp_path / 'ck'}",
            "--step-sleep=0.02"]
    env = {**os.environ, "AFTERSHOCK_RUN_ID": "forked-test", "TMPDIR": str(tmp_path)}
    env.pop("AFTERSHOCK_FORK_RANKS", None)
    agent = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2:
            assert time.monotonic() < deadline
            assert agent.poll() is None
            time.sleep(0.2)
            children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
            ranks = [int(p) for p in children
                     if "LOCAL_RANK" in _environ(int(p)) and _sockets(int(p))]
        for pid in ranks:
            shown = _environ(pid)
            assert shown["AFTERSHOCK_RUN_ID"] == "forked-test"
            assert {shown["RANK"], shown["LOCAL_RANK"]} <= {"0", "1"}
            assert _cmdline(pid)[1:4] == ["-u", "-m", "aftershock.reference_impl.trainer"]
            assert not _sockets(pid) & _sockets(agent.pid)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if _environ_or_empty(pid).get("AFTERSHOCK_RUN_ID") == "forked-test":
                os.kill(pid, signal.SIGKILL)


def _environ_or_empty(pid: int) -> dict[str, str]:
    try:
        return _environ(pid)
    except OSError:
        return {}


def test_the_sockets_check_sees_a_shared_socket() -> None:
    """The check above can fail: a fork that keeps its parent's socket shares it."""
    left, right = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        assert _sockets(pid) & _sockets(os.getpid())
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        left.close()
        right.close()
