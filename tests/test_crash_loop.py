"""Crash loops explained: how each process of a run ended, in the report, JSON and JUnit.

The unit tests build torchrun's files by hand (its ``--log-dir`` layout, its agent's stderr
lines) and read them through :mod:`aftershock.harness.run.attempts`; the last test runs a real
torchrun
job
whose every restart dies loading an empty snapshot.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from aftershock.harness import api
from aftershock.harness.reporting.report import (
    check_table_text,
    junit_xml,
    render_result,
    write_json,
)
from aftershock.harness.run.attempts import (
    TAIL_BYTES,
    LauncherExit,
    crash_loop,
    ends_of,
    last_exception,
    process_exits,
    read_tail,
    report_lines,
    summarize,
)
from aftershock.harness.run.records import Event, ProcessEnd, RunResult
from aftershock.harness.run.rundir import read_result

JOB = Path(__file__).parent / "fixtures" / "crash_loop_job.py"

EOF_TRACEBACK = """\
Traceback (most recent call last):
  File "/work/job/train.py", line 40, in <module>
    main()
  File "/work/job/train.py", line 31, in _load_snapshot
    snapshot = torch.load(path)
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 1530, in load
    return _legacy_load(opened_file)
  File "/usr/lib/python3.11/pickle.py", line 12, in load
    magic_number = pickle_module.load(f)
EOFError: Ran out of input
"""

AGENT = "E1206 05:32:15.867000 10419 torch/distributed/elastic/multiprocessing/api.py:1002] "


# ------------------------------------------------------------------ the exception line


def test_the_exception_is_the_traceback_s_last_with_the_job_s_own_frame() -> None:
    raised = last_exception("loading snapshot\n" + EOF_TRACEBACK)
    assert raised is not None
    assert raised.exception == "EOFError: Ran out of input"
    # The last frame of the job's own code, not torch's or the standard library's.
    assert raised.where == "in _load_snapshot (train.py:31)"


def test_a_chained_exception_names_the_last_one_and_a_message_s_lines_are_not_others() -> None:
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n"
            "KeyError: 'x'\n\nDuring handling of the above exception, another exception "
            "occurred:\n\nTraceback (most recent call last):\n  File \"a.py\", line 3, in g\n"
            "RuntimeError: step 7 failed:\nValueError: this line is the message's, not an "
            "exception\n")
    raised = last_exception(text)
    assert raised is not None
    assert raised.exception == "RuntimeError: step 7 failed:"
    assert raised.where == "in g (a.py:3)"


def test_no_traceback_no_exception() -> None:
    assert last_exception("EOFError: printed, never raised\nall done\n") is None


def test_a_log_is_read_from_its_last_64_kib_only(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    with open(log, "w") as handle:
        handle.write(EOF_TRACEBACK)  # an old one, far from the end
        handle.write(("noise " * 20 + "\n") * (4 * TAIL_BYTES // 120))
    text = read_tail(log)
    assert len(text.encode()) <= TAIL_BYTES
    assert last_exception(text) is None  # beyond the bound: not read, never guessed
    with open(log, "a") as handle:
        handle.write(EOF_TRACEBACK.replace("Ran out of input", "second"))
    assert last_exception(read_tail(log)) is not None
    assert read_tail(tmp_path / "missing.log") == ""


# ------------------------------------------------------------------ ends from files + events


def torchrun_layout(root: Path, attempts: int, exception: str = EOF_TRACEBACK) -> Path:
    """torchrun's ``--log-dir`` tree for a 2-rank job whose every attempt raised."""
    run = root / "torchrun" / "3f2a_abcd"
    for attempt in range(attempts):
        for local in (0, 1):
            folder = run / f"attempt_{attempt}" / str(local)
            folder.mkdir(parents=True)
            (folder / "stdout.log").write_text("starting\n")
            (folder / "stderr.log").write_text(exception if local == 0 or attempt else "")
    return run


