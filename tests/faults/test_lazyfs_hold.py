"""The lazy filesystem holds the job for a `created` file trigger (``lazyfs.Hold``).

On the run's own FUSE mount the trigger does not use fanotify: the filesystem itself holds
the job's next operation after the count-th matching name appeared, until the harness's
fault is in. Real mounts, a real writer process, and the trigger that chooses this hold.
"""

from __future__ import annotations

import errno
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aftershock.faults import lazyfs
from aftershock.faults._fanotify import Held
from aftershock.harness.run.triggers import FileTriggers

# A checkpoint writer: for each step a folder, then rank_0.pt (created under its name, or
# written to a temporary name and renamed into place), then the folder's fsync. It says
# "saved N" after each save and "error N CODE" where an operation failed.
WRITER = r"""
import errno, os, sys
root, how, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    folder = f"{root}/step_{i}"
    try:
        os.mkdir(folder)
        final = f"{folder}/rank_0.pt"
        with open(final if how == "create" else f"{folder}/.rank_0.pt.tmp", "wb") as f:
            f.write(b"payload" * 100)
            f.flush()
            os.fsync(f.fileno())
        if how == "rename":
            os.replace(f"{folder}/.rank_0.pt.tmp", final)
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError as exc:
        print("error", i, errno.errorcode.get(exc.errno or 0, "?"), flush=True)
        sys.exit(1)
    print("saved", i, flush=True)
"""


def start_writer(folder: Path, how: str, n: int = 4) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(folder), how, str(n)],
                            stdout=subprocess.PIPE, text=True)


def lines(proc: subprocess.Popen[str], timeout: float = 30.0) -> list[str]:
    out, _ = proc.communicate(timeout=timeout)
    return out.split("\n")[:-1]


def wait_held(hold: lazyfs.Hold, timeout: float = 20.0) -> Held:
    deadline = time.monotonic() + timeout
    while hold.held() is None and time.monotonic() < deadline:
        select.select([hold.fileno()], [], [], 0.5)
        hold.take()
    held = hold.held()
    assert held is not None, "nothing was held"
    return held


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["create", "rename"])
def test_the_kth_new_name_holds_its_writer_until_released(mount: tuple[Path, str],
                                                          how: str) -> None:
    """The third rank_0.pt (created under its name, or renamed into place) holds the
    writer's next operation inside that save; the first two saves were not held; and the
    harness can look at the new file meanwhile (nothing holds the folder's lock)."""
    folder, name = mount
    hold = lazyfs.Hold(name, "step_*/rank_0.pt", 3)
    writer = start_writer(folder, how)
    try:
        held = wait_held(hold)
        assert held.match == "step_2/rank_0.pt"
        assert held.pid == writer.pid
        # Held before the save's end: the folder's fsync has not happened, so its name is
        # not durable, and the save does not go on however long the harness takes.
        time.sleep(1.0)
        assert writer.poll() is None
        assert os.stat(folder / "step_2").st_mode  # the harness's own look is not held
        assert "rank_0.pt" in os.listdir(folder / "step_2")
        assert held.path == ("step_2" if how == "rename" else "step_2/rank_0.pt")
    finally:
        hold.close()
    assert lines(writer) == [f"saved {i}" for i in range(4)]
    assert writer.returncode == 0


@pytest.mark.timeout(90)
def test_a_power_loss_runs_while_the_writer_is_held_and_its_op_then_fails(
    mount: tuple[Path, str],
) -> None:
    folder, name = mount
    hold = lazyfs.Hold(name, "step_*/rank_0.pt", 2)
    writer = start_writer(folder, "create")
    try:
        wait_held(hold)
        began = time.monotonic()
        lost = lazyfs.command(name, "lose", timeout=5)
        assert time.monotonic() - began < 5
        assert lost["entries"] > 0  # the unsynced step folders
    finally:
        hold.close()
    # The held write goes on into a powered-off disk: an I/O error, as after a power cut.
    assert lines(writer) == ["saved 0", f"error 1 {errno.errorcode[errno.EIO]}"]
    lazyfs.command(name, "on")
    assert os.listdir(folder) == []  # nothing of it was ever durable


@pytest.mark.timeout(90)
def test_a_held_writer_killed_with_the_power_dies_at_once_without_seeing_it(
    mount: tuple[Path, str],
) -> None:
    """A process waiting on a FUSE answer cannot die until it has one: the power loss's
    kill must not wait for the harness's release (which comes after the kill), and the
    writer must not run on to see the error of a powered-off disk."""
    folder, name = mount
    hold = lazyfs.Hold(name, "step_*/rank_0.pt", 2)
    writer = start_writer(folder, "create")
    try:
        wait_held(hold)
        lazyfs.command(name, "lose")
        began = time.monotonic()
        writer.kill()
        out = lines(writer)
        assert time.monotonic() - began < lazyfs.HOLD_MAX_S / 2
        assert out == ["saved 0"]
        assert writer.returncode == -9
    finally:
        hold.close()


