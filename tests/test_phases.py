"""The training loops' lap timer (reference_impl/phases.py), in this process: what it
charges where, over which steps, and what it reports on the timeline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from aftershock.reference_impl.phases import ENV, EVENT, Laps, parse


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("AFTERSHOCK_EVENTS", str(path))
    monkeypatch.setenv("RANK", "0")
    return path


def test_each_phase_gets_its_own_cpu_and_wall_time_over_the_window_only(
    timeline: Path,
) -> None:
    laps = Laps("2:4")  # steps 3 and 4 count
    for step in range(1, 7):
        name = "counted" if 3 <= step <= 4 else "outside"
        _spin(0.02)
        laps.lap(f"busy {name}")
        time.sleep(0.03)
        laps.lap(f"asleep {name}")
        laps.step_done(step)
    [report] = [e for e in _events(timeline) if e["event"] == EVENT]
    assert (report["first"], report["last"], report["steps"]) == (2, 4, 2)
    phases = report["phases"]
    assert set(phases) == {"busy counted", "asleep counted", "rest"}, phases
    busy, asleep = phases["busy counted"], phases["asleep counted"]
    # Two steps of each: 40 ms of CPU spun, 60 ms asleep.
    assert busy["cpu_ns"] >= 0.035e9
    assert asleep["wall_ns"] >= 0.055e9
    assert asleep["cpu_ns"] < 0.2 * asleep["wall_ns"]
    assert busy["cpu_ns"] > 5 * asleep["cpu_ns"]
    assert phases["rest"]["wall_ns"] < 0.01e9  # nothing happens between a lap and step_done


def test_a_step_computed_again_adds_to_its_phases_and_counts_once(timeline: Path) -> None:
    laps = Laps("0:1")
    laps.step_done(0)  # the window opens after step 0
    for _attempt in range(3):  # step 1 computed three times (a vote said no twice)
        time.sleep(0.01)
        laps.lap("work")
    laps.step_done(1)
    [report] = [e for e in _events(timeline) if e["event"] == EVENT]
    assert report["steps"] == 1
    assert report["phases"]["work"]["wall_ns"] >= 0.028e9


def test_off_it_times_and_reports_nothing(timeline: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    laps = Laps()
    assert not laps.on
    for step in range(1, 30):
        laps.lap("work")
        laps.step_done(step)
    assert laps.totals == {}
    assert _events(timeline) == []


def test_a_window_the_loop_never_opens_reports_nothing(timeline: Path) -> None:
    """A process that resumed past FIRST (a restart from a checkpoint) never saw the window
    open: it reports nothing rather than a part of it."""
    laps = Laps("20:30")
    for step in range(25, 40):
        laps.lap("work")
        laps.step_done(step)
    assert _events(timeline) == []


@pytest.mark.parametrize("spec", ["20", "a:b", "30:20", "20:20", "-1:5", "20:30:40"])
def test_a_malformed_window_says_what_is_expected(spec: str) -> None:
    with pytest.raises(ValueError, match=rf"{ENV}=.*FIRST:LAST"):
        parse(spec)


def test_the_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "20:295")
    laps = Laps()
    assert laps.on
    assert (laps.first, laps.last) == (20, 295)
