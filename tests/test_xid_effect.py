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

from harness.runner import run_scenario
from harness.spec import LoadedScenario, parse_scenario

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
