"""``aftershock explore --executor slurm --workers N``: N searchers as the tasks of one Slurm
array job share one hypothesis example database (harness/nodes/slurm_explore.py). The
failure the first one confirms is shrunk by it alone, replayed by the others from the
database, and comes out as a local explore of the same seed gives it.

The job is tests/fixtures/explore_job.py (torch-free, a second or two a run): it survives
one kill at a time and gives up on a second during a recovery, so every search shrinks to
one schedule, both ranks killed at step 1 (runs of 1.2 s missed steps on a loaded machine
and were discarded: 2 s here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import check_team_found_as_alone, explore_job_scenario
from hypothesis.database import InMemoryExampleDatabase

from aftershock.faults import slurm_cli as _slurm
from aftershock.harness.search.team import FileTeam, searcher_seeds

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = explore_job_scenario("slurm-explore", duration=2)
# A narrow space (kills at steps 1 to 3): found at the 8th schedule, shrunk in a few runs,
# while the other searcher is still searching.
SEARCH = ["--seed", "5", "--runs", "30", "--shrink-runs", "12", "--plain"]


def _aftershock(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aftershock", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_two_searchers_on_slurm_shrink_what_a_local_explore_does_and_share_it(
        test_cluster: None, tmp_path: Path) -> None:
    scenario = tmp_path / "job.yaml"
    scenario.write_text(SCENARIO)
    here = _aftershock("explore", str(scenario), *SEARCH, "--out", str(tmp_path / "local"),
                       "--db", str(tmp_path / "local-db"), "--json", str(tmp_path / "l.json"))
    there = _aftershock("explore", str(scenario), *SEARCH, "--executor", "slurm",
                        "--workers", "2", "--out", str(tmp_path / "slurm"),
                        "--db", str(tmp_path / "db"), "--json", str(tmp_path / "s.json"),
                        # About 70 s of searching, after whatever wait for two whole nodes
                        # other users' jobs on the shared test cluster make.
                        timeout=480)
    assert here.returncode == 1, here.stdout[-3000:] + here.stderr[-2000:]
    assert there.returncode == 1, there.stdout[-3000:] + there.stderr[-2000:]
    (local,) = json.loads((tmp_path / "l.json").read_text())
    (team,) = json.loads((tmp_path / "s.json").read_text())
    # The same shrunk schedule as a local explore, shrunk by one searcher only.
    shrank, other, replayed, failed_first = check_team_found_as_alone(
        team, local, said=there.stdout, written=tmp_path / "slurm" / "slurm-explore-found.yaml",
        seed=5)
    assert "array job" in there.stdout
    # The other searcher replayed, from the shared database, a value the first one saved
    # there: a schedule that failed for the first, and failed on the other's node too.
    assert other["stopped"] == "replayed", other
    assert other["replays_failed"] >= 1, other
    shared = set(other["read"]) & set(shrank["saved"])
    assert shared, (other["read"], shrank["saved"])
    kept = {p.name for p in (tmp_path / "db").rglob("*") if p.is_file()}
    assert shared <= kept
    assert replayed
    assert replayed <= failed_first
    # The array job is gone from the queue.
    name = there.stdout.split("array job ", 1)[1].split("(", 1)[1].split(")", 1)[0]
    assert not _slurm.live_jobs(name)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_ctrl_c_leaves_no_searcher_in_the_queue(test_cluster: None, tmp_path: Path) -> None:
    """Ctrl-C while both searchers run: the array job is cancelled and waited for, each
    searcher writes its record on Slurm's SIGTERM, and the harness exits 130."""
    scenario = tmp_path / "job.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    harness = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "explore", str(scenario), "--seed", "9",
         "--runs", "30", "--plain", "--executor", "slurm", "--workers", "2", "--out",
         str(out), "--db", str(tmp_path / "db"), "--json", str(tmp_path / "s.json")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 420  # after other users' jobs on the shared cluster
        while len(list(out.glob("slurm/*/searcher-*/runs/*/001-search"))) < 2:
            assert harness.poll() is None, harness.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the searchers did not start"
            time.sleep(0.5)
        harness.send_signal(signal.SIGINT)
        said, _ = harness.communicate(timeout=180)
        assert harness.returncode == 130, said[-3000:]
        name = said.split("array job ", 1)[1].split("(", 1)[1].split(")", 1)[0]
        assert "interrupted" in said
        assert not [j for j in _ours() if j.startswith(name)]
        (team,) = json.loads((tmp_path / "s.json").read_text())
        assert [s["stopped"] for s in team["searchers"]] == ["interrupted", "interrupted"]
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)


