"""A full disk under the run folder: the harness finds it at once, stops the job, undoes its
faults, and keeps a record that says why (exit 3), on a real size-limited tmpfs.

Before, the log thread died with a traceback, the job blocked on its unread pipe until the
whole 240 s timeout, and ``result.json`` was left empty (issue 48, finding 8).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

#: Two processes (a parent and its child) that each record their pid outside the small
#: filesystem, so the test can tell whether any of them outlived the run, then fill it.
JOB = """\
import os, subprocess, sys, time
with open(os.environ["JOB_PIDS"], "a") as pids:
    pids.write(f"{os.getpid()}\\n")
if "JOB_CHILD" not in os.environ:
    subprocess.Popen([sys.executable, __file__], env={**os.environ, "JOB_CHILD": "1"})
"""
#: Through the harness's own writers: 4 KiB lines printed as fast as they can.
LOGS = """\
line = "x" * 4096
step = 0
while True:
    step += 1
    print(f"step {step} {line}", flush=True)
    time.sleep(0.001)
"""
#: With files of its own in its output folder, ignoring ENOSPC, printing nothing: only the
#: harness's next write of its own (the load monitor's, every 2 s) can find the disk full.
FILES = """\
chunk = bytes(64 * 1024)
try:
    with open(os.path.join(os.environ["AFTERSHOCK_OUTPUT_DIR"], f"{os.getpid()}.bin"),
              "wb") as out:
        while True:
            out.write(chunk)
            out.flush()
except OSError:
    pass
while True:
    time.sleep(1)
"""

#: The job runs until its timeout unless the harness stops it: the test's point.
TIMEOUT_S = 240


def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` mounted on ``path``, always unmounted after."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def scenario(tmp_path: Path, state: Path, fills: str = LOGS) -> Path:
    job = tmp_path / "job.py"
    job.write_text(JOB + fills)
    path = tmp_path / "full.yaml"
    path.write_text(f"""\
name: full
system:
  command: [{sys.executable}, {job}]
  env: {{JOB_PIDS: "{tmp_path / 'pids'}"}}
  timeout: {TIMEOUT_S}s
  probes:
    - event: step
      pattern: 'step (?P<step>\\d+) '
faults:
  - kind: storage.corrupt
    root: {state}
    path: data.bin
    offset: 0
    bytes: 8
    restore: true
    at: {{time: 0s}}
expect: {{completes: true}}
""")
    return path


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(_can_mount() is not None, reason=str(_can_mount()))
@pytest.mark.parametrize("fills", [LOGS, FILES], ids=["logs", "files"])
def test_a_full_run_folder_stops_the_job_at_once_with_a_record(tmp_path: Path,
                                                               fills: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    original = bytes(range(64))
    (state / "data.bin").write_bytes(original)
    path = scenario(tmp_path, state, fills)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with small_disk(tmp_path / "disk", "2m") as disk:
        run_dir = disk / "runs"
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "aftershock", "run", str(path), "--run-dir", str(run_dir),
             "--plain", "--json", str(tmp_path / "out.json")],
            capture_output=True, text=True, timeout=TIMEOUT_S - 60, env=env, cwd=tmp_path)
        took = time.monotonic() - began
        output = done.stdout + done.stderr
        assert done.returncode == 3, output
        # Found at once, not at the timeout: generous for a loaded machine, far below 240 s.
        assert took < 60, f"{took:.0f}s\n{output}"
        assert "Traceback" not in output, output
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, done.stderr  # one line on stderr, no thread traceback
        message = lines[0]
        record = run_dir / "full" / "result.json"
        assert f"run folder's filesystem is full: {run_dir / 'full'}" in message, message
        assert "stopped the job" in message, message
        assert f"record written to {record}" in message, message
        # The record is there, whole, and says why.
        written = json.loads(record.read_text())
        assert written["passed"] is False
        assert "run folder's filesystem is full" in written["error"]
        assert "stopped the job" in written["error"]
        assert json.loads((tmp_path / "out.json").read_text())[0]["error"] == written["error"]
        # Nothing of the reserve is left behind to keep the disk full.
        assert not (run_dir / "full" / ".aftershock-reserve").exists()
    # Healed: the corrupted file is back as it was; no process of the job is left.
    assert (state / "data.bin").read_bytes() == original
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert pids
    assert not [pid for pid in pids if alive(pid)], pids


@pytest.mark.skipif(_can_mount() is not None, reason=str(_can_mount()))
def test_no_room_at_all_keeps_the_record_elsewhere_and_says_where(tmp_path: Path) -> None:
    """A disk already full when the run starts: nothing is launched, and the record, which
    even the reserve could not make room for, is written in the temporary folder."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "data.bin").write_bytes(bytes(64))
    path = scenario(tmp_path, state)
    spare = tmp_path / "spare"
    spare.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spare)}
    with small_disk(tmp_path / "disk", "1m") as disk:
        run_dir = disk / "runs"
        (run_dir / "full").mkdir(parents=True)
        with open(disk / "filler", "wb") as filler, contextlib.suppress(OSError):
            while True:
                filler.write(bytes(64 * 1024))
                filler.flush()
        done = subprocess.run(
            [sys.executable, "-m", "aftershock", "run", str(path), "--run-dir", str(run_dir),
             "--plain"],
            capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
        output = done.stdout + done.stderr
        assert done.returncode == 3, output
        assert "Traceback" not in output, output
        (message,) = [line for line in done.stderr.splitlines() if line.strip()]
        assert f"run folder's filesystem is full: {run_dir / 'full'}" in message, message
        assert "no job of the run was running" in message, message
        assert not (run_dir / "full" / "result.json").exists()
        assert not (tmp_path / "pids").exists()  # nothing was launched
    (record,) = spare.glob("aftershock-full-*/result.json")
    assert f"no room for the record in the run folder (No space left on device): record " \
           f"written to {record}" in message, message
    assert "run folder's filesystem is full" in json.loads(record.read_text())["error"]
