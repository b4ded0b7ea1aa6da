"""process.straggle slows a real CPU-bound process and lets it go again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.faults import _cgroup
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal
from aftershock.faults.straggle import STRAGGLE

# Prints how many loop iterations it did in each 100 ms of wall time.
SPINNER = """
    import time
    end = time.monotonic() + 55
    while time.monotonic() < end:
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.1:
            for _ in range(1000):
                pass
            n += 1
        print(n, flush=True)
"""


class Spinner:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SPINNER)], stdout=subprocess.PIPE, text=True
        )
        self.samples: list[tuple[float, int]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def join_reader(self) -> None:
        self._reader.join(10)
        assert not self._reader.is_alive(), "the spinner's output never ended"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.samples.append((time.monotonic(), int(line)))

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def rate(self, seconds: float) -> tuple[float, float]:
        """Mean work per 100 ms, and the share of one CPU used, over the next ``seconds``."""
        start, cpu = time.monotonic(), self.cpu_s()
        time.sleep(seconds)
        share = (self.cpu_s() - cpu) / (time.monotonic() - start)
        window = [n for t, n in self.samples if t > start]
        return sum(window) / max(1, len(window)), share


@pytest.fixture
def spinner() -> Iterator[Spinner]:
    spin = Spinner()
    try:
        time.sleep(0.3)  # past interpreter start-up
        yield spin
    finally:
        spin.proc.kill()
        spin.proc.wait()
        # The reader ends at the pipe's EOF; closing the pipe under it (`with proc`) while
        # it still reads raised "I/O operation on closed file" in its thread.
        spin.join_reader()
        with spin.proc:
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["cgroup", "signal"])
def test_straggle_slows_by_factor_and_recovers(
    method: str, spinner: Spinner, tmp_path: Path
) -> None:
    if method == "cgroup":
        mount = _cgroup.v1_mount("cpu")
        if os.geteuid() != 0 or mount is None or not _cgroup.writable(mount):
            pytest.skip("no writable cgroup v1 cpu controller (/sys/fs/cgroup/cpu) as root")
    ref = ProcessRef.of(spinner.proc.pid)
    assert ref is not None
    home = _cgroup.group_of(ref.pid, "cpu")
    before, share_before = spinner.rate(1.0)
    # A quota caps the CPU share; it only slows a process that was getting more than the cap.
    # Other work on a 2-core machine can hold the spinner to a tenth of a CPU, hence factor 50.
    factor = 50
    if share_before < 4 / factor:
        pytest.skip(f"machine too busy to measure: the spinner got {share_before:.3f} CPUs")
    journal = Journal.create("straggle", tmp_path)
    applied = STRAGGLE.inject(ref, {"factor": factor, "method": method}, journal)
    try:
        time.sleep(0.2)
        during, share = spinner.rate(1.5)
    finally:
        STRAGGLE.revert(applied.undo)
    STRAGGLE.revert(applied.undo)  # idempotent
    after, share_after = spinner.rate(1.0)
    for _ in range(3):
        # Released means uncapped, not fast: a co-tenant (another test's torch start-up)
        # can hold the spinner down for a second, so give it a few windows to show it.
        if after > 2 * during and share_after > 2 * share:
            break
        after, share_after = spinner.rate(1.0)
    seen = {"work": (before, during, after), "cpus": (share_before, share, share_after)}
    assert share < 1 / factor + 0.02, seen  # the cap holds whatever else runs
    assert during < 0.5 * before, seen
    assert after > 2 * during, seen
    assert share_after > 2 * share, seen
    assert not ref.stopped()
    if method == "cgroup":
        assert not Path(applied.undo["cgroup"]).exists()
        assert _cgroup.group_of(ref.pid, "cpu") == home


@pytest.mark.timeout(60)
def test_signal_straggle_holds_its_factor_when_the_harness_thread_is_late(
    spinner: Spinner, tmp_path: Path
) -> None:
    """The duty cycle's thread wakes late on a busy machine (CI: a 2-core machine with a test
    suite on it). Here a thread hogging the GIL delays every wake-up by up to 30 ms, far past
    the 10 ms the spinner may run per cycle. The cap must hold anyway: each stop lasts as long
    as the run before it actually took, times factor - 1."""
    factor = 10
    _, share_before = spinner.rate(0.5)
    if share_before < 0.3:
        pytest.skip(f"machine too busy to measure: the spinner got {share_before:.3f} CPUs")
    ref = ProcessRef.of(spinner.proc.pid)
    assert ref is not None
    done = threading.Event()

    def hog() -> None:
        while not done.is_set():
            for _ in range(10_000):
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.03)
    hogger = threading.Thread(target=hog, daemon=True)
    journal = Journal.create("straggle", tmp_path)
    try:
        hogger.start()
        applied = STRAGGLE.inject(ref, {"factor": factor, "method": "signal"}, journal)
        try:
            time.sleep(0.2)
            _, share = spinner.rate(2.0)
        finally:
            STRAGGLE.revert(applied.undo)
    finally:
        done.set()
        hogger.join()
        sys.setswitchinterval(interval)
    assert share < 1 / factor + 0.03, share
    assert not ref.stopped()
