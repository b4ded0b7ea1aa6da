"""`aftershock report RUN_DIR --recheck`: a fixed probe or budget re-judges a saved run, and
nothing is launched to do it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import cli, quick_scenario

from aftershock.harness.errors import SpecError
from aftershock.harness.verdict.recheck import recheck

BROKEN_STEP = r"rank (?P<rank>\d+) step (?P<step>\d)"  # one digit: step 12 reads as 1
FIXED_STEP = r"rank (?P<rank>\d+) step (?P<step>\d+)"


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to run something (a target, the fault-free twin) fails the test."""
    import aftershock.harness.run.runner
    import aftershock.harness.run.target

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a re-check launched something")

    monkeypatch.setattr(aftershock.harness.run.runner, "execute", refuse)
    monkeypatch.setattr(aftershock.harness.run.target.LocalTarget, "start", refuse)


def _scenario(tmp_path: Path, name: str, step_pattern: str, expect: str) -> Path:
    # The whole step pattern is replaced: the broken one must still match steps 10 and on
    # (reading them as 1), not stop matching them.
    text = re.sub(r"pattern: '.*'", lambda _: f"pattern: '{step_pattern}'",
                  quick_scenario(name, expect, duration=1.2), count=1)
    assert step_pattern in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_a_fixed_probe_turns_a_failed_check_into_a_pass(tmp_path: Path, no_launch: None) -> None:
    """The recheck itself runs in this process, where launching anything fails the test; the
    saved run is made the way a user makes one."""
    expect = "expect:\n  lost_steps: {max: 0}\n"
    broken = _scenario(tmp_path, "recheck-steps", BROKEN_STEP, expect)
    run = cli("run", str(broken), "--run-dir", str(tmp_path / "runs"), "--json",
              str(tmp_path / "run.json"))
    assert run.returncode == 1, run.stdout + run.stderr
    (record,) = json.loads((tmp_path / "run.json").read_text())
    lost = next(c for c in record["checks"] if c["name"] == "lost_steps")
    assert not lost["passed"]
    assert lost["observed"] > 0  # steps 10, 11, ... read as 1
    run_dir = Path(record["run_dir"])
    saved = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    (tmp_path / "fixed").mkdir()
    fixed = _scenario(tmp_path / "fixed", "recheck-steps", FIXED_STEP, expect)
    again = recheck(run_dir, scenario=fixed)
    assert again.result.passed, again.result.checks
    assert next(c for c in again.result.checks if c.name == "lost_steps").observed == 0
    assert ("lost_steps", "FAIL", "PASS") in again.changed()
    # The steps came back at the times the live probe read their lines, not made up.
    assert again.result.metrics["steps_committed"] is not None
    assert again.result.metrics["steps_committed"] >= 10
    # Without --scenario it is the recorded (broken) probe again: still failing.
    assert not recheck(run_dir).result.passed

    # The same through the command line: exit 0, the change named, the run folder untouched.
    shown = cli("report", str(run_dir), "--recheck", "--scenario", str(fixed))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "lost_steps" in shown.stdout
    assert "FAIL -> PASS" in shown.stdout
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == saved


def _hand_made_run(tmp_path: Path, *, times: bool, probe: str) -> tuple[Path, Path]:
    """A command run whose rank 1 printed 'lost peer' 0.4 s after the fault, recorded with a
    failure probe that never matched it."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    t0 = 1000.0
    lines = [(t0 + 0.5, "[0]:step 1"), (t0 + 1.0, "[1]:step 1"), (t0 + 2.4, "[1]:lost peer"),
             (t0 + 3.0, "[0]:step 2")]
    log = "".join(text + "\n" for _, text in lines)
    (run / "logs" / "launcher.stdout.log").write_text(log)
    (run / "logs" / "launcher.stderr.log").write_text("")
    if times:
        offset, rows = 0, []
        for t, text in lines:
            rows.append(f"{offset} {t}\n")
            offset += len(text) + 1
        (run / "logs" / "launcher.stdout.log.times").write_text("".join(rows))
    scenario = f"""\
name: hand-made
system:
  command: [{sys.executable}, -c, pass]
  world: 2
  probes:
    - {{pattern: '^\\[\\d\\]:step (?P<step>\\d+)', event: step}}
    - {{pattern: '{probe}', event: failure_detected}}
faults:
  - kind: process.kill
    target: {{rank: 1}}
    at: {{time: 2s}}
expect:
  time_to_detect: {{max: 1s}}
