"""Warm launchers (harness/run/warm.py): a launcher forked from a server that has imported
what it needs must be set up and end as a fresh one: its environment and command line in
/proc, its own session and working directory, its streams, its exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from aftershock.harness.run import warm


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@pytest.fixture
def job(tmp_path: Path) -> dict[str, str]:
    """A module a warm server can run: it prints, then waits or exits as told."""
    (tmp_path / "warm_child.py").write_text(
        "import os, sys, time\n"
        "print('child', os.getpid(), os.environ.get('AFTERSHOCK_RUN_ID'), sys.argv[1:],"
        " flush=True)\n"
        "print('on stderr', file=sys.stderr, flush=True)\n"
        "if sys.argv[1] == 'wait':\n"
        "    time.sleep(60)\n"
        "sys.exit(int(sys.argv[1]))\n")
    return {k: v for k, v in os.environ.items() if k not in warm.PER_RUN}


def _started(env: dict[str, str], tmp_path: Path, *args: str, run_id: str = "r1"
             ) -> warm.WarmProcess:
    argv = [sys.executable, "-u", "-m", "warm_child", *args]
    proc = warm.start(("json",), argv, env={**env, "AFTERSHOCK_RUN_ID": run_id},
                      cwd=tmp_path, cgroup=None)
    assert proc is not None
    return proc


def test_a_warm_launcher_is_set_up_as_a_fresh_one_and_its_exit_code_reported(
        job: dict[str, str], tmp_path: Path) -> None:
    proc = _started(job, tmp_path, "3")
    assert proc.wait(timeout=30) == 3
    assert proc.stdout is not None
    assert proc.stderr is not None
    out = proc.stdout.read().decode()
    assert out.startswith(f"child {proc.pid} r1 ['3']"), out
    assert proc.stderr.read().decode() == "on stderr\n"
    proc.stdout.close()
    proc.stderr.close()

    waiting = _started(job, tmp_path, "wait", run_id="r2")
    try:
        deadline = time.monotonic() + 10
        while "r2" not in _environ(waiting.pid).get("AFTERSHOCK_RUN_ID", ""):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _cmdline(waiting.pid) == [sys.executable, "-u", "-m", "warm_child", "wait"]
        assert os.getsid(waiting.pid) == waiting.pid  # its own session, as Popen gives it
        assert Path(f"/proc/{waiting.pid}/cwd").resolve() == tmp_path.resolve()
        assert waiting.poll() is None
        os.kill(waiting.pid, signal.SIGKILL)
        assert waiting.wait(timeout=30) == -signal.SIGKILL
    finally:
        with pytest.raises(ProcessLookupError):
            os.kill(waiting.pid, 0)
        for stream in (waiting.stdout, waiting.stderr):
            assert stream is not None
            stream.close()


def test_a_run_whose_start_up_may_differ_gets_its_own_server(
        job: dict[str, str], tmp_path: Path) -> None:
    """Any variable but the harness's per-run ones keys the server: it could change what the
    interpreter imported before the fork. A PYTHONPATH of the run's own (a sitecustomize
    that runs at start-up, with the run's variables) gets a fresh process."""
    first = _started(job, tmp_path, "0")
    first.wait(timeout=30)
    servers = dict(warm._servers)
    second = _started(job, tmp_path, "0", run_id="another")  # per-run only: the same server
    second.wait(timeout=30)
    assert dict(warm._servers) == servers
    changed = {**job, "SOME_SETTING": "1"}
    third = _started(changed, tmp_path, "0")
    third.wait(timeout=30)
    ran = {**changed, "AFTERSHOCK_RUN_ID": "r1"}
    assert warm._key(("json",), ran, tmp_path) in warm._servers
    assert warm._key(("json",), ran, tmp_path) not in servers
    assert _environ(os.getpid()).get("SOME_SETTING") is None
    own_path = {**job, "PYTHONPATH": str(tmp_path / "elsewhere")}
    assert warm.start(("json",), [sys.executable, "-u", "-m", "warm_child", "0"],
                      env=own_path, cwd=tmp_path, cgroup=None) is None
    for proc in (first, second, third):
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            stream.close()


def test_a_launcher_whose_server_died_never_counts_as_a_success(
        job: dict[str, str], tmp_path: Path) -> None:
    proc = _started(job, tmp_path, "wait", run_id="orphan")
    try:
        server = next(s for s in warm._servers.values() if proc.pid in s.live)
        server.proc.kill()
        server.proc.wait()
        time.sleep(0.5)
        assert proc.poll() is None  # still running: its server's death is not its end
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGKILL  # its end is unknown: not an exit 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            stream.close()




def test_a_server_that_cannot_preload_is_not_started_again_for_every_run(
        job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preload that fails (a module this environment lacks) means a fresh launcher for the
    run, and for every later run of that environment: not one more server that imports
    for seconds and fails again, each run."""
    spawned: list[tuple[str, ...]] = []
    spawn = warm._spawn

    def counted(preload: tuple[str, ...], env: dict[str, str], cwd: Path) -> object:
        spawned.append(tuple(preload))
        return spawn(preload, env, cwd)

    monkeypatch.setattr(warm, "_spawn", counted)
    argv = [sys.executable, "-u", "-m", "warm_child", "0"]
    missing = ("json", "no_such_module_anywhere")
    for run_id in ("r1", "r2", "r3"):
        assert warm.start(missing, argv, env={**job, "AFTERSHOCK_RUN_ID": run_id},
                          cwd=tmp_path, cgroup=None) is None
    assert spawned == [missing]
    # Another environment is another server, tried once in its turn.
    assert warm.start(missing, argv, env={**job, "SOME_SETTING": "2"}, cwd=tmp_path,
                      cgroup=None) is None
    assert spawned == [missing, missing]
