"""storage.* refuses the harness's own records at the moment of the fault (links included),
and fails, naming what it looked for, when it finds nothing to act on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal
from aftershock.faults.storage import (
    CORRUPT,
    DELETE,
    FULL,
    LOSE_UNSYNCED,
    TRUNCATE,
    HarnessRecord,
    NothingToActOn,
)

ME = ProcessRef(os.getpid(), 0)  # storage faults act on files, not on the process

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder: the timeline, logs, and the job's own folder."""
    folder = tmp_path / "run"
    (folder / "logs").mkdir(parents=True)
    (folder / "work").mkdir()
    (folder / "events.jsonl").write_text('{"t":1,"event":"launch"}\n')
    (folder / "logs" / "rank0.log").write_text("step 1\n")
    (folder / "work" / "data.bin").write_bytes(bytes(range(256)))
    return folder


def _guarded(run: Path) -> list[str]:
    return [str(run / "events.jsonl"), str(run / "logs")]


def test_a_fault_that_resolves_into_a_record_is_refused(run: Path, tmp_path: Path) -> None:
    journal = Journal.create("guard", tmp_path)
    before = (run / "events.jsonl").read_bytes()
    with pytest.raises(HarnessRecord, match=r"events\.jsonl"):
        CORRUPT.inject(ME, {"root": str(run), "path": "events.jsonl",
                            "guarded": _guarded(run)}, journal)
    with pytest.raises(HarnessRecord, match="logs"):
        TRUNCATE.inject(ME, {"root": str(run), "path": "logs/*.log",
                             "guarded": _guarded(run)}, journal)
    with pytest.raises(HarnessRecord, match="logs"):
        DELETE.inject(ME, {"root": str(run), "path": "log*", "guarded": _guarded(run)},
                      journal)
    assert (run / "events.jsonl").read_bytes() == before
    assert (run / "logs" / "rank0.log").read_text() == "step 1\n"


def test_a_link_to_a_record_is_refused(run: Path, tmp_path: Path) -> None:
    """The job's folder may hold a link into the run folder: the fault follows it and
    refuses."""
    (run / "work" / "timeline").symlink_to(run / "events.jsonl")
    journal = Journal.create("link", tmp_path)
    before = (run / "events.jsonl").read_bytes()
    with pytest.raises(HarnessRecord, match=r"events\.jsonl"):
        CORRUPT.inject(ME, {"root": str(run / "work"), "path": "timeline",
                            "guarded": _guarded(run)}, journal)
    (run / "work" / "hard").hardlink_to(run / "events.jsonl")
    with pytest.raises(HarnessRecord, match=r"a link to .*events\.jsonl"):
        TRUNCATE.inject(ME, {"root": str(run / "work"), "path": "hard",
                             "guarded": _guarded(run)}, journal)
    assert (run / "events.jsonl").read_bytes() == before


def test_a_folder_that_holds_a_record_is_refused(run: Path, tmp_path: Path) -> None:
    journal = Journal.create("folder", tmp_path)
    with pytest.raises(HarnessRecord, match=r"events\.jsonl"):
        FULL.inject(ME, {"root": str(run), "dir": ".", "guarded": _guarded(run)}, journal)
    with pytest.raises(HarnessRecord, match=r"lies under .*logs"):
        FULL.inject(ME, {"root": str(run), "dir": "logs/sub", "guarded": _guarded(run)}, journal)
    # Refused before its filesystem is started: no FUSE needed to see it.
    with pytest.raises(HarnessRecord, match=r"holds .*events\.jsonl"):
        LOSE_UNSYNCED.prepare({"root": str(run), "dir": ".", "guarded": _guarded(run)},
                              journal)
    assert (run / "events.jsonl").exists()


def test_the_job_s_own_files_are_hit_and_named(run: Path, tmp_path: Path) -> None:
    journal = Journal.create("own", tmp_path)
    applied = CORRUPT.inject(ME, {"root": str(run / "work"), "path": "*.bin",
                                  "guarded": _guarded(run)}, journal)
    assert str(run / "work" / "data.bin") in applied.detail
    (run / "work" / "ckpt").mkdir()
    (run / "work" / "ckpt" / "a.pt").write_bytes(b"a")
    (run / "work" / "ckpt" / "b.pt").write_bytes(b"b")
    applied = DELETE.inject(ME, {"root": str(run / "work"), "path": "ckpt",
                                 "guarded": _guarded(run)}, journal)
    assert "a.pt" in applied.detail
    assert "b.pt" in applied.detail


def test_nothing_to_act_on_fails_with_what_it_looked_for(run: Path, tmp_path: Path) -> None:
    journal = Journal.create("nothing", tmp_path)
    work = run / "work"
    with pytest.raises(NothingToActOn, match=r"no file matches 'ckpt/\*\.pt' under .*work"):
        CORRUPT.inject(ME, {"root": str(work), "path": "ckpt/*.pt"}, journal)
    (work / "empty.pt").write_bytes(b"")
    with pytest.raises(NothingToActOn, match=r"empty\.pt is empty"):
        CORRUPT.inject(ME, {"root": str(work), "path": "empty.pt"}, journal)
    with pytest.raises(NothingToActOn, match="offset 4096 is past the end"):
        CORRUPT.inject(ME, {"root": str(work), "path": "data.bin", "offset": 4096}, journal)
    with pytest.raises(NothingToActOn, match="already 256 bytes"):
        TRUNCATE.inject(ME, {"root": str(work), "path": "data.bin", "size": 1000}, journal)
    assert (work / "data.bin").read_bytes() == bytes(range(256))
