"""`heal` never writes through a run folder that was moved, deleted or swapped after a crash,
and says "undone" (exit 0) only when it is.

Each test crashes a real `aftershock run` (its reaper SIGKILLed first, then the harness) with
storage faults in place, changes the run's folders as a hostile or careless user would,
then runs `aftershock heal` and reads the system itself: the victim's files, the journal's
raw file, /proc/self/mountinfo.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import quick_scenario, reaper_of

from aftershock.faults._proc import ProcessRef
from aftershock.faults.heal import heal_journal
from aftershock.faults.journal import Journal, UndoRefused, state_dir
from aftershock.faults.storage import CORRUPT

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

ORIGINAL = b"the checkpoint as it was" * 100
VICTIM = b"someone else's file"


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the issue is heal as root (and storage.full mounts a tmpfs)")


class Crashed:
    """A run killed (reaper first, then harness) once its faults were all applied."""

    def __init__(self, tmp_path: Path, faults: str, applied: int) -> None:
        self.tmp = tmp_path
        self.runs = tmp_path / "runs"
        # The folder the storage faults act in (their `root`): one of the run's folders.
        self.job = tmp_path / "outer" / "job"
        self.state = tmp_path / "state"
        self.env = {**os.environ, "AFTERSHOCK_STATE_DIR": str(self.state)}
        scenario = tmp_path / "crash.yaml"
        faults = faults.replace("${job}", str(self.job))
        scenario.write_text(quick_scenario("swapped", f"faults:\n{faults}", duration=60))
        self.harness = subprocess.Popen(
            [sys.executable, "-m", "aftershock", "run", str(scenario), "--run-dir",
             str(self.runs), "--plain"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env, cwd=ROOT)
        self._wait_applied(applied)
        reaper = reaper_of(self.harness.pid)
        assert reaper is not None, "no reaper"
        os.kill(reaper, signal.SIGKILL)
        self.harness.kill()
        self.harness.wait(timeout=30)

    def _wait_applied(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            failed = [e for e in events if e.get("event") == "fault_failed"]
            assert not failed, failed
            if sum(e.get("event") == "fault_injected" for e in events) >= count:
                return
            assert self.harness.poll() is None, "the harness ended before its faults"
            assert time.monotonic() < deadline, "the faults were never applied"
            time.sleep(0.05)

    def events(self) -> list[dict[str, object]]:
        found = []
        for path in self.runs.glob("*/events.jsonl"):
            lines = path.read_text().splitlines()
            found += [json.loads(line) for line in lines[:-1]]  # the last may be half written
        return found

    def journals(self) -> list[Path]:
        return list((self.state / "journal").glob("*.jsonl"))

    def backups(self) -> list[Path]:
        folder = self.state / "backup"
        return list(folder.iterdir()) if folder.is_dir() else []

    def heal(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aftershock", "heal"], env=self.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture
def crash(tmp_path: Path) -> Iterator[list[Crashed]]:
    _need_root()
    made: list[Crashed] = []
    yield made
    for run in made:  # leave the machine clean, whatever the test did
        if run.harness.poll() is None:
            run.harness.kill()
            run.harness.wait()
        for source in _tmpfs_sources(tmp_path):
            subprocess.run(["umount", "-l", source[1]], capture_output=True, check=False)
        run.heal()


def _tmpfs_sources(under: Path) -> list[tuple[str, str]]:
    """(source, mount point) of every aftershock_ tmpfs mounted under ``under``."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            cols = line.split()
            sep = cols.index("-")
            point = cols[4].replace("\\040", " ")
            if cols[sep + 2].startswith("aftershock_") and point.startswith(str(under)):
                found.append((cols[sep + 2], point))
    return found


def _checkpoints(work: Path, folders: list[str]) -> None:
    """``work/<folder>/a.bin`` and ``b.bin`` for each folder: what the faults hit."""
    for name in folders:
        (work / name).mkdir(parents=True)
        (work / name / "a.bin").write_bytes(ORIGINAL)
        (work / name / "b.bin").write_bytes(ORIGINAL)


def _restorable(folder: str) -> str:
    """A corrupt of ``<folder>/a.bin`` and a delete of ``<folder>/b.bin``, both restorable."""
    return (f"  - {{kind: storage.corrupt, root: '${{job}}', path: {folder}/a.bin, "
            f"restore: true, at: {{step: 2}}}}\n"
            f"  - {{kind: storage.delete, root: '${{job}}', path: {folder}/b.bin, "
            f"restore: true, at: {{step: 2}}}}\n")


