"""Teardown is bounded and complete: a daemon that keeps the job's output pipe, or that
dropped the run id from its environment, neither hangs the harness nor outlives the run.

The daemons are real (``env -i setsid sleep N &``: no run id, its own session, the job's
stdout and stderr inherited); each test names its own with a unique sleep length, so it
can find exactly its own processes and end them if the harness did not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import cli, read_events

from aftershock.faults import _cgroup
from aftershock.faults._proc import all_pids
from aftershock.harness.run import target as target_module
from aftershock.harness.run.runner import NullObserver, execute
from aftershock.harness.scenario.load import load_scenario

pytestmark = pytest.mark.timeout(120)


def _need_run_cgroup() -> None:
    where, why = _cgroup.run_group_dir("probe")
    if where is None:
        pytest.skip(f"no writable cgroup v2 group for a run here ({why})")


def daemons(marker: str) -> list[int]:
    """Pids of the live `sleep MARKER` processes."""
    found = []
    for pid in all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if argv[:2] == [b"sleep", marker.encode()] and ") Z" not in status:
            found.append(pid)
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A sleep length no other process uses; whatever still sleeps it is ended after."""
    value = f"{1000 + uuid.uuid4().int % 1000}.{os.getpid()}"
    yield value
    for pid in daemons(value):
        os.kill(pid, signal.SIGKILL)


def scenario(tmp_path: Path, script: str, *, timeout: str = "30s") -> Path:
    path = tmp_path / "daemon.yaml"
    path.write_text(f"""\
name: daemon
system:
  command: [sh, -c, '{script}']
  timeout: {timeout}
  probes:
    - {{pattern: 'step (?P<step>\\d+)', event: step}}
expect:
  completes: true
""")
    return path


@pytest.mark.slow
def test_a_daemon_holding_stdout_neither_hangs_the_run_nor_survives_it(
    tmp_path: Path, marker: str
) -> None:
    """The reported hang: the job exits 0 and leaves a daemon that holds its stdout."""
    _need_run_cgroup()
    path = scenario(tmp_path, f'env -i setsid sleep {marker} & echo "step 1"; exit 0')
    began = time.monotonic()
    done = cli("run", str(path), "--run-dir", str(tmp_path / "runs"), "--plain",
               "--json", str(tmp_path / "out.json"), timeout=60)
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < 30, f"teardown took {took:.1f}s"
    record = json.loads((tmp_path / "runs" / "daemon" / "result.json").read_text())
    assert record["passed"] is True
    assert json.loads((tmp_path / "out.json").read_text())[0]["passed"] is True
    # The daemon dropped AFTERSHOCK_RUN_ID and left the session: only the run's cgroup
    # still knew it, and it was ended with the run.
    assert daemons(marker) == []
    (launch,) = read_events(tmp_path / "runs" / "daemon" / "events.jsonl", "launch")
    assert launch["tracking"] == "cgroup"
    assert not Path(launch["cgroup"]).exists()
    (teardown,) = read_events(tmp_path / "runs" / "daemon" / "events.jsonl", "teardown")
    assert teardown["survivors"] == []
    assert teardown["logs_open"] == []
    assert teardown["cgroup_removed"] is True


def _execute_in_thread(path: Path, run_dir: Path, limit: float) -> tuple[object, float]:
    """execute() the scenario, failing the test (not hanging it) if it takes over ``limit``."""
    loaded = load_scenario(path)
    outcome: list[object] = []

    def work() -> None:
        try:
            outcome.append(execute(loaded.spec, scenario_dir=path.parent, run_dir=run_dir,
                                   seed=0, observer=NullObserver()))
        except BaseException as exc:  # reported below, in the test's thread
            outcome.append(exc)

    began = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(limit)
    took = time.monotonic() - began
    assert not thread.is_alive(), f"teardown still waiting after {took:.0f}s"
    assert not isinstance(outcome[0], BaseException), outcome[0]
    return outcome[0], took