def _ours() -> list[str]:
    text = _slurm.run(["squeue", "--noheader", "--format=%j %i %T"])
    return [line for line in text.splitlines() if line.startswith(_slurm.JOB_PREFIX)]


@pytest.mark.parametrize("clients", ["installed", "missing"])
def test_explore_on_slurm_without_a_cluster_is_one_line_and_exit_2(
        tmp_path: Path, clients: str) -> None:
    """Whatever this machine has: its Slurm clients are stand-ins that fail if called (the
    check must not call them without a configuration), or none is on PATH at all."""
    scenario = tmp_path / "job.yaml"
    scenario.write_text(SCENARIO)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if clients == "installed":
        for program in ("sbatch", "squeue", "scontrol", "scancel", "sinfo"):
            stand_in = bin_dir / program
            stand_in.write_text("#!/bin/sh\necho called >&2\nexit 1\n")
            stand_in.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])
    proc = subprocess.run(
        [sys.executable, "-m", "aftershock", "explore", str(scenario), "--executor", "slurm",
         "--workers", "2", "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SLURM_CONF": str(tmp_path / "none"),
             "PATH": path})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = {
        "installed": f"--executor slurm: no Slurm configuration at {tmp_path / 'none'} "
                     "(SLURM_CONF): start a test cluster with `make slurm-cluster`",
        "missing": "--executor slurm: Slurm's `sbatch` is not installed (apt-get install "
                   "slurm-client; `make slurm-cluster` installs a test cluster)",
    }[clients]
    assert proc.stderr.strip().splitlines() == [said]
    assert not list((tmp_path / "out").rglob("*.yaml"))  # nothing ran


def test_searcher_seeds_start_at_the_users_and_are_distinct() -> None:
    seeds = searcher_seeds(2**32 - 1, 1000)
    assert seeds[0] == 2**32 - 1
    assert len(set(seeds)) == 1000
    assert all(0 <= s < 2**32 for s in seeds)
    assert searcher_seeds(7, 3)[1] not in (6, 8)  # not the seed a user tries next


def test_only_the_first_searcher_to_claim_a_failure_shrinks_it(tmp_path: Path) -> None:
    first, second = FileTeam(tmp_path, 0), FileTeam(tmp_path, 1)
    assert not first.claimed_elsewhere()
    assert not second.claimed_elsewhere()
    assert second.claim()
    assert not first.claim()
    assert first.claimed_elsewhere()
    assert not second.claimed_elsewhere()
    # What goes through the shared database is noted: the other's value read, not saved.
    db: Any = InMemoryExampleDatabase()
    mine, theirs = second.share(db), first.share(db)
    mine.save(b"k", b"failing")
    assert list(theirs.fetch(b"k")) == [b"failing"]
    assert first.ledger is not None
    assert second.ledger is not None
    assert first.ledger.read == second.ledger.saved
    assert first.ledger.saved == []
    # Nor does a searcher read back what it saved itself: it replays the others' failures.
    assert list(mine.fetch(b"k")) == []


def test_a_searcher_that_sees_a_claim_replays_the_failure_and_does_not_shrink(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The team on a stand-in runner (tests/test_explore.py), one searcher after the other:
    the first confirms, claims and shrinks a failure; the second, seeing the claim at its
    first run, searches no further and replays the first one's failure from the database."""
    from test_explore import BASE, second_fault_during_recovery, stand_in

    from aftershock.harness.scenario.load import load_scenario
    from aftershock.harness.search.explore import explore

    path = tmp_path / "stand-in.yaml"
    path.write_text(BASE)
    base = load_scenario(path)
    database = tmp_path / "db"
    first, second = FileTeam(tmp_path, 0), FileTeam(tmp_path, 1)
    stand_in(monkeypatch, second_fault_during_recovery)
    found = explore(base, runs=40, seed=0, database=database, out=tmp_path / "a", team=first)
    assert [f.status for f in found.findings] == ["confirmed"]
    assert first.claimed
    assert found.count("shrink") > 0
    fake = stand_in(monkeypatch, second_fault_during_recovery)
    other = explore(base, runs=40, seed=1, database=database, out=tmp_path / "b", team=second)
    assert other.stopped == "replayed"
    assert not other.findings
    assert other.count("search") == other.count("shrink") == 0
    replays = [a for a in other.attempts if a.stage == "replay"]
    assert replays
    assert replays[0].verdict == "fail"
    # A failure of the first searcher's, as hypothesis saved it while shrinking.
    assert replays[0].schedule in {a.schedule for a in found.attempts if a.verdict == "fail"}
    assert fake.ran[0] == replays[0].schedule
    assert second.ledger is not None
    assert first.ledger is not None
    assert set(second.ledger.read) <= set(first.ledger.saved)
    assert second.ledger.read