def _victim(tmp_path: Path) -> Path:
    """Another folder, as an attacker (or a careless user) would point the run's paths at."""
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    for name in ("a.bin", "b.bin"):
        (victim / name).write_bytes(VICTIM)
    return victim


def _untouched(victim: Path) -> list[str]:
    return [f"{p.name} changed" for p in (victim / "a.bin", victim / "b.bin")
            if not p.exists() or p.read_bytes() != VICTIM]


@pytest.mark.slow
@pytest.mark.parametrize("swapped", ["run folder", "folder above it"])
def test_a_run_folder_swapped_for_a_link_is_refused_and_healed_once_put_back(
    crash: list[Crashed], tmp_path: Path, swapped: str
) -> None:
    """The issue's reproduction: the run folder (or the one above it) is replaced by a link
    to another folder that holds files of the same names."""
    _checkpoints(tmp_path / "outer" / "job", ["ckpt"])
    run = Crashed(tmp_path, _restorable("ckpt"), applied=2)
    crash.append(run)
    victim = _victim(tmp_path)
    link = run.job if swapped == "run folder" else run.job.parent
    target = victim if swapped == "run folder" else tmp_path
    decoy = victim / "ckpt" if swapped == "run folder" else tmp_path / "job" / "ckpt"
    decoy.mkdir(parents=True)
    for name in ("a.bin", "b.bin"):
        (decoy / name).write_bytes(VICTIM)
    moved = link.with_name(link.name + ".moved")
    link.rename(moved)
    link.symlink_to(target)

    healed = run.heal()

    out = healed.stdout
    assert healed.returncode == 2, out + healed.stderr  # refused: nothing failed, not done
    assert _untouched(decoy) == []
    assert out.count("refused") >= 2, out
    assert f"{link} is now a symbolic link to {target}" in out, out
    assert "The original is kept in" in out, out
    assert "aftershock heal` again" in out
    assert run.journals(), "the journal went with entries still pending"
    assert len(run.backups()) == 2

    # The user puts the run folder back: the next heal restores both files and is done.
    link.unlink()
    moved.rename(link)
    again = run.heal()
    assert again.returncode == 0, again.stdout + again.stderr
    assert (run.job / "ckpt" / "a.bin").read_bytes() == ORIGINAL
    assert (run.job / "ckpt" / "b.bin").read_bytes() == ORIGINAL
    assert run.journals() == []
    assert run.backups() == []


@pytest.mark.slow
def test_a_deleted_run_folder_is_reported_and_its_backups_kept(
    crash: list[Crashed], tmp_path: Path
) -> None:
    _checkpoints(tmp_path / "outer" / "job", ["ckpt"])
    run = Crashed(tmp_path, _restorable("ckpt"), applied=2)
    crash.append(run)
    shutil.rmtree(run.job)

    healed = run.heal()

    assert healed.returncode == 2, healed.stdout + healed.stderr
    assert f"{run.job} no longer exists (deleted, or moved away)" in healed.stdout
    assert not run.job.exists()  # not made again to restore into
    assert run.journals()
    assert len(run.backups()) == 2


@pytest.mark.slow
def test_files_and_folders_swapped_inside_the_run_folder_are_each_refused(
    crash: list[Crashed], tmp_path: Path
) -> None:
    """Below the run folder: a folder on the way swapped for a link, one replaced by another
    real folder, the corrupted file replaced by a link, the deleted one made again as a link.
    An untouched pair is restored in the same heal: one refusal does not stop the others."""
    work = tmp_path / "outer" / "job"
    names = ["linked", "replaced", "leaf", "fine"]
    _checkpoints(work, names)
    run = Crashed(tmp_path, "".join(_restorable(n) for n in names), applied=8)
    crash.append(run)
    victim = _victim(tmp_path)
    (work / "linked").rename(work / "linked.old")
    (work / "linked").symlink_to(victim)
    (work / "replaced").rename(work / "replaced.old")
    (work / "replaced").mkdir()
    for name in ("a.bin", "b.bin"):
        (work / "replaced" / name).write_bytes(VICTIM)
    (work / "leaf" / "a.bin").unlink()
    (work / "leaf" / "a.bin").symlink_to(victim / "a.bin")
    (work / "leaf" / "b.bin").symlink_to(victim / "b.bin")

    healed = run.heal()

    out = healed.stdout
    assert healed.returncode == 2, out + healed.stderr
    assert _untouched(victim) == [], out
    assert [p.read_bytes() for p in (work / "replaced" / "a.bin", work / "replaced" / "b.bin")
            ] == [VICTIM, VICTIM]
    assert f"{work / 'linked'} is now a symbolic link to {victim}" in out, out
    assert f"{work / 'replaced'} is another folder than the one the fault acted in" in out
    assert f"{work / 'leaf' / 'a.bin'} is now a symbolic link to {victim / 'a.bin'}" in out, out
    assert (f"{work / 'leaf' / 'b.bin'}, deleted by the fault, is a symbolic link to "
            f"{victim / 'b.bin'} again") in out
    assert (work / "leaf" / "a.bin").is_symlink()  # left as it is, not replaced
    assert (work / "fine" / "a.bin").read_bytes() == ORIGINAL
    assert (work / "fine" / "b.bin").read_bytes() == ORIGINAL
    assert out.count("refused ") == 6, out
    assert run.journals()


