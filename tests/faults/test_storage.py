"""storage.* on real files: corruption, truncation, deletion, a real ENOSPC from tmpfs, and
a power loss on the lazy filesystem (storage.lose_unsynced) that nothing outlives."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import quick_scenario

from aftershock.faults import lazyfs
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef, all_pids
from aftershock.faults.journal import Journal, pending
from aftershock.faults.storage import CORRUPT, DELETE, FULL, LOSE_UNSYNCED, TRUNCATE

ME = ProcessRef(os.getpid(), 0)  # storage faults act on files, not on the process


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    """Three checkpoints; step_3 is the newest."""
    folder = tmp_path / "run" / "ckpt"
    folder.mkdir(parents=True)
    for step in (1, 2, 3):
        path = folder / f"step_{step}.pt"
        path.write_bytes(bytes(range(256)) * 40)
        os.utime(path, ns=(time.time_ns(), step * 10**18))
    return tmp_path / "run"


@pytest.mark.timeout(60)
def test_corrupt_changes_the_newest_file_and_keeps_size_and_mtime(
    ckpts: Path, tmp_path: Path
) -> None:
    newest = ckpts / "ckpt" / "step_3.pt"
    before, st = _digest(newest), newest.stat()
    journal = Journal.create("corrupt", tmp_path)
    applied = CORRUPT.inject(ME, {"root": str(ckpts), "path": "ckpt/*.pt", "seed": 7}, journal)
    assert applied.journal_id is None
    assert "16 bytes" in applied.detail
    assert _digest(newest) != before
    assert newest.stat().st_size == st.st_size
    assert newest.stat().st_mtime_ns == st.st_mtime_ns
    assert _digest(ckpts / "ckpt" / "step_2.pt") == before  # others untouched
    assert pending(journal.path) == []


@pytest.mark.timeout(60)
def test_corrupt_at_offset_with_restore_is_undone(ckpts: Path, tmp_path: Path) -> None:
    path = ckpts / "ckpt" / "step_1.pt"
    before = path.read_bytes()
    journal = Journal.create("restore", tmp_path)
    params = {"root": str(ckpts), "path": "ckpt/step_1.pt", "offset": 10, "bytes": 4}
    applied = CORRUPT.inject(ME, {**params, "restore": True}, journal)
    after = path.read_bytes()
    assert [i for i in range(len(before)) if before[i] != after[i]] == [10, 11, 12, 13]
    assert len(pending(journal.path)) == 1
    CORRUPT.revert(applied.undo)
    CORRUPT.revert(applied.undo)  # idempotent
    assert path.read_bytes() == before
    assert not Path(applied.undo["backup"]).exists()


@pytest.mark.timeout(60)
def test_truncate_shortens(ckpts: Path, tmp_path: Path) -> None:
    journal = Journal.create("truncate", tmp_path)
    newest = ckpts / "ckpt" / "step_3.pt"
    size = newest.stat().st_size
    TRUNCATE.inject(ME, {"root": str(ckpts), "path": "ckpt/*.pt"}, journal)
    assert newest.stat().st_size == size // 2
    TRUNCATE.inject(ME, {"root": str(ckpts), "path": "ckpt/*.pt", "size": 7}, journal)
    assert newest.stat().st_size == 7


@pytest.mark.timeout(60)
def test_delete_removes_and_restore_brings_back(ckpts: Path, tmp_path: Path) -> None:
    journal = Journal.create("delete", tmp_path)
    DELETE.inject(ME, {"root": str(ckpts), "path": "ckpt/*.pt"}, journal)
    assert sorted(p.name for p in (ckpts / "ckpt").iterdir()) == ["step_1.pt", "step_2.pt"]
    applied = DELETE.inject(ME, {"root": str(ckpts), "path": "ckpt", "restore": True}, journal)
    assert not (ckpts / "ckpt").exists()
    DELETE.revert(applied.undo)
    assert sorted(p.name for p in (ckpts / "ckpt").iterdir()) == ["step_1.pt", "step_2.pt"]
    with pytest.raises(FileNotFoundError, match="no file or folder matches"):
        DELETE.inject(ME, {"root": str(ckpts), "path": "nothing/*"}, journal)


def _mounted(source: str) -> bool:
    with open("/proc/mounts") as handle:
        return any(line.split()[0] == source for line in handle)


@pytest.mark.timeout(60)
def test_full_gives_enospc_and_unmounts_with_write_back(ckpts: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_SYS_ADMIN) to mount a tmpfs")
    folder = ckpts / "ckpt"
    old = _digest(folder / "step_1.pt")
    journal = Journal.create("full", tmp_path)
    applied = FULL.inject(ME, {"root": str(ckpts), "dir": "ckpt", "free": 8192}, journal)
    source = applied.undo["source"]
    try:
        assert _mounted(source)
        assert _digest(folder / "step_1.pt") == old  # existing files are still there
        (folder / "small.txt").write_text("fits in the room left")
        with pytest.raises(OSError, match="No space left") as info:
            (folder / "step_4.pt").write_bytes(b"x" * 1_000_000)
        assert info.value.errno == errno.ENOSPC
        (folder / "step_1.pt").unlink()  # rotation during the fault
    finally:
        FULL.revert(applied.undo)
    FULL.revert(applied.undo)  # idempotent
    assert not _mounted(source)
    # The folder now holds what the system under test left in it during the fault.
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["small.txt", "step_2.pt", "step_3.pt", "step_4.pt"]
    assert (folder / "step_4.pt").stat().st_size < 1_000_000  # the torn write stays torn
    assert not Path(applied.undo["stash"]).exists()


@pytest.mark.timeout(60)
def test_full_unmounts_even_when_busy(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_SYS_ADMIN) to mount a tmpfs")
    journal = Journal.create("busy", tmp_path)
    applied = FULL.inject(ME, {"root": str(tmp_path), "dir": "empty", "write_back": False}, journal)
    fd = os.open(tmp_path / "empty" / "held", os.O_WRONLY | os.O_CREAT)  # keeps it busy
    try:
        assert os.write(fd, b"y" * os.sysconf("SC_PAGE_SIZE")) > 0  # the one page there is
        with pytest.raises(OSError, match="No space left"):
            os.write(fd, b"y" * 100_000)
        FULL.revert(applied.undo)
        assert not _mounted(applied.undo["source"])
        assert list((tmp_path / "empty").iterdir()) == []
    finally:
        os.close(fd)


# ------------------------------------------------------------------ storage.lose_unsynced


def _sleepers(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            for _ in range(count)]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.usefixtures("fuse")
@pytest.mark.timeout(60)
def test_lose_unsynced_loses_and_kills_together_then_unmounts(tmp_path: Path) -> None:
    journal = Journal.create("power", tmp_path / "journal", folders=[tmp_path])
    setup = LOSE_UNSYNCED.prepare({"root": str(tmp_path), "dir": "ckpt"}, journal)
    folder = tmp_path / "ckpt"
    server = ProcessRef.from_json(setup.undo["server"])
    kids = _sleepers(2)
    try:
        assert lazyfs.mounted_source(folder) == setup.undo["source"]
        assert [p.kind for p in pending(journal.path)] == ["storage.lose_unsynced"]
        (folder / "durable").write_bytes(b"kept")
        _fsync(folder / "durable")
        _fsync(folder)
        (folder / "volatile").write_bytes(b"gone")
        refs = [ProcessRef.of(k.pid) for k in kids]
        applied = LOSE_UNSYNCED.inject_group(
            [r for r in refs if r is not None], {"prepared": dict(setup.undo)}, journal)
        assert applied.journal_id is None  # the loss is the point: nothing to undo
        assert "1 file(s) gone or rolled back (4 bytes) and 1 directory entry" in applied.detail
        assert [k.wait(timeout=5) for k in kids] == [-signal.SIGKILL] * 2
        assert sorted(os.listdir(folder)) == ["durable"]  # powered on again, what survived
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
        LOSE_UNSYNCED.revert(setup.undo)
    LOSE_UNSYNCED.revert(setup.undo)  # idempotent
    assert lazyfs.mounted_source(folder) is None
    assert not server.alive()
    assert sorted(os.listdir(folder)) == ["durable"]  # the folder holds what survived


@pytest.mark.usefixtures("fuse")
@pytest.mark.timeout(60)
def test_lose_unsynced_is_undone_from_its_journal_record_alone(tmp_path: Path) -> None:
    """The reaper and `aftershock heal` are other processes: they know the record, not our
    child. The record says which mount and which server, and nothing else is touched."""
    journal = Journal.create("heal", tmp_path / "journal", folders=[tmp_path])
    setup = LOSE_UNSYNCED.prepare({"root": str(tmp_path), "dir": "ckpt"}, journal)
    server = ProcessRef.from_json(setup.undo["server"])
    assert set(setup.undo) == {"mount", "source", "server"}
    try:
        with pytest.raises(ValueError, match="not a lazy filesystem"):
            type(LOSE_UNSYNCED)().revert({**setup.undo, "source": "tmpfs"})
        assert lazyfs.mounted_source(tmp_path / "ckpt") == setup.undo["source"]
        healed = heal_journal_with(type(LOSE_UNSYNCED)(), journal.path)
        assert healed == [None]
        assert lazyfs.mounted_source(tmp_path / "ckpt") is None
        assert not server.alive()
        assert not journal.path.exists()
    finally:
        LOSE_UNSYNCED.revert(setup.undo)  # reaps our child


def heal_journal_with(kind: object, path: Path) -> list[str | None]:
    """heal_journal, with a fresh instance of the kind standing in for the registry's (as
    in a reaper process, which never started the server)."""
    from aftershock.faults import heal, registry

    with registry.KINDS.added(kind):
        return [h.error for h in heal.heal_journal(path)]


@pytest.mark.timeout(60)
def test_lose_unsynced_without_its_filesystem_is_refused(tmp_path: Path) -> None:
    journal = Journal.create("unprepared", tmp_path)
    with pytest.raises(FaultUnavailable, match="needs its filesystem"):
        LOSE_UNSYNCED.inject(ME, {"root": str(tmp_path)}, journal)
    with pytest.raises(ValueError, match="outside root"):
        LOSE_UNSYNCED.prepare({"root": str(tmp_path), "dir": "../elsewhere"}, journal)


def _lazy_mounts_under(folder: Path) -> list[str]:
    with open("/proc/mounts") as handle:
        return [line for line in handle if line.startswith(lazyfs.SOURCE_PREFIX)
                and line.split()[1].startswith(str(folder))]


def _harness_with_a_mount(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real harness run (CLI) of a command job whose checkpoint folder is on the lazy
    filesystem; returns once the mount is there."""
    scenario = tmp_path / "power.yaml"
    scenario.write_text(quick_scenario("power-then-sigkill", """\
faults:
  - kind: storage.lose_unsynced
    dir: ckpt
    at: {time: 50s}
""", duration=60))
    runs = tmp_path / "runs"
    harness = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "run", str(scenario), "--run-dir", str(runs),
         "--plain"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "AFTERSHOCK_STATE_DIR": str(tmp_path / "state")},
    )
    deadline = time.monotonic() + 30
    while not _lazy_mounts_under(runs) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _lazy_mounts_under(runs):
        harness.kill()
        harness.wait()
        pytest.fail("the lazy filesystem was never mounted")
    return harness, runs


