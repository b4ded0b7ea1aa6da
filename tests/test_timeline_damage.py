"""A damaged timeline is never judged silently: a line that is not an event fails the run
with a harness error naming the line, instead of metrics computed from what was left
(issue 47, class 4). Only a last line cut short by a crash is passed over, and only when
the timeline's writer may have died mid-line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import cli

from aftershock.harness.errors import HarnessError
from aftershock.harness.run.timeline import DamagedTimeline, read_events

LINES = [json.dumps({"t": float(i), "event": "step", "step": i}) for i in range(1, 5)]


def _timeline(tmp_path: Path, lines: list[str], tail: str = "") -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ['{"t": 3.0, "event": "st\x01\x9c', "garbage", "{}",
                                 '{"t": "x", "event": "step"}', "[1, 2]", ""])
def test_a_damaged_line_in_the_middle_names_its_line(tmp_path: Path, bad: str) -> None:
    path = _timeline(tmp_path, [LINES[0], LINES[1], bad, LINES[3]])
    with pytest.raises(DamagedTimeline, match=rf"{path}:3: ") as info:
        read_events(path)
    assert isinstance(info.value, HarnessError)  # exit 3 at the boundary
    with pytest.raises(DamagedTimeline, match=rf"{path}:3: "):
        read_events(path, complete=True)


@pytest.mark.timeout(30)
def test_a_torn_last_line_is_passed_over_unless_the_writer_closed_the_timeline(
        tmp_path: Path) -> None:
    path = _timeline(tmp_path, LINES, tail='{"t": 9.0, "eve')
    assert [e.fields["step"] for e in read_events(path)] == [1, 2, 3, 4]
    with pytest.raises(DamagedTimeline, match=rf"{path}:5: .*cut short"):
        read_events(path, complete=True)
    # A whole last line without its newline is an event all the same.
    whole = _timeline(tmp_path, LINES[:3], tail=LINES[3])
    assert len(read_events(whole, complete=True)) == 4


BREAKS_ITS_TIMELINE = """\
import json, os, sys, time
path = os.environ["AFTERSHOCK_EVENTS"]
for step in range(1, 6):
    print(f"rank 0 step {step} gen 0 t={time.monotonic()}", flush=True)
    time.sleep(0.05)
with open(path, "ab") as handle:  # bytes that are no event, as a fault in the file leaves
    handle.write(b'{"t": 1.0, "event": "st\\x01\\xfe\\n')
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_whose_timeline_is_damaged_fails_with_exit_3(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(BREAKS_ITS_TIMELINE)
    scenario = tmp_path / "damaged.yaml"
    scenario.write_text(f"""\
name: damaged-timeline
system:
  command: [{sys.executable}, {job}]
  probes:
    - {{event: step, pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) gen (?P<generation>\\d+)'}}
expect:
  completes: true
""")
    run_dir = tmp_path / "run"
    done = cli("run", str(scenario), "--run-dir", str(run_dir), "--plain",
               cache=tmp_path / "cache")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "events.jsonl:" in done.stdout + done.stderr
    assert "not an event" in done.stdout + done.stderr
    record = json.loads((run_dir / "damaged-timeline" / "result.json").read_text())
    assert not record["passed"]
    assert "events.jsonl:" in record["error"]
    assert record["checks"] == []
