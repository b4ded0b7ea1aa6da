"""File triggers: inotify through libc sees files appear, close and go, at any folder depth a
pattern reaches, including folders (and a root) that appear after the watch began."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aftershock.faults import _inotify, file_writers
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._inotify import FileWatch, matches

pytestmark = pytest.mark.timeout(30)


def settle(watch: FileWatch, want: int, timeout: float = 5.0) -> list[str]:
    """Poll until ``want`` hits arrived (events are queued at once, but poll like the
    runner does: without assuming when)."""
    deadline = time.monotonic() + timeout
    while len(watch.poll()) < want and len(watch.hits) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return watch.hits


def test_patterns_match_one_level_per_component() -> None:
    assert matches("step_*/COMMIT", "step_000030/COMMIT")
    assert not matches("step_*/COMMIT", "step_000030/sub/COMMIT")
    assert not matches("step_*/COMMIT", "COMMIT")
    assert matches("step_*", "step_000030")
    assert matches("**/COMMIT", "COMMIT")
    assert matches("**/COMMIT", "a/b/COMMIT")
    assert matches("step_*/.rank_0.pt.*.tmp", "step_1/.rank_0.pt.x1y2.tmp")


def test_created_counts_new_names_in_new_folders_but_not_what_existed(tmp_path: Path) -> None:
    (tmp_path / "step_0").mkdir()
    (tmp_path / "step_0" / "COMMIT").write_text("old")
    with FileWatch(tmp_path, "step_*/COMMIT", "created") as watch:
        assert watch.poll() == []
        (tmp_path / "step_1").mkdir()
        (tmp_path / "step_1" / "COMMIT").write_text("1")  # maybe before step_1 is watched
        (tmp_path / "step_2").mkdir()
        (tmp_path / "step_2" / ".COMMIT.tmp").write_text("2")
        os.replace(tmp_path / "step_2" / ".COMMIT.tmp", tmp_path / "step_2" / "COMMIT")
        (tmp_path / "other").write_text("not matched")
        assert settle(watch, 2) == ["step_1/COMMIT", "step_2/COMMIT"]
        time.sleep(0.05)
        assert watch.poll() == []  # each counted once, the scan's and the event's alike


def test_closed_and_deleted(tmp_path: Path) -> None:
    (tmp_path / "step_1").mkdir()
    with FileWatch(tmp_path, "step_*/*.pt", "closed") as closed, \
            FileWatch(tmp_path, "step_*", "deleted") as deleted:
        handle = open(tmp_path / "step_1" / "rank_0.pt", "wb")  # noqa: SIM115
        handle.write(b"payload")
        assert closed.poll() == []  # open and written is not closed
        handle.close()
        assert settle(closed, 1) == ["step_1/rank_0.pt"]
        (tmp_path / "step_1" / "rank_0.pt").unlink()
        (tmp_path / "step_1").rmdir()
        assert settle(deleted, 1) == ["step_1"]


def test_a_root_that_appears_later_is_followed(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    with FileWatch(root, "step_*", "created") as watch:
        assert watch.poll() == []
        root.mkdir(parents=True)
        (root / "step_10").mkdir()
        (root / "step_20").mkdir()
        assert settle(watch, 2) == ["step_10", "step_20"]


def test_only_the_levels_a_pattern_reaches_are_watched(tmp_path: Path) -> None:
    with FileWatch(tmp_path, "a/*", "created") as shallow, \
            FileWatch(tmp_path, "**/x", "created") as deep:
        (tmp_path / "a" / "b" / "c").mkdir(parents=True)
        (tmp_path / "a" / "b" / "c" / "x").write_text("")
        settle(deep, 1)
        assert deep.hits == ["a/b/c/x"]
        assert shallow.poll() == ["a/b"]
        assert len(shallow._dirs) == 2  # the root and a/, not a/b or a/b/c


def test_missing_inotify_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoInotify:
        def __getattr__(self, name: str) -> object:
            raise AttributeError(f"undefined symbol: {name}")

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: NoInotify())
    with pytest.raises(FaultUnavailable, match=r"inotify is not available.*inotify\(7\)"):
        FileWatch(Path("/tmp"), "x", "created")


def test_a_full_watch_table_says_which_limit(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    real = _inotify._libc()

    class Limited:
        inotify_init1 = real.inotify_init1
        inotify_rm_watch = real.inotify_rm_watch

        def inotify_add_watch(self, *args: object) -> int:
            ctypes.set_errno(28)  # ENOSPC: fs.inotify.max_user_watches reached
            return -1

    monkeypatch.setattr(_inotify, "_libc", Limited)
    with pytest.raises(FaultUnavailable, match="max_user_watches"):
        FileWatch(tmp_path, "x", "created")


def test_modified_counts_each_save_over_an_existing_file_once(tmp_path: Path) -> None:
    """A save onto the file it resumes from (torch.save onto the same path) creates no name:
    `modified` sees it, once per save however many writes it takes."""
    (tmp_path / "snapshot.pt").write_bytes(b"old" * 100)
    with FileWatch(tmp_path, "snapshot.pt", "modified") as watch:
        (tmp_path / "snapshot.pt").read_bytes()  # a reader is not a save
        assert watch.poll() == []
        with open(tmp_path / "snapshot.pt", "wb") as handle:  # truncates: the save begins
            assert settle(watch, 1) == ["snapshot.pt"]
            for _ in range(3):
                handle.write(b"new")
                handle.flush()
        with open(tmp_path / "snapshot.pt", "r+b") as handle:
            handle.write(b"x")
        assert settle(watch, 2) == ["snapshot.pt", "snapshot.pt"]
        time.sleep(0.05)
        assert watch.poll() == []


def test_opened_counts_opens_for_writing_not_reads(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.pt"
    target.write_bytes(b"old")
    held: list[Path] = []
    with FileWatch(tmp_path, "*.pt", "opened") as written, \
            FileWatch(tmp_path, "*.pt", "opened", writing=lambda p: p in held) as asked:
        target.read_bytes()
        time.sleep(0.05)
        assert written.poll() == []  # a read is not a save
        assert asked.poll() == []
        handle = open(target, "ab")  # noqa: SIM115  # no truncation, nothing written yet
        time.sleep(0.05)
        assert written.poll() == []  # open, but for what? nothing says yet
        held.append(target)  # what a /proc scan of the run's processes would find
        assert settle(asked, 1) == ["snapshot.pt"]
        handle.write(b"more")
        handle.close()
        assert settle(written, 1) == ["snapshot.pt"]  # its write told
        time.sleep(0.05)
        assert asked.poll() == []  # one open, one count


def test_writers_are_the_processes_holding_the_file_open_for_writing(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.pt"
    target.write_bytes(b"old")
    hold = "import sys, time; f = open(sys.argv[1], sys.argv[2]); print('ok', flush=True); " \
           "time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", hold, str(target), mode],
                              stdout=subprocess.PIPE, text=True) for mode in ("rb", "r+b")]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ok\n"
        reader, writer = (p.pid for p in procs)
        assert file_writers([reader, writer, os.getpid()], target).writers == (writer,)
        assert file_writers([reader], target).writers == ()  # only the processes named
        (tmp_path / "other").write_bytes(b"new")
        os.replace(tmp_path / "other", target)  # a new file under the name: nobody holds it
        assert file_writers([reader, writer], target).writers == ()
        assert file_writers([writer], tmp_path / "missing").writers == ()
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()


def test_a_scanned_file_renamed_away_before_its_own_event_counts_once(tmp_path: Path) -> None:
    """A folder's watch is added before its scan, so a file made in between is taken in by
    the scan and also has its own IN_CREATE queued; a temporary file is often renamed away
    before that event is read. It was counted twice, moving every later `count:` one save
    early. The kernel's interleaving cannot be forced from here, so the queued event is
    handed to the watch as the kernel would deliver it."""
    watch = FileWatch(tmp_path, "step_*/.rank_0.pt.*.tmp", "created")
    try:
        (tmp_path / "step_1").mkdir()
        (tmp_path / "step_1" / ".rank_0.pt.ab.tmp").write_bytes(b"x")
        assert settle(watch, 1) == ["step_1/.rank_0.pt.ab.tmp"]  # the scan of the new folder
        (tmp_path / "step_1" / ".rank_0.pt.ab.tmp").rename(tmp_path / "step_1" / "rank_0.pt")
        (wd,) = [wd for wd, rel in watch._dirs.items() if rel == "step_1"]
        watch._event(wd, _inotify.IN_CREATE, ".rank_0.pt.ab.tmp")
        assert watch.hits == ["step_1/.rank_0.pt.ab.tmp"]
        assert watch.how == ["scanned"]
    finally:
        watch.close()