"""
    (run / "scenario.yaml").write_text(scenario)
    events = [
        {"t": t0, "event": "launch", "source": "harness", "argv": ["x"], "phase": "run",
         "seed": 0},
        {"t": t0 + 0.5, "event": "step", "source": "log", "step": 1, "rank": 0,
         "line": "[0]:step 1"},
        {"t": t0 + 1.0, "event": "step", "source": "log", "step": 1, "rank": 1,
         "line": "[1]:step 1"},
        {"t": t0 + 2.0, "event": "fault_injected", "source": "harness", "kind": "process.kill",
         "rank": 1, "pid": 5, "detail": "SIGKILL -> pid 5", "fault": 0},
        {"t": t0 + 3.0, "event": "step", "source": "log", "step": 2, "rank": 0,
         "line": "[0]:step 2"},
        {"t": t0 + 3.5, "event": "run_end", "source": "harness", "exit_code": 0,
         "timed_out": False},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = {
        "name": "hand-made", "file": str(run / "scenario.yaml"), "passed": False, "seed": 0,
        "duration_s": 3.5, "metrics": {}, "run_dir": str(run),
        "checks": [{"name": "time_to_detect", "passed": False, "observed": None,
                    "expected": "<= 1s", "message": "detection was never observed"}],
        "faults": [{"kind": "process.kill", "target": "rank 1", "injected_at_s": 2.0,
                    "healed_at_s": None, "detail": "SIGKILL -> pid 5"}],
    }
    (run / "result.json").write_text(json.dumps(result))
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(scenario.replace(probe, "lost peer"))
    return run, fixed


def test_capture_times_time_the_lines_a_fixed_probe_now_matches(tmp_path: Path,
                                                               no_launch: None) -> None:
    run, fixed = _hand_made_run(tmp_path, times=True, probe="lost pier")
    again = recheck(run, scenario=fixed)
    detect = next(c for c in again.result.checks if c.name == "time_to_detect")
    assert detect.passed, detect
    assert detect.observed == pytest.approx(0.4)
    assert not again.notes


def test_a_match_without_a_capture_time_is_not_guessed(tmp_path: Path, no_launch: None) -> None:
    """The run kept no capture times and the old probe never matched the line: its time is
    unknown, so detection stays unobserved rather than placed somewhere convenient."""
    run, fixed = _hand_made_run(tmp_path, times=False, probe="lost pier")
    again = recheck(run, scenario=fixed)
    detect = next(c for c in again.result.checks if c.name == "time_to_detect")
    assert not detect.passed
    assert detect.observed is None
    assert any("no recorded capture time" in n for n in again.notes)


def test_a_scenario_that_changes_what_ran_is_refused(tmp_path: Path, no_launch: None) -> None:
    run, fixed = _hand_made_run(tmp_path, times=True, probe="lost pier")
    fixed.write_text(fixed.read_text().replace("at: {time: 2s}", "at: {time: 3s}"))
    with pytest.raises(SpecError, match="changes what was run"):
        recheck(run, scenario=fixed)


def test_a_baseline_that_is_not_cached_is_reported_not_rerun(
    tmp_path: Path, no_launch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "empty-cache"))
    run, fixed = _hand_made_run(tmp_path, times=True, probe="lost pier")
    text = fixed.read_text().replace(
        "    - {pattern: 'lost peer', event: failure_detected}",
        "    - {pattern: 'lost peer', event: failure_detected}\n"
        "    - {pattern: 'digest (?P<digest>\\w+)', event: params}",
    ).replace("expect:\n", "expect:\n  params_match: fault_free\n")
    fixed.write_text(text)
    again = recheck(run, scenario=fixed)
    match = next(c for c in again.result.checks if c.name == "params_match")
    assert not match.passed
    assert "not available" in match.message


PER_RANK_FILES = """\
import os, subprocess, sys, time
if len(sys.argv) > 1:  # a rank: its own file, as torchrun --redirects=3 lays them out
    folder = os.path.join(os.environ["OUT"], "attempt_0", sys.argv[1])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "stdout.log"), "w", buffering=1) as own:
        for step in range(15):
            own.write(f"epoch {step} loss 0.5\\n")
            time.sleep(0.02)
else:
    ranks = [subprocess.Popen([sys.executable, __file__, str(r)]) for r in (0, 1)]
    sys.exit(max(p.wait() for p in ranks))
"""


def _per_rank_scenario(folder: Path, step: str) -> Path:
    path = folder / "files.yaml"
    path.write_text(f"""\
name: files
system:
  command: [{sys.executable}, job.py]
  env: {{OUT: '${{run_dir}}/ranks'}}
  world: 2
  logs: ['${{run_dir}}/ranks/**/stdout.log']
  probes: [{{pattern: 'epoch (?P<step>{step}) loss', event: step, stream: logs}}]
expect: {{completes: true}}
""")
    return path


@pytest.mark.slow
def test_a_recheck_re_reads_the_per_process_log_files(tmp_path: Path) -> None:
    """`report --recheck` re-read the launcher's pipes only: a fixed probe over `logs:`
    files found nothing, and every step the broken probe had read was dropped."""
    (tmp_path / "job.py").write_text(PER_RANK_FILES)
    broken = _per_rank_scenario(tmp_path, r"\d")  # steps 10-14 read as 1
    run_dir = tmp_path / "run"
    from aftershock.harness.run.runner import run_scenario
    from aftershock.harness.scenario.load import load_scenario
    first = run_scenario(load_scenario(broken), run_dir=run_dir)
    assert first.metrics["steps_committed"] == 9
    (tmp_path / "fixed").mkdir()
    (tmp_path / "fixed" / "job.py").write_text(PER_RANK_FILES)
    fixed = _per_rank_scenario(tmp_path / "fixed", r"\d+")
    again = recheck(run_dir, scenario=fixed)
    assert again.result.passed, again.result.checks
    assert again.result.metrics["steps_committed"] == 14
    steps = [e for e in again.events if e.event == "step"]
    assert sorted((e.rank, e.fields["step"]) for e in steps) == [
        (rank, step) for rank in (0, 1) for step in range(15)]
    assert not again.notes
    # Each step at the time the live run read its line, never a guess.
    live = {(e["rank"], e["line"]): e["t"] for e in map(
        json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == "step"}
    for e in steps:
        if (e.rank, e.fields["line"]) in live:
            assert e.t == pytest.approx(live[(e.rank, e.fields["line"])], abs=1e-5)