def started(t: float, pid: int, rank: int, attempt: int, run: Path) -> Event:
    folder = run / f"attempt_{attempt}" / str(rank)
    return Event(t=t, event="process_started", source="launcher",
                 fields={"pid": pid, "role": "worker", "rank": rank, "local_rank": rank,
                         "generation": attempt, "agent": 100,
                         "error_file": str(folder / "error.json"),
                         "stderr": str(folder / "stderr.log")})


def crash_loop_files(tmp_path: Path) -> tuple[list[Event], Path, Path]:
    run = torchrun_layout(tmp_path, 3)
    events = [Event(t=0.0, event="launch", source="harness", fields={"argv": ["torchrun"]})]
    for attempt in range(3):
        events += [started(1.0 + 2 * attempt, 1000 + 10 * attempt + r, r, attempt, run)
                   for r in (0, 1)]
    log = tmp_path / "launcher.stderr.log"
    log.write_text("".join(
        f"{AGENT}failed (exitcode: 1) local_rank: 0 (pid: {1000 + 10 * a}) of binary: python\n"
        f"I1206 agent.py:9] Sending process {1001 + 10 * a} closing signal SIGTERM\n"
        for a in range(3)) + "Traceback (most recent call last):\n  File \"/v/bin/torchrun\", "
        "line 6, in <module>\ntorch.distributed.elastic.multiprocessing.errors."
        "ChildFailedError: \n=====\njob.py FAILED\n  exitcode  : 1 (pid: 1020)\n")
    return events, log, run


