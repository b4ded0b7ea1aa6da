"""A run folder used again (`--run-dir` twice) starts clean: nothing the previous run or
its system wrote there reaches the next. A server that found the last run's journal in
`output/` answered every request from it and computed nothing ("recovery not observed");
a trainer that found the last run's `checkpoints/` would resume from them.

A folder the harness did not make is never emptied: only what a run writes is removed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import cli

pytestmark = pytest.mark.timeout(120)

# The job fails if anything of an earlier run is where it writes (its output folder, the
# checkpoint folder under the run folder, its TMPDIR), then leaves something in each.
JOB = """\
import os, sys
from pathlib import Path
run = Path(sys.argv[1])
places = [Path(os.environ["AFTERSHOCK_OUTPUT_DIR"]), run / "checkpoints",
          Path(os.environ["TMPDIR"])]
stale = [str(p) for p in places if p.is_dir() and any(p.iterdir())]
if stale:
    print("stale:", stale)
    sys.exit(1)
for p in places:
    p.mkdir(parents=True, exist_ok=True)
    (p / "left.txt").write_text("from an earlier run")
"""


def run(tmp_path: Path, runs: Path) -> tuple[int, str]:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: again\nsystem:\n  command: [{sys.executable}, {job}, "
                        "'${run_dir}']\nexpect:\n  completes: true\n")
    out = tmp_path / "out.json"
    proc = cli("run", str(scenario), "--run-dir", str(runs), "--plain", "--json", str(out),
               timeout=100)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_reused_run_folder_starts_clean(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, said = run(tmp_path, runs)
    assert first == 0, said
    assert (runs / "again" / "output" / "left.txt").exists()
    second, said = run(tmp_path, runs)
    assert second == 0, said
    assert "stale" not in said
    record = json.loads((runs / "again" / "result.json").read_text())
    assert record["passed"]


def test_a_folder_the_harness_did_not_make_keeps_what_it_holds(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    mine = runs / "again"
    (mine / "output").mkdir(parents=True)
    (mine / "output" / "precious.txt").write_text("the user's")
    for _ in range(2):  # nor once a run has used it
        code, said = run(tmp_path, runs)
        # The user's file is kept, so the job sees it and fails: the harness did not guess.
        assert code == 1, said
        assert (mine / "output" / "precious.txt").read_text() == "the user's"
