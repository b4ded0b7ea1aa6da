"""Reading a run folder costs memory bounded by what is shown, not by what is there, and
follows no link out of the folder.

`report --recheck` on a run with a 1 GiB log used 3.5 GB and `report --html` 3.2 GB; a
`.times` file linked to /dev/zero grew until MemoryError; a log that was a link to a
private file elsewhere was embedded in the HTML page (issue 48).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _helpers import bounded_cli

GIB = 1 << 30
LAST = "[0]:step 2 the last line a crash would explain"


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    t0 = 1000.0
    scenario = f"""\
name: big
system:
  command: [{sys.executable}, -c, pass]
  world: 1
  probes:
    - {{pattern: '^\\[\\d\\]:step (?P<step>\\d+)', event: step}}
expect:
  completes: true
"""
    (run / "scenario.yaml").write_text(scenario)
    events = [
        {"t": t0, "event": "launch", "source": "harness", "argv": ["x"], "phase": "run",
         "seed": 0},
        {"t": t0 + 3.5, "event": "run_end", "source": "harness", "exit_code": 0,
         "timed_out": False},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = {"name": "big", "file": str(run / "scenario.yaml"), "passed": True, "seed": 0,
              "duration_s": 3.5, "metrics": {}, "run_dir": str(run),
              "checks": [{"name": "completes", "passed": True, "observed": "exit 0",
                          "expected": "exit 0", "message": "exited 0"}],
              "faults": []}
    (run / "result.json").write_text(json.dumps(result))
    return run


@pytest.mark.timeout(180)
def test_a_one_gib_log_and_a_times_file_linked_to_dev_zero_stay_bounded(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    log = run / "logs" / "launcher.stdout.log"
    with open(log, "wb") as handle:  # sparse: 1 GiB of NUL "line", then real lines
        handle.write(b"[0]:step 1\n")
        handle.truncate(GIB)
        handle.seek(GIB)
        handle.write(f"\n{LAST}\n".encode())
    (run / "logs" / "launcher.stderr.log").write_text("")
    os.symlink("/dev/zero", run / "logs" / "launcher.stdout.log.times")
    page = tmp_path / "page.html"
    shown = bounded_cli("report", str(run), "--html", str(page), cpu_s=60, wall_s=150)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert shown.max_rss_mb < 200, shown.max_rss_mb
    assert LAST in page.read_text()
    again = bounded_cli("report", str(run), "--recheck", cpu_s=60, wall_s=150)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.max_rss_mb < 200, again.max_rss_mb


def test_a_log_linked_out_of_the_run_folder_is_named_not_followed(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    secret = tmp_path / "private.txt"
    secret.write_text("TOPSECRET-TOKEN\n")
    (run / "logs" / "launcher.stderr.log").write_text("")
    os.symlink(secret, run / "logs" / "launcher.stdout.log")
    os.symlink(secret, run / "logs" / "rank0.log")
    page = tmp_path / "page.html"
    shown = bounded_cli("report", str(run), "--html", str(page), cpu_s=30, wall_s=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    text = page.read_text()
    assert "TOPSECRET" not in text
    assert "rank0.log" in text
    assert "a link out of the run folder, not followed" in text
    again = bounded_cli("report", str(run), "--recheck", cpu_s=30, wall_s=60)
    assert "TOPSECRET" not in again.stdout + again.stderr
