"""A run whose processes outlive SIGTERM's grace says which, and why SIGTERM did not end
them: ignored, blocked (and pending), or caught by a handler that never finished. A server
that hung on SIGTERM once in CI left only "exit -9"; this is what would have said where.

Real processes under the real LocalTarget, each a Python job that treats SIGTERM its way."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness.reporting.report import _describe_teardown
from aftershock.harness.run import target
from aftershock.harness.run.timeline import Timeline

pytestmark = pytest.mark.timeout(60)

JOBS = {
    # What the job does with SIGTERM, then says it is ready and waits.
    "ignored": "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
    "blocked": "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})",
    "caught": "signal.signal(signal.SIGTERM, lambda *a: time.sleep(60))",
    "default": "",
}


def stop(tmp_path: Path, how: str, grace: float = 0.5) -> tuple[target.Teardown, int]:
    code = textwrap.dedent(f"""\
        import signal, time
        {JOBS[how]}
        print("ready", flush=True)
        time.sleep(60)
    """)
    run_dir = tmp_path / how
    run_dir.mkdir()
    launch = target.Launch([sys.executable, "-c", code], run_dir, {}, None, ())
    timeline = Timeline(run_dir / "events.jsonl")
    job = target.LocalTarget(launch, run_dir=run_dir, run_id=f"overran-{how}",
                             timeline=timeline)
    job.start()
    try:
        deadline = time.monotonic() + 30
        log = run_dir / "logs" / "launcher.stdout.log"
        while not (log.exists() and "ready" in log.read_text()):
            assert time.monotonic() < deadline, "the job never became ready"
            assert job.poll() is None
            time.sleep(0.05)
        assert job.proc is not None
        pid = job.proc.pid
    finally:
        teardown = job.stop(grace)
        timeline.close()
    return teardown, pid


def only(teardown: target.Teardown, pid: int) -> dict[str, Any]:
    (entry,) = [p for p in teardown.overran if p["pid"] == pid]
    return entry


@pytest.mark.parametrize(("how", "sigterm", "pending"), [
    ("ignored", "ignored", False),
    ("blocked", "blocked in every thread", True),
    ("caught", "caught by a handler", False),
])
def test_a_process_that_outlives_sigterm_says_why(tmp_path: Path, how: str, sigterm: str,
                                                  pending: bool) -> None:
    teardown, pid = stop(tmp_path, how)
    assert teardown.complete  # SIGKILL ended it all the same
    entry = only(teardown, pid)
    assert entry["sigterm"] == sigterm
    assert entry["sigterm_pending"] is pending
    assert entry["state"][0] in "SR"
    assert entry["cmd"].startswith(sys.executable)
    (main,) = [t for t in entry["threads"] if t["tid"] == pid]
    assert main["state"][0] in "SR"
    # The page and the terminal say it in a line.
    said = _describe_teardown({"tracking": "cgroup", "survivors": [],
                               "overran": list(teardown.overran), "grace_s": 0.5})
    assert f"pid {pid}" in said
    assert sigterm in said
    assert "0.5 s" in said


def test_a_process_that_ends_on_sigterm_leaves_nothing_to_say(tmp_path: Path) -> None:
    teardown, _ = stop(tmp_path, "default", grace=5.0)
    assert teardown.complete
    assert teardown.overran == ()
    said = _describe_teardown({"tracking": "cgroup", "survivors": [], "overran": []})
    assert "grace" not in said


@pytest.mark.slow
def test_the_run_records_and_prints_what_outlived_sigterm(tmp_path: Path) -> None:
    """Through `aftershock run`: a job that ignores SIGTERM, stopped at its timeout. The
    teardown event names it, and the terminal line says so."""
    import json

    from _helpers import cli

    job = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "time.sleep(60)")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: deaf\nsystem:\n  command: [{sys.executable}, -c, \"{job}\"]\n"
                        "  timeout: 1s\n")
    proc = cli("run", str(scenario), "--run-dir", str(tmp_path / "runs"), "--plain",
               timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    events = [json.loads(line) for line in
              (tmp_path / "runs" / "deaf" / "events.jsonl").read_text().splitlines()]
    (teardown,) = [e for e in events if e["event"] == "teardown"]
    assert teardown["grace_s"] == 3.0
    (deaf,) = teardown["overran"]
    assert deaf["sigterm"] == "ignored"
    assert f"pid {deaf['pid']}" in proc.stdout
    assert "SIGTERM ignored" in proc.stdout
