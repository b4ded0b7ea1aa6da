"""File triggers: inotify through libc sees files appear, close and go, at any folder depth a
pattern reaches, including folders (and a root) that appear after the watch began."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest

from faults import _inotify
from faults._errors import FaultUnavailable
from faults._inotify import FileWatch, matches

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
