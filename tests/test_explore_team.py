"""``aftershock explore --workers N``: N searchers side by side on this machine share one
hypothesis example database (harness/search/team.py). The failure the first one confirms is
shrunk by it alone, replayed by the other from the database, and comes out as a lone
explore of the same seed gives it; Ctrl-C, SIGTERM or the harness's death leave no searcher
and no job behind.

The job is tests/fixtures/explore_job.py (torch-free): it survives one kill at a time and
gives up on a second during a recovery, so every search shrinks to one schedule, both ranks
killed at step 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import ROOT, check_team_found_as_alone, explore_job_scenario


def _scenario(duration: float) -> str:
    return explore_job_scenario("team-explore", duration=duration, timeout="60s")


SEARCH = ["--seed", "5", "--runs", "30", "--shrink-runs", "12", "--plain"]


def _aftershock(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aftershock", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _mentioning(text: str) -> list[int]:
    """Live processes (zombies aside) whose command line or environment names ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in seen:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(600)
def test_two_searchers_side_by_side_shrink_what_a_lone_explore_does_and_share_it(
        tmp_path: Path) -> None:
    scenario = tmp_path / "job.yaml"
    scenario.write_text(_scenario(2))
    alone = _aftershock("explore", str(scenario), *SEARCH, "--out", str(tmp_path / "alone"),
                        "--db", str(tmp_path / "alone-db"), "--json", str(tmp_path / "a.json"))
    both = _aftershock("explore", str(scenario), *SEARCH, "--workers", "2",
                       "--out", str(tmp_path / "team"), "--db", str(tmp_path / "db"),
                       "--json", str(tmp_path / "t.json"))
    assert alone.returncode == 1, alone.stdout[-3000:] + alone.stderr[-2000:]
    assert both.returncode == 1, both.stdout[-3000:] + both.stderr[-2000:]
    (lone,) = json.loads((tmp_path / "a.json").read_text())
    (team,) = json.loads((tmp_path / "t.json").read_text())
    # The same shrunk schedule as alone, shrunk by one searcher only.
    _, other, replayed, failed_first = check_team_found_as_alone(
        team, lone, said=both.stdout, written=tmp_path / "team" / "team-explore-found.yaml",
        seed=5)
    assert "2 searchers side by side" in both.stdout
    # Every run is shown as it ends, with the searcher that ran it.
    attempts = team["attempts"]
    assert both.stdout.count("searcher 1 run ") == sum(a["searcher"] == 1 for a in attempts)
    # Searcher 0 drew the lone explore's schedules, in its order, as far as it searched.
    mine = [a["schedule"] for a in attempts if a["searcher"] == 0 and a["stage"] == "search"]
    assert mine == [a["schedule"] for a in lone["attempts"][:len(mine)]]
    # The other searcher stopped when the failure was claimed; what it replayed from the
    # shared database, if it got there, is a schedule that failed for the first.
    assert other["stopped"] in ("replayed", "found"), other
    assert replayed <= failed_first
    assert not _mentioning(str(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("signum", "group"), [
    (signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False),
    (signal.SIGKILL, False)], ids=["sigint", "ctrl-c", "sigterm", "sigkill"])
def test_a_stopped_or_killed_harness_leaves_no_searcher_and_no_job(
        tmp_path: Path, signum: int, group: bool) -> None:
    """SIGINT or SIGTERM to the harness, or Ctrl-C at its terminal (SIGINT to its process
    group), while both searchers run: it stops them, each unwinds its run and writes its
    record, and it exits 130 or 143 with both interrupted and each run counted once.
    SIGKILL: the searchers die with it and unwind their runs themselves."""
    scenario = tmp_path / "job.yaml"
    scenario.write_text(_scenario(6))
    out = tmp_path / "out"
    harness = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "explore", str(scenario), "--seed", "9",
         "--runs", "30", "--plain", "--workers", "2", "--no-db", "--out", str(out),
         "--json", str(tmp_path / "t.json")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # Both searchers in their second run: each has a run to report, once.
        while len(list(out.glob("team/*/searcher-*/runs/*/002-*/events.jsonl"))) < 2:
            assert harness.poll() is None, harness.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the searchers did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # the jobs are running
        assert len(_mentioning(str(out))) >= 6  # two searchers, two jobs of three processes
        if group:
            os.killpg(harness.pid, signum)
        else:
            harness.send_signal(signum)
        said, _ = harness.communicate(timeout=120)
        if signum == signal.SIGKILL:
            assert harness.returncode == -signal.SIGKILL
        else:
            assert harness.returncode == (130 if signum == signal.SIGINT else 143), said[-3000:]
            assert "interrupted" in said
            (team,) = json.loads((tmp_path / "t.json").read_text())
            assert [s["stopped"] for s in team["searchers"]] == ["interrupted", "interrupted"]
            runs = [(a["searcher"], a["index"]) for a in team["attempts"]]
            assert len(runs) == len(set(runs)), runs
        gone_by = time.monotonic() + 60
        while _mentioning(str(out)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not _mentioning(str(out))
        # --no-db: the database the searchers shared is not kept.
        assert not list(out.glob("team/*/hypothesis"))
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=30)