@pytest.mark.timeout(90)
def test_a_hold_nobody_releases_ends_by_itself(mount: tuple[Path, str]) -> None:
    """A harness that stalls (or dies without closing) never wedges the job: the hold ends
    after its bound, and the filesystem says so."""
    folder, name = mount
    hold = lazyfs.Hold(name, "step_*/rank_0.pt", 1, max_s=1.5)
    writer = start_writer(folder, "create", n=2)
    try:
        wait_held(hold)
        began = time.monotonic()
        assert lines(writer) == ["saved 0", "saved 1"]
        assert time.monotonic() - began >= 1.0
        deadline = time.monotonic() + 10
        while hold.expired is None and time.monotonic() < deadline:
            select.select([hold.fileno()], [], [], 0.5)
            hold.take()
        assert hold.expired is not None
        assert hold.expired["match"] == "step_0/rank_0.pt"
        assert hold.held() is None
    finally:
        hold.close()


@pytest.mark.timeout(90)
def test_a_harness_that_dies_lets_the_writer_go(mount: tuple[Path, str]) -> None:
    folder, name = mount
    harness = subprocess.Popen(
        [sys.executable, "-c",
         "import select, sys, time\nfrom aftershock.faults import lazyfs\n"
         f"h = lazyfs.Hold({name!r}, 'step_*/rank_0.pt', 1)\n"
         "print('armed', flush=True)\n"
         "while h.held() is None:\n"
         "    select.select([h.fileno()], [], [], 0.5); h.take()\n"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert harness.stdout is not None
    try:
        assert harness.stdout.readline().strip() == "armed"
        writer = start_writer(folder, "create", n=2)
        assert harness.stdout.readline().strip() == "held"
        assert writer.poll() is None
    finally:
        harness.kill()
        harness.wait()
        harness.stdout.close()
    began = time.monotonic()
    assert lines(writer) == ["saved 0", "saved 1"]
    assert time.monotonic() - began < lazyfs.HOLD_MAX_S - 2  # the closed connection, not the bound


@pytest.mark.timeout(90)
@pytest.mark.parametrize("within", ["", "work/[x]"], ids=["at-the-mount", "in-a-folder"])
def test_a_created_trigger_on_the_lazy_mount_is_held_by_the_filesystem(
    mount: tuple[Path, str], within: str,
) -> None:
    """The file trigger chooses the filesystem's hold on the run's lazy mount, whether its
    root is the mount or a folder in it (whose name has a glob character): the k-th match
    is reached while the writer waits, and its record says the job was held, with paths
    relative to the root."""
    folder, _ = mount
    if within:
        folder = folder / within
        folder.mkdir(parents=True)
    triggers = FileTriggers()
    triggers.watch(0, folder, "step_*/rank_0.pt", "created", count=2)
    assert isinstance(triggers._gates[0], lazyfs.Hold)
    writer = start_writer(folder, "rename")
    try:
        deadline = time.monotonic() + 20
        while triggers.hits().get(0, 0) < 2 and time.monotonic() < deadline:
            triggers.poll()
            triggers.wait(0.05)
        assert triggers.hits()[0] >= 2
        assert triggers.path(0, 2) == "step_1/rank_0.pt"
        landing = triggers.landing(0)
        assert landing == {"file_held": True, "held_open": "step_1", "held_pid": writer.pid}
        time.sleep(0.5)
        assert writer.poll() is None  # still inside the second save
        triggers.release(0)
        assert lines(writer) == [f"saved {i}" for i in range(4)]
    finally:
        triggers.close()


@pytest.mark.timeout(90)
def test_a_trigger_whose_hold_ran_out_says_so(mount: tuple[Path, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness too late to use its hold (here it never releases it): the hold ends at
    its bound, the job goes on, and the fault's record says the job was not held and why."""
    folder, _ = mount
    monkeypatch.setattr(lazyfs, "HOLD_MAX_S", 1.0)
    triggers = FileTriggers()
    triggers.watch(0, folder, "step_*/rank_0.pt", "created", count=1)
    writer = start_writer(folder, "create", n=2)
    try:
        deadline = time.monotonic() + 20
        while triggers.hits().get(0, 0) < 1 and time.monotonic() < deadline:
            triggers.poll()
            triggers.wait(0.05)
        assert triggers.landing(0)["file_held"] is True
        assert lines(writer) == ["saved 0", "saved 1"]  # let go by the bound, not by us
        gate = triggers._gates[0]
        while getattr(gate, "expired", None) is None and time.monotonic() < deadline:
            triggers.poll()
            triggers.wait(0.05)
        landing = triggers.landing(0)
        assert landing["file_held"] is False
        assert "step_0/rank_0.pt" in landing["file_held_why"]
        assert "its bound" in landing["file_held_why"]
    finally:
        triggers.close()
