"""The harness reads a job's output in bounded memory: a line without end, or a stream
without end (`cat /dev/zero`), costs it a fixed amount, while the log keeps everything up
to its limit and says what it dropped, and the probes still see each line's beginning.

Each case runs the real LocalTarget in a fresh Python process (tests/_helpers.ROOT on its
path), so its peak memory (ru_maxrss) is its own and not what this test session once used.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUNNER = """
    import json, resource, sys, time
    from pathlib import Path
    import aftershock.harness.run.target as target
    from aftershock.harness.scenario.spec import LogProbe
    from aftershock.harness.run.timeline import Timeline

    run_dir, job, log_limit = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if log_limit:
        target.LOG_LIMIT = log_limit  # the test's own, smaller limit
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = LogProbe(pattern=r"step (?P<step>\\d+)", event="step")
    launch = target.Launch(["sh", "-c", job], run_dir, {}, None, (probe,))
    timeline = Timeline(run_dir / "events.jsonl")
    job_target = target.LocalTarget(launch, run_dir=run_dir, run_id="logs", timeline=timeline)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    job_target.start()
    while job_target.poll() is None:
        time.sleep(0.05)
    job_target.stop()
    timeline.close()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_mib": (after - before) / 1024}))
"""


def run_job(tmp_path: Path, job: str, log_limit: int = 0) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUNNER), str(tmp_path / "run"), job,
         str(log_limit)],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_a_128_mib_line_costs_the_harness_little_and_is_logged_whole(tmp_path: Path) -> None:
    size = 128 * 1024 * 1024
    job = f"printf 'step 7 '; head -c {size} /dev/zero | tr '\\0' x; printf '\\nstep 8\\n'"
    measured = run_job(tmp_path, job)
    assert measured["grew_mib"] < 64, measured  # a 300 MB line cost 640 MB
    log = tmp_path / "run" / "logs" / "launcher.stdout.log"
    assert log.stat().st_size == len("step 7 ") + size + len("\nstep 8\n")
    steps = read_events(tmp_path / "run" / "events.jsonl", "step")
    assert [e["step"] for e in steps] == [7, 8]  # the long line's prefix reached the probe


def test_an_endless_stream_is_logged_up_to_the_limit_with_a_note(tmp_path: Path) -> None:
    limit = 1024 * 1024
    job = f"echo 'step 1'; head -c {50 * limit} /dev/zero; echo; echo 'step 2'"
    measured = run_job(tmp_path, job, log_limit=limit)
    assert measured["grew_mib"] < 64, measured
    log = (tmp_path / "run" / "logs" / "launcher.stdout.log").read_bytes()
    assert log.startswith(b"step 1\n")
    assert len(log) < limit + 500
    note = log[limit:].decode()
    assert f"[aftershock: log truncated at {limit} bytes" in note
    dropped = 50 * limit + len("step 1\n\nstep 2\n") - limit
    assert f"[aftershock: {dropped} more bytes were read and dropped]" in note
    # What was dropped from the file was still read: the probes saw the last line.
    steps = read_events(tmp_path / "run" / "events.jsonl", "step")
    assert [e["step"] for e in steps] == [1, 2]


def test_every_line_keeps_its_capture_time_and_every_match_counts(tmp_path: Path) -> None:
    """`<log>.times` holds one row per line (its offset in the log, when it was read), so a
    re-check can time a line no live probe matched; and two reports one pipe ran together
    into a single line are both events."""
    job = "echo 'step 1'; sleep 0.2; echo 'noise'; printf 'step 2step 3\\n'; printf 'step 4'"
    run_job(tmp_path, job)
    log = tmp_path / "run" / "logs" / "launcher.stdout.log"
    raw = log.read_bytes()
    assert raw == b"step 1\nnoise\nstep 2step 3\nstep 4"
    rows = [line.split() for line in (log.parent / "launcher.stdout.log.times")
            .read_text().splitlines()]
    offsets = [int(offset) for offset, _ in rows]
    assert offsets == [0, 7, 13, 26]  # where each line begins, the unterminated last one too
    times = [float(t) for _, t in rows]
    assert times == sorted(times)
    assert times[1] - times[0] >= 0.15  # read when written, not all at the end
    steps = [e["step"] for e in read_events(tmp_path / "run" / "events.jsonl", "step")]
    assert steps == [1, 2, 3, 4]
