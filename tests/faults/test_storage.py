"""storage.* on real files: corruption, truncation, deletion, and a real ENOSPC from tmpfs."""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path

import pytest

from faults._proc import ProcessRef
from faults.journal import Journal, pending
from faults.storage import CORRUPT, DELETE, FULL, TRUNCATE

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
