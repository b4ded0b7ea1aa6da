"""The harness's writers on a full disk, without root: /dev/full fails every write with
ENOSPC, as a full filesystem does. A writer notes it once (harness/run/_room.py) and goes on;
the log pump keeps reading the job's pipe, so the job never blocks on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aftershock.harness.run._room import Room, RunDirFull
from aftershock.harness.run.target import _LogPump
from aftershock.harness.run.timeline import Timeline

pytestmark = pytest.mark.timeout(60)

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


@needs_dev_full
def test_a_write_to_a_full_disk_is_noted_once_and_not_raised(tmp_path: Path) -> None:
    room = Room(tmp_path)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        assert room.write(fd, b"first\n", "a.log") is False
        assert room.write(fd, b"second\n", "b.log") is False
    finally:
        os.close(fd)
    assert isinstance(room.full, RunDirFull)
    assert "writing a.log: No space left on device" in room.full.what  # the first one
    with pytest.raises(RunDirFull, match=r"run folder's filesystem is full: .*a\.log"):
        room.check()


@needs_dev_full
def test_the_timeline_on_a_full_disk_notes_it_and_goes_on(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "events.jsonl")
    # Its file is now /dev/full: its writes fail with ENOSPC (a link in its place is refused,
    # so the descriptor is swapped under it).
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, timeline._fd)
    os.close(full)
    try:
        timeline.emit("launch")
        timeline.emit("teardown")  # a heal's event in the teardown must not raise either
    finally:
        timeline.close()
    assert timeline.room.full is not None
    assert timeline.room.full.folder == tmp_path


@needs_dev_full
def test_the_log_pump_keeps_reading_when_its_log_cannot_be_written(tmp_path: Path) -> None:
    """Before, the pump's thread died with a traceback at the first ENOSPC, and the job then
    blocked on its full pipe until the run's timeout."""
    log = tmp_path / "launcher.stdout.log"
    log.symlink_to("/dev/full")
    lines: list[bytes] = []
    room = Room(tmp_path)
    # 4 MiB: many times a pipe's buffer, so the writer finishes only if the pump reads on.
    job = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfor i in range(1024): print(i, 'x' * 4096)"],
        stdout=subprocess.PIPE)
    assert job.stdout is not None
    pump = _LogPump("stdout", job.stdout, log, lambda raw, t: lines.append(raw), room)
    pump.start()
    try:
        assert job.wait(timeout=30) == 0
        pump.finish(time.monotonic() + 5)
        pump.thread.join(timeout=10)
        assert not pump.thread.is_alive()
    finally:
        job.kill()
        job.wait()
        job.stdout.close()
    assert pump.eof
    assert len(lines) == 1024  # the probes still saw every line
    assert room.full is not None
    assert room.full.what.startswith(f"writing {log}: ")
