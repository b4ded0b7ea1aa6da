"""The terminal report at 80 columns, and what --plain prints once and in full."""

from __future__ import annotations

import io
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from _helpers import RANKS_JOB, cli
from rich.console import Console

from aftershock.harness.reporting.report import LiveObserver, render_result
from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.run.rundir import load_run, read_result

RECORDED = Path(__file__).parent / "fixtures" / "recorded"


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def _row_of(line: str, check: str) -> bool:
    """Whether ``line`` is ``check``'s table row (boxed, or the borderless narrow table)."""
    return line.removeprefix("│ ").startswith(f"{check} ")


@pytest.mark.parametrize("width", [80, 120])
def test_the_check_table_fits_the_width_and_keeps_each_message_whole(width: int) -> None:
    result = read_result(RECORDED / "train-kill-rank-hot-spare" / "result.json")
    long = CheckResult("xid_action", False, "79:none reported", "79:reset_gpu",
                       "Xid 79: expected reset_gpu, got none reported; the system went on "
                       "training on a GPU that fell off the bus until the run's time limit")
    result = replace(result, passed=False, checks=(*result.checks, long))
    buffer = io.StringIO()
    render_result(result, Console(file=buffer, width=width, soft_wrap=True))
    lines = _lines(buffer.getvalue())
    assert max(map(len, lines)) <= width, "\n".join(lines)
    # No cell wraps: the expected value stays whole on its check's row.
    row = next(line for line in lines if _row_of(line, "params_match"))
    assert "bitwise equal to the fault-free run" in row
    for check in result.checks:
        # The message follows its check's name, words in order, wrapped only between words
        # (continuation lines are indented under the first).
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{check.name}:"))
        parts = [lines[start][len(check.name) + 1:].strip()]
        parts += [line.strip() for line in
                  itertools.takewhile(lambda line: line.startswith(" "), lines[start + 1:])]
        assert " ".join(parts) == check.message
    # Each table row is one line: a verdict is never folded away from its check.
    for check in result.checks:
        row = next(line for line in lines if _row_of(line, check.name))
        assert ("PASS" if check.passed else "FAIL") in row


def test_where_every_message_fits_its_row_they_are_a_column() -> None:
    """Wide enough for every row on one line: the message is the row's last cell."""
    result = read_result(RECORDED / "train-kill-rank-hot-spare" / "result.json")
    buffer = io.StringIO()
    render_result(result, Console(file=buffer, width=160, soft_wrap=True))
    lines = _lines(buffer.getvalue())
    assert max(map(len, lines)) <= 160, "\n".join(lines)
    for check in result.checks:
        row = next(line for line in lines if _row_of(line, check.name))
        assert ("PASS" if check.passed else "FAIL") in row
        assert check.message in row
    assert not any(line.startswith(f"{c.name}:") for c in result.checks for line in lines)


def test_the_live_view_fits_80_columns_one_line_per_event() -> None:
    run = load_run(RECORDED / "train-kill-rank-hot-spare")
    buffer = io.StringIO()
    console = Console(file=buffer, width=80, force_terminal=True, color_system=None)
    view = LiveObserver(console, total_steps=60)
    view.phase(run.result.name, "run")
    for event in run.events:
        view.event(event)
    # A long cause (a Gloo error quotes a path and an address) must not wrap the log.
    cause = ("collective_error: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
             "pair.cc:553] Connection closed by peer [127.0.0.1]:17292")
    view.event(Event(run.events[-1].t, "failure_detected", "rank2",
                     {"rank": 2, "cause": cause}))
    console.print(view._render())
    lines = _lines(buffer.getvalue())
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    # Below the rank rows, up to the panel's border: the last eight events, a line each.
    first = next(i for i, line in enumerate(lines) if line.startswith("│ +"))
    last = next(i for i, line in enumerate(lines) if line.startswith("╰"))
    assert len(view.state.log) == 8
    assert last - first == 8, "\n".join(lines)
    assert all(line.startswith("│ +") for line in lines[first:last])


@pytest.mark.slow
def test_plain_output_says_timeout_once_and_the_whole_command(tmp_path: Path) -> None:
    scenario = tmp_path / "slow.yaml"
    args = ", ".join(f"arg{i}" for i in range(8))
    scenario.write_text(f"""\
name: slow
system:
  command: [{sys.executable}, {RANKS_JOB}, {args}, --the-last-argument]
  env: {{JOB_RANKS: "1", JOB_DURATION: "30"}}
  timeout: 1s
expect: {{completes: true}}
""")
    done = cli("run", str(scenario), "--plain", "--run-dir", str(tmp_path / "runs"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("TIMEOUT after") == 1, done.stdout
    run_line = next(line for line in done.stdout.splitlines() if "] run: " in line)
    assert run_line.endswith("arg7 --the-last-argument"), run_line
