"""`xid_action` checks what the process did about an Xid, not only what it announced.

NVIDIA's recommended action (faults/xid.py CATALOG) is either `none` (log it, keep working)
or an action that takes the process off its GPU (restart_app, reset_gpu, drain_node): then
the process hit must stop working and exit (or be replaced) during the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import ROOT

from aftershock.harness.run.records import Event
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import Expect, LoadedScenario
from aftershock.harness.verdict.checks import Outcome, evaluate

XID_79 = ROOT / "scenarios" / "serving" / "xid_79_worker.yaml"
ANNOUNCE_ONLY = ROOT / "tests" / "fixtures" / "broken" / "xid_announce_only"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_announces_a_drain_and_goes_on_serving_fails(tmp_path: Path) -> None:
    text = XID_79.read_text().split("\nexpect:\n")[0]
    text += "\nexpect:\n  completes: true\n  xid_action: true\n"
    path_env = f"{ANNOUNCE_ONLY}{os.pathsep}{ROOT}"
    text = text.replace("  workers: 3\n", f"  workers: 3\n  env: {{PYTHONPATH: '{path_env}'}}\n")
    assert str(ANNOUNCE_ONLY) in text
    path = tmp_path / "xid.yaml"
    path.write_text(text)
    result = run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                          run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed, checks["completes"].message
    assert checks["faults_injected"].passed
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "[broken variant]" in logs
    assert not checks["xid_action"].passed, checks["xid_action"].message
    assert "never exited" in checks["xid_action"].message


# ------------------------------------------------------- fast: hand-written timelines


def xid(code: int, t: float = 1.0, pid: int = 100) -> Event:
    return Event(t, "fault_injected", "harness",
                 {"kind": "gpu.xid", "pid": pid, "rank": 1, "params": {"code": code}})


def said(code: int, action: str, t: float, pid: int = 100) -> Event:
    return Event(t, "xid_action", "rank1", {"code": code, "action": action, "pid": pid})


def step(n: int, t: float, pid: int = 100) -> Event:
    return Event(t, "step", "rank1", {"step": n, "pid": pid, "rank": 1})


def exited(t: float, pid: int = 100) -> Event:
    return Event(t, "target_exited", "harness", {"pid": pid, "kind": "gpu.xid", "fault": 0})


def verdict(*events: Event) -> tuple[bool, str]:
    (check,) = [c for c in evaluate(Expect(xid_action=True), outcome=Outcome(0, False, 1.0),
                                    metrics={}, faults=[], digests={}, baseline=None,
                                    events=sorted(events, key=lambda e: e.t))
                if c.name == "xid_action"]
    return check.passed, check.message


def test_an_xid_to_act_on_must_stop_the_process() -> None:
    assert verdict(xid(79), said(79, "drain_node", 1.1), step(26, 1.15), exited(1.2))[0]
    passed, message = verdict(xid(79), said(79, "drain_node", 1.1), step(26, 1.2),
                              step(27, 1.3))
    assert not passed
    assert "never exited" in message
    passed, message = verdict(xid(79), said(79, "drain_node", 1.1), step(26, 1.2),
                              step(27, 1.3), exited(1.4))
    assert not passed
    assert "committed 2 more steps" in message


def test_an_xid_to_log_only_must_not_stop_the_process() -> None:
    assert verdict(xid(63), said(63, "none", 1.1), step(26, 1.2))[0]
    passed, message = verdict(step(25, 0.9), xid(63), said(63, "none", 1.1), exited(1.2))
    assert not passed
    assert "committed no step after it" in message
    # A server reports no steps: going on means not exiting while the run goes on.
    assert verdict(xid(63), said(63, "none", 1.1))[0]
    passed, message = verdict(xid(63), said(63, "none", 1.1), exited(1.2))
    assert not passed
    assert "pid 100 exited" in message


def test_the_announcement_must_come_from_the_process_hit_and_name_the_action() -> None:
    passed, message = verdict(xid(79), said(79, "drain_node", 1.1, pid=555), exited(1.2))
    assert not passed
    assert "none reported" in message
    passed, message = verdict(xid(79), said(79, "restart_app", 1.1), exited(1.2))
    assert not passed
    assert "expected drain_node, got restart_app" in message
