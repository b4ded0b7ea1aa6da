"""Broken checkpoint writers fail the shipped storage scenarios' checkpoint_durable check.

Each run is a shipped scenario, unchanged but for the writer: a sitecustomize.py
(tests/fixtures/broken_writer/) patches aftershock.reference_impl.checkpoint in every process of the
job, through the scenario's ``system.env``. The correct writer passes the same scenarios
(test_shipped_scenarios.py). ``params_match`` is left out: it cannot see these bugs (a
deterministic trainer that starts over still ends bitwise equal), and a different
environment would need its own fault-free run.

Two more variants are in the fixture, not run here (a minute each): ``no_dir_fsync`` fails
the power-loss scenario exactly like ``no_fsync`` (every step folder's name is lost; it is
the bug the reference writer had, which that shipped scenario now guards). ``no_rename``
passes both scenarios, and cannot fail any honest check on this layout: the rename keeps a
final name from being torn, but here nothing trusts a final name before the COMMIT marker,
which is written only once every rank's files are durable, and the loader verifies
checksums anyway. (Run by hand: BROKEN_WRITER=no_rename, checkpoint_durable passes.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from _helpers import ROOT, cli

FIXTURE = ROOT / "tests" / "fixtures" / "broken_writer"
POWER_LOSS = ROOT / "scenarios" / "faults" / "storage_lose_unsynced.yaml"
KILL_ON_FILE = ROOT / "scenarios" / "faults" / "storage_kill_on_file.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_with(scenario: Path, bug: str, tmp_path: Path, cache: Path) -> dict[str, Any]:
    data = yaml.safe_load(scenario.read_text())
    data["name"] += "-" + bug.replace("_", "-")
    data["system"]["env"] = {"PYTHONPATH": f"{FIXTURE}:{ROOT}", "BROKEN_WRITER": bug}
    data["expect"].pop("params_match")
    path = tmp_path / f"{bug}.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out.json"
    proc = cli("run", str(path), "--json", str(out), "--run-dir", str(tmp_path / "r"),
               cache=cache, timeout=280)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-2000:]
    (record,) = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["faults_injected"]["passed"], checks["faults_injected"]
    return dict(checks["checkpoint_durable"])


@pytest.mark.parametrize(("scenario", "bug", "says"), [
    # Nothing reaches the disk: the restarted trainer finds no checkpoint, starts over and
    # saves its first checkpoint again.
    (POWER_LOSS, "no_fsync", "before any resume: it trained from older than step"),
    # The save cut short looks like a checkpoint; only the checksums keep it from loading.
    (KILL_ON_FILE, "no_commit_marker", "had to reject"),
], ids=["no_fsync", "no_commit_marker"])
def test_a_broken_writer_fails_checkpoint_durable(
    scenario: Path, bug: str, says: str, tmp_path: Path, shared_cache: Path
) -> None:
    check = run_with(scenario, bug, tmp_path, shared_cache)
    assert check["passed"] is False, check
    assert says in check["message"]