def test_each_attempt_s_workers_end_with_their_exit_code_and_exception(tmp_path: Path) -> None:
    events, log, _ = crash_loop_files(tmp_path)
    exits = process_exits(events, gone={1000: 2.5}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    ends = ends_of(events + exits)
    workers = {(e.attempt, e.rank): e for e in ends if e.role == "worker"}
    assert sorted(workers) == [(a, r) for a in range(3) for r in (0, 1)]
    first = workers[(0, 0)]
    assert (first.pid, first.exit_code, first.exception) == (1000, 1, "EOFError: Ran out of input")
    assert first.root_cause
    assert first.where == "in _load_snapshot (train.py:31)"
    assert first.log is not None
    assert first.log.endswith("attempt_0/0/stderr.log")
    # Rank 1 of attempt 0 wrote nothing: torchrun's SIGTERM is all that is known of its end.
    assert (workers[(0, 1)].signal, workers[(0, 1)].exception) == ("SIGTERM", None)
    assert workers[(0, 1)].exit_code is None
    # When each end was known: the scan's miss, else the next attempt's start, else the end.
    times = {(e.fields["attempt"], e.fields["rank"]): e.t for e in exits
             if e.fields["role"] == "worker"}
    assert times[(0, 0)] == 2.5
    assert times[(0, 1)] == 3.0
    assert times[(2, 0)] == 9.0
    launcher = next(e for e in ends if e.role == "launcher")
    assert (launcher.pid, launcher.exit_code) == (99, 1)
    assert launcher.exception is not None
    assert launcher.exception.endswith("ChildFailedError")


def test_every_restart_dying_alike_is_one_crash_loop_line(tmp_path: Path) -> None:
    events, log, _ = crash_loop_files(tmp_path)
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    _, line = summarize(events + exits)
    assert line == ("2 restarts, each ended by EOFError: Ran out of input, in _load_snapshot "
                    "(train.py:31); so did the first attempt")


def test_a_restart_still_running_at_the_end_is_no_crash_loop(tmp_path: Path) -> None:
    """A run that timed out while attempt 2 trained: not every restart died."""
    events, log, _ = crash_loop_files(tmp_path)
    kept = log.read_text().splitlines(keepends=True)
    log.write_text("".join(kept[:4]))  # torchrun said nothing of attempt 2
    for folder in (tmp_path / "torchrun").glob("*/attempt_2/*"):
        (folder / "stderr.log").write_text("")
    exits = process_exits(events, gone={}, launcher_log=log, launcher=None)
    ends, line = summarize(events + exits)
    assert {e.attempt for e in ends} == {0, 1}, "attempt 2 was ended by the teardown"
    assert line is None


def test_restarts_that_die_differently_are_no_crash_loop(tmp_path: Path) -> None:
    events, log, run = crash_loop_files(tmp_path)
    (run / "attempt_2" / "0" / "stderr.log").write_text(
        EOF_TRACEBACK.replace("EOFError: Ran out of input", "RuntimeError: NCCL timeout"))
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    assert summarize(events + exits)[1] is None


def test_a_worker_the_scan_never_saw_is_found_in_torchrun_s_folders(tmp_path: Path) -> None:
    """Workers that died before the 0.25 s scan: their attempt folders still name them."""
    run = torchrun_layout(tmp_path, 2)
    # What an earlier run left in a reused folder is older than this launch: not this run's.
    old = tmp_path / "torchrun" / "0ld_run" / "attempt_0" / "0"
    old.mkdir(parents=True)
    (old / "stderr.log").write_text(EOF_TRACEBACK)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    events = [Event(t=0.0, event="launch", source="harness",
                    fields={"argv": ["torchrun", f"--log-dir={tmp_path / 'torchrun'}",
                                     "job.py"], "wall_offset": time.time() - 5.0})]
    log = tmp_path / "launcher.stderr.log"
    log.write_text("")
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    ends, line = summarize(events + exits)
    workers = [e for e in ends if e.role == "worker"]
    assert sorted((e.attempt, e.local_rank, e.pid) for e in workers) == [
        (a, r, None) for a in (0, 1) for r in (0, 1)]
    assert all(run.name in (e.log or "") for e in workers if e.exception)
    assert line == ("1 restart, each ended by EOFError: Ran out of input, in "
                    "_load_snapshot (train.py:31); so did the first attempt")


def test_torchrun_s_error_file_is_read_where_the_job_records_it(tmp_path: Path) -> None:
    run = torchrun_layout(tmp_path, 1, exception="")
    (run / "attempt_0" / "0" / "error.json").write_text(json.dumps({"message": {
        "message": "EOFError: Ran out of input",
        "extraInfo": {"py_callstack": EOF_TRACEBACK, "timestamp": "1"}}}))
    events = [started(1.0, 1000, 0, 0, run)]
    log = tmp_path / "launcher.stderr.log"
    log.write_text(f"{AGENT}failed (exitcode: 1) local_rank: 0 (pid: 1000) of binary: x\n")
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    worker = next(e for e in ends_of(events + exits) if e.role == "worker")
    assert worker.exception == "EOFError: Ran out of input"
    assert worker.where == "in _load_snapshot (train.py:31)"
    assert "error_file" in worker.evidence


def test_a_killed_worker_names_its_signal(tmp_path: Path) -> None:
    run = torchrun_layout(tmp_path, 1, exception="")
    events = [started(1.0, 1000, 0, 0, run)]
    log = tmp_path / "launcher.stderr.log"
    log.write_text(f"{AGENT}failed (exitcode: -9) local_rank: 0 (pid: 1000) of binary: x\n")
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=-15, t=9.0))
    ends = {e.role: e for e in ends_of(events + exits) if e.pid is not None}
    assert (ends["worker"].exit_code, ends["worker"].signal) == (-9, "SIGKILL")
    assert ends["launcher"].signal == "SIGTERM"


# ------------------------------------------------------------------ report, JSON, JUnit


def looping_result(tmp_path: Path) -> RunResult:
    ends = tuple(
        ProcessEnd(role="worker", attempt=a, rank=0, local_rank=0, pid=1000 + a, agent=100,
                   exit_code=1, signal=None, exception="EOFError: Ran out of input",
                   where="in load_snapshot (job.py:5)", log=f"attempt_{a}/0/stderr.log",
                   evidence=("torchrun", "log"), root_cause=True)
        for a in range(3))
    return RunResult(name="loop", file="loop.yaml", passed=False, seed=0, duration_s=5.0,
                     checks=(api.CheckResult("completes", False, 1, 0, "exit code 1"),),
                     metrics={}, faults=(), run_dir=str(tmp_path), ends=ends,
                     crash_loop=crash_loop(ends))


LOOP = "2 restarts, each ended by EOFError: Ran out of input"