def _gone(runs: Path, state: Path, timeout: float = 20.0) -> tuple[list[str], list[Path]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mounts, journals = _lazy_mounts_under(runs), list((state / "journal").glob("*.jsonl"))
        if not mounts and not journals:
            break
        time.sleep(0.1)
    return _lazy_mounts_under(runs), list((state / "journal").glob("*.jsonl"))


@pytest.mark.usefixtures("fuse")
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sigkilled_harness_leaves_no_mount(tmp_path: Path) -> None:
    harness, runs = _harness_with_a_mount(tmp_path)
    harness.kill()
    harness.wait()
    assert _gone(runs, tmp_path / "state") == ([], [])


@pytest.mark.usefixtures("fuse")
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_heal_cleans_up_a_mount_when_no_reaper_ran(tmp_path: Path) -> None:
    harness, runs = _harness_with_a_mount(tmp_path)
    for pid in all_pids():  # the reaper first (as a `kill -9` of the session might), then us
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"aftershock.faults.heal" in cmdline and str(harness.pid).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
    harness.kill()
    harness.wait()
    healed = subprocess.run(
        [sys.executable, "-m", "aftershock", "heal"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "AFTERSHOCK_STATE_DIR": str(tmp_path / "state")},
    )
    assert healed.returncode == 0, healed.stderr
    assert "storage.lose_unsynced" in healed.stdout
    assert _gone(runs, tmp_path / "state", timeout=5) == ([], [])
