"""`time_to_detect: {max: D, cause: [...]}`: a fault must be detected by the named cause.

A budget alone passes whatever detected the fault: a frozen worker that only the slow
"wedged" fallback catches passes a loose budget meant for its heartbeat.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import ROOT

from aftershock.harness.errors import SpecError
from aftershock.harness.run.records import Event
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.verdict.checks import Outcome, evaluate

FREEZE = ROOT / "scenarios" / "serving" / "freeze_worker.yaml"


def expect(budget: str) -> str:
    return (f"name: d\nsystem: {{reference: server}}\nfaults:\n  - {{kind: process.kill, "
            f"target: {{worker: 0}}, at: {{step: 1}}}}\nexpect:\n  time_to_detect: {budget}\n")


def timeline(*detections: tuple[float, str]) -> list[Event]:
    events = [Event(10.0, "fault_injected", "harness", {"kind": "process.kill"})]
    events += [Event(10.0 + t, "failure_detected", "router", {"cause": cause})
               for t, cause in detections]
    return events


def detect(budget: str, events: list[Event]) -> tuple[bool, object, str]:
    spec = parse_scenario(expect(budget))
    checks = evaluate(spec.expect, outcome=Outcome(0, False, 1.0),
                      metrics={"time_to_detect_s": _first(events)}, faults=[],
                      digests={}, baseline=None, events=events)
    (check,) = [c for c in checks if c.name == "time_to_detect"]
    return check.passed, check.observed, check.message


def _first(events: list[Event]) -> float | None:
    found = [e.t - events[0].t for e in events if e.event == "failure_detected"]
    return found[0] if found else None


def test_the_first_detection_must_have_a_named_cause() -> None:
    assert detect("{max: 1s, cause: [heartbeat]}", timeline((0.5, "heartbeat")))[0]
    passed, observed, message = detect("{max: 3s, cause: [heartbeat]}",
                                       timeline((2.1, "wedged"), (5.0, "heartbeat")))
    assert not passed
    assert observed == "2.1s by wedged"
    assert "detected by wedged" in message
    assert "heartbeat" in message
    # Without a cause, the same timeline passes the budget: the gap this closes.
    assert detect("{max: 3s}", timeline((2.1, "wedged"), (5.0, "heartbeat")))[0]


def test_a_named_cause_still_has_to_be_on_time() -> None:
    passed, _, message = detect("{max: 1s, cause: [heartbeat]}", timeline((1.5, "heartbeat")))
    assert not passed
    assert "over" in message
    passed, observed, message = detect("{max: 1s, cause: heartbeat}", timeline())
    assert not passed
    assert observed is None
    assert "never observed" in message


@pytest.mark.parametrize(("wanted", "seen", "ok"), [
    ("collective_error", "collective_error: Connection reset by peer", True),
    ("collective_error", "collective_error", True),
    ("collective", "collective_error: x", False),
    ("collective", "collective_timeout", False),
    ("heartbeat", "heartbeat_timeout", False),
    ("xid_*", "xid_79", True),
    ("terminated: SIGTERM from the launcher", "terminated: SIGTERM from the launcher", True),
])
def test_a_cause_matches_itself_its_detailed_form_or_a_star_prefix(
    wanted: str, seen: str, ok: bool
) -> None:
    budget = "{max: 1s, cause: ['" + wanted + "']}"
    assert detect(budget, timeline((0.2, seen)))[0] is ok


def test_any_of_several_causes_may_detect() -> None:
    budget = "{max: 1s, cause: [process_exit, heartbeat_timeout]}"
    assert detect(budget, timeline((0.2, "heartbeat_timeout")))[0]
    assert not detect(budget, timeline((0.2, "collective_timeout")))[0]


@pytest.mark.parametrize("bad", ["[]", "['']", "[1]"])
def test_an_empty_or_bad_cause_is_invalid(bad: str) -> None:
    with pytest.raises(SpecError, match=r"time_to_detect\.cause"):
        parse_scenario(expect(f"{{max: 1s, cause: {bad}}}"), "d.yaml")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_freeze_caught_by_the_wedged_fallback_fails_a_heartbeat_cause(tmp_path: Path) -> None:
    """The shipped freeze scenario on a server whose heartbeat deadline is slower than its
    progress check (a broken configuration): the wedged fallback catches the frozen worker
    within the loose budget, so only the cause tells."""
    text = FREEZE.read_text().replace("  dead_after: 500ms\n",
                                      "  dead_after: 5s\n  wedged_after: 1s\n")
    text = text.split("\nexpect:\n")[0] + (
        "\nexpect:\n  completes: true\n  time_to_detect: {max: 3s, cause: [heartbeat]}\n")
    assert "dead_after: 5s" in text
    path = tmp_path / "freeze.yaml"
    path.write_text(text)
    result = run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                          run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed
    assert checks["faults_injected"].passed
    detected = result.metrics["time_to_detect_s"]
    assert isinstance(detected, float)
    assert detected <= 3.0  # the budget alone would pass
    assert not checks["time_to_detect"].passed
    assert "detected by wedged" in checks["time_to_detect"].message