def test_the_report_json_and_junit_name_the_crash_loop(tmp_path: Path) -> None:
    result = looping_result(tmp_path)
    console = Console(file=io.StringIO(), width=200, record=True)
    render_result(result, console)
    text = console.export_text()
    assert f"crash loop: {LOOP}" in text
    assert "attempt 1: rank 0 (pid 1001) exit 1, EOFError: Ran out of input" in text
    assert LOOP in check_table_text(result)
    out = io.StringIO()
    write_json([result], out)
    record = json.loads(out.getvalue())[0]
    assert LOOP in record["crash_loop"]
    assert record["ends"][1]["exception"] == "EOFError: Ran out of input"
    xml = junit_xml([result])
    assert f"crash loop: {LOOP}" in xml.split("<failure", 1)[1].split(">", 1)[0]
    assert "<system-out>" in xml
    # A recorded run reads back (aftershock report RUN_DIR).
    (tmp_path / "result.json").write_text(json.dumps(result.to_json()))
    assert read_result(tmp_path / "result.json") == result


def test_processes_of_an_attempt_that_ended_alike_share_a_line(tmp_path: Path) -> None:
    events, log, _ = crash_loop_files(tmp_path)
    log.write_text("".join(f"{AGENT}failed (exitcode: 1) local_rank: {r} (pid: {1020 + r}) of "
                           "binary: python\n" for r in (0, 1)))
    run = tmp_path / "torchrun" / "3f2a_abcd"
    (run / "attempt_2" / "1" / "stderr.log").write_text(EOF_TRACEBACK)
    exits = process_exits(events, gone={}, launcher_log=log,
                          launcher=LauncherExit(pid=99, exit_code=1, t=9.0))
    ends, _ = summarize(events + exits)
    lines = report_lines(ends)
    assert ("attempt 2: ranks 0, 1 (pids 1020, 1021) exit 1, EOFError: Ran out of input, in "
            "_load_snapshot (train.py:31)") in lines


def test_a_clean_run_adds_no_lines(tmp_path: Path) -> None:
    clean = ProcessEnd(role="launcher", attempt=None, rank=None, local_rank=None, pid=9,
                       agent=None, exit_code=0, signal=None, exception=None, where=None,
                       log=None, evidence=("child",))
    result = RunResult(name="ok", file="ok.yaml", passed=True, seed=0, duration_s=1.0,
                       checks=(), metrics={}, faults=(), run_dir=str(tmp_path), ends=(clean,))
    assert "ended" not in check_table_text(result)
    assert "system-out" not in junit_xml([result])


# ------------------------------------------------------------------ a real torchrun job


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_torchrun_crash_loop_is_named_everywhere(tmp_path: Path) -> None:
    scenario = api.from_dict({
        "name": "crash-loop",
        "system": {
            "command": ["torchrun", "--nproc-per-node=2", "--max-restarts=2",
                        "--monitor-interval=0.1", "--log-dir=${run_dir}/torchrun",
                        "--redirects=3", str(JOB)],
            "world": 2,
            "timeout": "3m",
        },
        "expect": {"completes": True},
    }, folder=tmp_path)
    result = api.run(scenario, run_dir=tmp_path / "run")
    assert not result.passed
    expected = "2 restarts, each ended by EOFError: Ran out of input, in load_snapshot"
    assert expected in (result.crash_loop or ""), result.ends
    exited = [Event.from_json(json.loads(line)) for line in
              (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    exited = [e for e in exited if e.event == "process_exited"]
    assert {e.fields.get("attempt") for e in exited if e.fields["role"] == "worker"} == {
        0, 1, 2}
    assert any(e.fields.get("exception") == "EOFError: Ran out of input" for e in exited)
    # The harness saw the workers' pids disappear: each end's time is its own, not the run's.
    assert any("gone" in e.fields["evidence"] for e in exited if e.fields["role"] == "worker")
    assert any(e.fields["role"] == "launcher" and e.fields.get("exit_code") == 1
               for e in exited)
    console = Console(file=io.StringIO(), width=200, record=True)
    render_result(result, console)
    assert expected in console.export_text()
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert expected in record["crash_loop"]
    assert expected in junit_xml([result]).split("<failure", 1)[1]