@pytest.mark.slow
def test_without_a_cgroup_teardown_is_bounded_and_says_what_it_could_not_end(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no cgroup can be made, the env -i daemon is out of the harness's reach: the
    run must still end in bounded time and its timeline say why and what was left."""
    monkeypatch.setattr(target_module._cgroup, "run_group_dir",
                        lambda run_id: (None, "no cgroup2 mount"))
    # The job exits only once the daemon has its own session: until its setsid() it is in
    # the launcher's process group, which the teardown's SIGTERM reaches (a slow exec of
    # env and setsid once lost that race, and the daemon died with the job).
    detached = ('d=$!; until [ "$(cut -d" " -f6 /proc/$d/stat)" = "$d" ]; '
                'do sleep 0.01; done')
    path = scenario(tmp_path, f'env -i setsid sleep {marker} & {detached}; echo "step 1"; '
                    "exit 0")
    _execute_in_thread(path, tmp_path / "run", limit=30)
    events = read_events(tmp_path / "run" / "events.jsonl")
    (launch,) = [e for e in events if e["event"] == "launch"]
    assert launch["tracking"] == "env"
    assert launch["tracking_note"] == "no cgroup2 mount"
    (teardown,) = [e for e in events if e["event"] == "teardown"]
    assert sorted(teardown["logs_open"]) == ["stderr", "stdout"]
    assert [e["event"] for e in events if e["event"] == "step"] == ["step"]
    assert len(daemons(marker)) == 1  # out of reach, and the record says so


@pytest.mark.slow
def test_a_timeout_reports_the_limit_not_the_teardown(tmp_path: Path) -> None:
    """A job that ignores SIGTERM costs the 3 s grace period at teardown; that is not
    part of how long it ran."""
    path = scenario(tmp_path, "trap \"\" TERM; echo step 1; while :; do sleep 0.1; done",
                    timeout="1s")
    execution, took = _execute_in_thread(path, tmp_path / "run", limit=30)
    outcome = execution.outcome  # type: ignore[attr-defined]
    assert outcome.timed_out
    assert took > 3.5  # the grace period did pass
    assert 1.0 <= outcome.duration_s < 1.5


@pytest.mark.slow
def test_reaper_and_heal_end_a_run_group_a_killed_harness_left(
    tmp_path: Path, marker: str
) -> None:
    """The harness is SIGKILLed with an env -i daemon in its run: first its reaper is
    killed too, so only `aftershock heal` is left to end the daemon through the journal's
    record of the run's cgroup."""
    _need_run_cgroup()
    state = tmp_path / "state"
    env = {**os.environ, "AFTERSHOCK_STATE_DIR": str(state)}
    # The job's own sleep carries the marker too: the fixture ends it if the test fails.
    path = scenario(tmp_path, f"env -i setsid sleep {marker} & echo step 1; sleep {marker}",
                    timeout="90s")
    harness = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "run", str(path), "--run-dir", str(tmp_path / "r"),
         "--plain"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 30
        while not daemons(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemons(marker), "the daemon never started"
        for pid in all_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"aftershock.faults.heal" in cmdline and str(harness.pid).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
    finally:
        harness.kill()
        harness.wait()
    (journal,) = (state / "journal").glob("*.jsonl")
    (record,) = [json.loads(line) for line in journal.read_text().splitlines()
                 if '"launch"' in line]
    group = Path(record["undo"]["cgroup"])
    assert group.name == f"{_cgroup.RUN_PREFIX}{record['undo']['value']}"
    assert group.exists()
    assert daemons(marker)
    healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert healed.returncode == 0, healed.stderr
    assert "launch" in healed.stdout
    assert "undone" in healed.stdout
    assert daemons(marker) == []
    assert not group.exists()
    assert not list((state / "journal").glob("*.jsonl"))


@pytest.mark.slow
def test_reaper_ends_the_run_group_of_a_killed_harness(tmp_path: Path, marker: str) -> None:
    _need_run_cgroup()
    state = tmp_path / "state"
    # The job's own sleep carries the marker too: the fixture ends it if the test fails.
    path = scenario(tmp_path, f"env -i setsid sleep {marker} & echo step 1; sleep {marker}",
                    timeout="90s")
    harness = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "run", str(path), "--run-dir", str(tmp_path / "r"),
         "--plain"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "AFTERSHOCK_STATE_DIR": str(state)})
    try:
        deadline = time.monotonic() + 30
        while not daemons(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemons(marker), "the daemon never started"
    finally:
        harness.kill()
        harness.wait()
    deadline = time.monotonic() + 20
    while (daemons(marker) or list((state / "journal").glob("*.jsonl"))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemons(marker) == []
    assert not list((state / "journal").glob("*.jsonl"))


# ------------------------------------------------------------------ the run's cgroup itself


@pytest.fixture
def group() -> Iterator[Path]:
    _need_run_cgroup()
    run_id = f"test{uuid.uuid4().hex[:8]}"
    where, _ = _cgroup.run_group_dir(run_id)
    assert where is not None
    where.mkdir()
    try:
        yield where
    finally:
        _cgroup.kill_tree(where, 5)
        _cgroup.remove_tree(where)


FORKER = """
import os, time
while True:  # a new child every 10 ms: ending it needs the group frozen, or cgroup.kill
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
    time.sleep(0.01)
"""


@pytest.mark.parametrize("kill_file", [True, False], ids=["cgroup.kill", "freeze-and-kill"])
def test_kill_tree_ends_a_forking_group_with_nested_groups(
    group: Path, kill_file: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kill_file:
        monkeypatch.setattr(_cgroup, "has_kill_file", lambda path: False)
    nested = group / "aftershock_nested"  # as net.partition makes one inside the target's
    nested.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", FORKER],
                         preexec_fn=target_module._entering(where))
        for where in (group, nested)
    ]
    try:
        time.sleep(0.5)
        assert len(_cgroup.subtree_members(group)) > 4
        assert _cgroup.kill_tree(group, 5)
        assert _cgroup.subtree_members(group) == []
        assert not (group / "cgroup.freeze").exists() or \
            (group / "cgroup.freeze").read_text().strip() == "0"
        for proc in procs:
            assert proc.wait(5) == -signal.SIGKILL
        assert _cgroup.remove_tree(group)
        assert not group.exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_only_a_run_group_proven_to_be_the_runs_is_ended(tmp_path: Path) -> None:
    _need_run_cgroup()
    where, _ = _cgroup.run_group_dir("abc123")
    assert where is not None
    assert _cgroup.is_run_group(where, "abc123")
    assert not _cgroup.is_run_group(where, "abc124")
    assert not _cgroup.is_run_group(where.parent, "abc123")
    assert not _cgroup.is_run_group(where / ".." / where.name, "abc123")
    assert not _cgroup.is_run_group(tmp_path / f"{_cgroup.RUN_PREFIX}abc123", "abc123")
    with pytest.raises(ValueError, match="not the cgroup of aftershock run"):
        _cgroup.end_run_group(where.parent, "abc123")