def _mounted(source: str) -> list[str]:
    """Where the tmpfs ``source`` is mounted now (by its name, not by a path)."""
    with open("/proc/self/mountinfo") as handle:
        return [line.split()[4] for line in handle
                if f" - tmpfs {source} " in line]


@pytest.mark.slow
def test_a_full_disk_is_unmounted_where_its_folder_moved_to(
    crash: list[Crashed], tmp_path: Path
) -> None:
    """The run folder moved after a crash during storage.full: heal unmounts the tmpfs where
    it is now and exits 0; while it cannot reach it, it says so, exits 1 and keeps the
    journal."""
    (tmp_path / "outer" / "job" / "ckpt").mkdir(parents=True)
    (tmp_path / "outer" / "job" / "ckpt" / "step_1.pt").write_bytes(ORIGINAL)
    run = Crashed(tmp_path, "  - {kind: storage.full, root: '${job}', dir: ckpt, free: 4096, "
                  "at: {step: 2}}\n", applied=1)
    crash.append(run)
    (source,) = {s for s, _ in _tmpfs_sources(tmp_path)}
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / "job"
    run.job.rename(moved)
    assert _mounted(source) == [str(moved / "ckpt")]
    # First it cannot reach it: another mount hides the folder it moved to.
    subprocess.run(["mount", "-t", "tmpfs", "hider", str(tmp_path / "elsewhere")], check=True)
    try:
        blocked = run.heal()
    finally:
        subprocess.run(["umount", str(tmp_path / "elsewhere")], check=True)
    assert blocked.returncode == 1, blocked.stdout + blocked.stderr
    assert "failed" in blocked.stdout
    assert f"still mounted on {moved / 'ckpt'}" in blocked.stdout, blocked.stdout
    assert _mounted(source), "unmounted after all?"
    assert run.journals(), "the journal went while the tmpfs stayed mounted"

    healed = run.heal()

    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert _mounted(source) == []
    assert run.journals() == []
    assert (moved / "ckpt" / "step_1.pt").read_bytes() == ORIGINAL
    assert not any((run.state / "storage").iterdir())


def test_a_file_the_system_replaced_itself_is_not_overwritten(tmp_path: Path) -> None:
    """The same check at the end of a live run: the revert names the file and keeps the
    backup rather than clobbering what the system wrote since."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_1.pt").write_bytes(ORIGINAL)
    journal = Journal.create("run-replaced", folders=[run])
    applied = CORRUPT.inject(ProcessRef(os.getpid(), 0),
                             {"root": str(run), "path": "*.pt", "restore": True}, journal)
    newer = run / "step_1.pt.tmp"
    newer.write_bytes(b"saved again by the system")
    newer.rename(run / "step_1.pt")
    with pytest.raises(UndoRefused, match="is now a file, not the file the fault changed"):
        CORRUPT.revert(applied.undo)
    assert (run / "step_1.pt").read_bytes() == b"saved again by the system"
    assert Path(applied.undo["backup"]).read_bytes() == ORIGINAL


def test_a_restore_recorded_without_identities_is_refused(tmp_path: Path) -> None:
    """A record of an older Aftershock (path and backup only) is never written through."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_1.pt").write_bytes(VICTIM)
    backup = state_dir() / "backup" / "0123456789ab" / "step_1.pt"
    backup.parent.mkdir(parents=True)
    backup.write_bytes(ORIGINAL)
    journal = Journal.create("run-old", folders=[run])
    journal.intend("storage.corrupt", {"path": str(run / "step_1.pt"), "backup": str(backup)})
    (healed,) = heal_journal(journal.path)
    assert healed.outcome == "refused"
    assert "recorded without the identity of its folders" in str(healed.reason)
    assert (run / "step_1.pt").read_bytes() == VICTIM
    assert journal.path.exists()
