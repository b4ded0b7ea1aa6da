"""`aftershock explore` and `pytest --aftershock-explore` as users run them, on real processes.

The job (tests/fixtures/explore_job.py) is torch-free and takes a second or two a run: its
supervisor survives one failure at a time and gives up on a second failure during a
recovery. Explore must find that, shrink it, write it, and the written scenario must fail
under `aftershock run`.
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
from _helpers import EXPLORE_JOB, ROOT, cli, explore_job_scenario

from aftershock.faults._proc import environ
from aftershock.harness.scenario.load import load_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = EXPLORE_JOB


def job_scenario(name: str, max_faults: int = 2, explore: bool = True) -> str:
    return explore_job_scenario(name, duration=1.2, max_step=12, max_faults=max_faults,
                                explore=explore, one_kill=True)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_explore_finds_shrinks_and_writes_a_scenario_that_fails(tmp_path: Path) -> None:
    scenario = write(tmp_path, "job", job_scenario("job"))
    out = tmp_path / "out"
    proc = cli("explore", str(scenario), "--runs", "20", "--seed", "2", "--out", str(out),
               "--db", str(tmp_path / "db"), "--json", str(tmp_path / "x.json"), timeout=280)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    # Plain lines off a terminal: one per run, then what was found.
    assert "run   1 search" in proc.stdout
    assert "FAILING SCHEDULE: " in proc.stdout
    (record,) = json.loads((tmp_path / "x.json").read_text())
    (finding,) = record["findings"]
    assert finding["status"] == "confirmed"
    assert record["runs_per_minute"] > 0
    # Each failure was re-run at once: a re-run follows a failing run of its schedule.
    attempts = record["attempts"]
    confirms = [i for i, a in enumerate(attempts) if a["stage"] == "confirm"]
    assert confirms
    for i in confirms:
        assert attempts[i - 1]["schedule"] == attempts[i]["schedule"]
        assert attempts[i - 1]["verdict"] == "fail" or attempts[i - 1]["stage"] == "confirm"
    assert len(confirms) == sum(1 for a in attempts if a["stage"] != "confirm"
                                and a["verdict"] == "fail")
    # Shrunk: two faults, and each is needed (explore_job fails only on the second).
    assert finding["faults"] == 2
    found = Path(finding["file"])
    assert found == out / "job-found.yaml"
    assert cli("validate", str(found)).returncode == 0
    again = cli("run", str(found), "--run-dir", str(tmp_path / "again"))
    assert again.returncode == 1, again.stdout[-2000:]
    spec = load_scenario(found).spec
    for index in range(len(spec.faults)):
        fewer = found.with_name(f"without-{index}.yaml")
        fewer.write_text(found.read_text().replace(
            f"- kind: process.kill\n  target: {{rank: {spec.faults[index].target.rank}}}\n"
            f"  at: {{{_at(spec.faults[index])}}}\n", "", 1))
        assert len(load_scenario(fewer).spec.faults) == len(spec.faults) - 1
        record_file = tmp_path / f"w{index}.json"
        alone = cli("run", str(fewer), "--run-dir", str(tmp_path / f"w{index}"),
                    "--json", str(record_file))
        # The job survives: what explore found is gone. (A fault triggered by the other
        # one's failure_detected then never lands, and says so: that is not a failure of
        # the job. Which schedule the search finds depends on the machine's speed.)
        (result,) = json.loads(record_file.read_text())
        checks = {c["name"]: c for c in result["checks"]}
        assert checks["completes"]["passed"], alone.stdout[-2000:]
        unlanded = [f for f in load_scenario(fewer).spec.faults if f.at.event is not None]
        assert alone.returncode == 0 or (unlanded and not checks["faults_injected"]["passed"]
                                         ), alone.stdout[-2000:]


def _at(fault: object) -> str:
    at = fault.at  # type: ignore[attr-defined]
    if at.step is not None:
        return f"step: {at.step}"
    return f"event: {at.event}" + (f", count: {at.count}" if at.count > 1 else "")


def test_explore_exits_0_when_the_budget_runs_out(tmp_path: Path) -> None:
    # One fault at a time: the job survives every one.
    scenario = write(tmp_path, "one", job_scenario("one", max_faults=1))
    proc = cli("explore", str(scenario), "--runs", "4", "--out", str(tmp_path / "out"),
               "--no-db", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "no failing schedule found" in proc.stdout
    assert "search seed " in proc.stdout  # random, and said, so it can be repeated


@pytest.mark.parametrize(("args", "expected"), [
    (["--time", "soon"], "--time soon: expected a duration"),
    (["--runs", "0"], "Invalid value for '--runs'"),
])
def test_explore_refuses_bad_options_with_exit_2(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    scenario = write(tmp_path, "job", job_scenario("job"))
    proc = cli("explore", str(scenario), *args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert expected in proc.stderr


def test_explore_needs_an_explore_block_and_names_bad_ones(tmp_path: Path) -> None:
    plain = write(tmp_path, "plain", job_scenario("plain", explore=False))
    bad = write(tmp_path, "bad", job_scenario("bad").replace("targets: [rank]",
                                                            "targets: [rank, replica]"))
    proc = cli("explore", str(plain), str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert f"{plain}:1:1: no `explore:` block" in proc.stderr
    assert f"{bad}:20:19: explore.targets.1: 'replica': only the reference trainer" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


def start_explore(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """`aftershock explore` of the job, seed 2, started and left running; its --out folder."""
    scenario = write(tmp_path, "job", job_scenario("job"))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aftershock", "explore", str(scenario), "--runs", "40", "--seed",
         "2", "--out", str(out), "--no-db"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    return proc, out


def test_sigterm_while_shrinking_writes_what_was_found_and_exits_143(tmp_path: Path) -> None:
    proc, out = start_explore(tmp_path)
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # until the first failing run: the search then shrinks
        lines.append(line)
        if " FAIL " in line or time.monotonic() > deadline:
            break
    # Interrupt while one of the shrinking runs has its job up: it must not outlive the
    # harness. (Looked for by this test's folder: other tests run the same job.)
    wait_until = time.monotonic() + 30
    while not jobs_of(tmp_path) and time.monotonic() < wait_until:
        time.sleep(0.02)
    assert jobs_of(tmp_path), "no run of the job was seen while shrinking"
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, "".join(lines) + rest + err
    assert "what was found so far is written" in err
    (written,) = out.glob("job-*.yaml")
    assert written.name == "job-unconfirmed.yaml"
    assert load_scenario(written).spec.faults
    # Nothing of the job is left running.
    assert jobs_of(tmp_path) == []


def jobs_of(folder: Path) -> list[int]:
    """Live processes of the job started by a search run from ``folder`` (its runs' files,
    named in their environment, lie under it)."""
    found = subprocess.run(["pgrep", "-f", str(JOB)], capture_output=True, text=True)
    return [pid for pid in map(int, found.stdout.split())
            if any(str(folder) in value for value in environ(pid).values())]


def test_sigterm_before_any_failure_says_nothing_was_written(tmp_path: Path) -> None:
    proc, out = start_explore(tmp_path)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # "exploring ...": no run has ended yet
    assert "exploring" in first
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, first + rest + err
    assert "no run had failed yet, so nothing was written" in err
    assert "what was found so far is written" not in err
    assert list(out.glob("job-*.yaml")) == []


def test_pytest_explores_scenarios_with_an_explore_block(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", job=job_scenario("job-one", max_faults=2),
                      plain=job_scenario("plain-one", explore=False))
    result = pytester.runpytest_subprocess(
        "-v", "-p", "no:cacheprovider", "--aftershock-explore=20",
        "--aftershock-explore-seed=2", f"--aftershock-run-dir={pytester.path / 'runs'}")
    result.stdout.fnmatch_lines([
        "*job.yaml::job-one FAILED*",
        "*plain.yaml::plain-one PASSED*",
    ])
    result.stdout.fnmatch_lines(["*explore found a failing schedule (seed 2, *",
                                 "*written to *job-one-found.yaml*"])
    result.assert_outcomes(passed=1, failed=1)


def test_a_database_value_linked_to_dev_zero_is_refused_not_read(tmp_path: Path) -> None:
    """hypothesis read a value linked to /dev/zero until MemoryError (issue 48)."""
    from _helpers import bounded_cli

    scenario = write(tmp_path, "job", job_scenario("job"))
    db = tmp_path / "db"
    value = db / "somekey" / "0123abcd" / "deadbeef"
    value.parent.mkdir(parents=True)
    os.symlink("/dev/zero", value)
    result = bounded_cli("explore", str(scenario), "--runs", "1", "--db", str(db),
                         "--out", str(tmp_path / "out"), "--seed", "1", cpu_s=60, wall_s=200)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert str(value) in result.stderr
    assert "a link" in result.stderr
    assert "--no-db" in result.stderr
    assert result.max_rss_mb < 200, result.max_rss_mb
