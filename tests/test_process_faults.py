"""Process faults, the heal journal and the reaper, on real processes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aftershock import faults
from aftershock.faults._proc import ProcessRef, processes_with_env, state
from aftershock.faults.heal import heal_journal, heal_orphans
from aftershock.faults.journal import Journal, pending

pytestmark = pytest.mark.timeout(60)


def sleeper(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, **(env or {})})


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_kill_sends_the_signal(tmp_path: Path) -> None:
    proc = sleeper()
    ref = ProcessRef.of(proc.pid)
    assert ref is not None
    applied = faults.get("process.kill").inject(ref, {"signal": "SIGTERM"},
                                                Journal.create("t", tmp_path))
    assert proc.wait(timeout=5) == -signal.SIGTERM
    assert applied.journal_id is None
    assert "SIGTERM" in applied.detail


def test_term_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    ref = ProcessRef.of(proc.pid)
    assert ref is not None
    started = time.monotonic()
    faults.get("process.term").inject(ref, {"grace": 0.3}, Journal.create("t", tmp_path))
    assert proc.wait(timeout=5) == -signal.SIGKILL
    proc.stdout.close()
    assert time.monotonic() - started >= 0.25


def test_freeze_is_journaled_before_and_healed_after(tmp_path: Path) -> None:
    proc = sleeper({"AFTERSHOCK_RUN_ID": "t"})  # a process of run t: heal may thaw it
    ref = ProcessRef.of(proc.pid)
    assert ref is not None
    journal = Journal.create("t", tmp_path)
    applied = faults.get("process.freeze").inject(ref, {}, journal)
    try:
        assert wait_for(lambda: state(proc.pid) == "T")
        assert [p.kind for p in pending(journal.path)] == ["process.freeze"]
        healed = heal_journal(journal.path)
        assert [h.error for h in healed] == [None]
        assert wait_for(lambda: state(proc.pid) in ("S", "R"))
        assert not journal.path.exists()  # nothing pending: the journal is removed
        assert applied.journal_id is not None
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_never_signalled() -> None:
    proc = sleeper()
    ref = ProcessRef.of(proc.pid)
    assert ref is not None
    stale = ProcessRef(ref.pid, ref.start - 1)  # same pid, another process's start time
    assert not stale.signal(signal.SIGKILL)
    assert proc.poll() is None
    proc.kill()
    proc.wait()


HARNESS = """
import os, subprocess, sys, time
from aftershock.faults._proc import ProcessRef
from aftershock.faults.heal import start_reaper
from aftershock.faults.journal import Journal
from aftershock import faults
journal = Journal.create("crashy")
start_reaper(journal.path)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         env={**os.environ, "AFTERSHOCK_RUN_ID": "crashy"})
journal.intend("launch", {"env": "AFTERSHOCK_RUN_ID", "value": "crashy"}, op="launch")
time.sleep(0.3)
faults.get("process.freeze").inject(ProcessRef.of(child.pid), {}, journal)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_reaper_heals_when_the_harness_is_sigkilled(tmp_path: Path) -> None:
    env = {**os.environ, "AFTERSHOCK_STATE_DIR": str(tmp_path)}
    harness = subprocess.Popen([sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, env=env)
    assert harness.stdout is not None
    child = int(harness.stdout.readline())
    assert wait_for(lambda: state(child) == "T")
    harness.kill()
    harness.wait()
    harness.stdout.close()
    # The reaper notices the harness is gone, thaws and ends the child, clears the journal.
    assert wait_for(lambda: state(child) in (None, "Z"), timeout=15)
    assert processes_with_env("AFTERSHOCK_RUN_ID", "crashy") == []
    assert wait_for(lambda: not list((tmp_path / "journal").glob("*.jsonl")))


def test_heal_orphans_skips_live_owners_and_heals_dead_ones(tmp_path: Path) -> None:
    proc = sleeper({"AFTERSHOCK_RUN_ID": "dead"})  # the run whose journal is healed below
    ref = ProcessRef.of(proc.pid)
    assert ref is not None
    live = Journal.create("live", tmp_path)  # owned by this (live) test process
    faults.get("process.freeze").inject(ref, {}, live)
    try:
        assert wait_for(lambda: state(proc.pid) == "T")
        assert heal_orphans(tmp_path) == []
        assert state(proc.pid) == "T"
        # The same entries in a journal whose owner is dead get healed.
        dead = tmp_path / "dead.jsonl"
        dead.write_text(live.path.read_text().replace(str(live.owner.pid), "999999999", 1)
                        if live.owner else "")
        healed = heal_orphans(tmp_path)
        assert [h.entry.kind for h in healed] == ["process.freeze"]
        assert wait_for(lambda: state(proc.pid) in ("S", "R"))
    finally:
        proc.kill()
        proc.wait()
