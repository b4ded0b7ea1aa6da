"""The shipped scenarios, run as a user runs them: through the CLI and through pytest.

Slow by nature (each launches the 4-rank reference trainer under torchrun,
twice when it compares against the fault-free run; the fault-free run is
cached per session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KILL = ROOT / "scenarios" / "training" / "kill_rank_restart.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def aftershock(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=580,
        cwd=ROOT, env={**os.environ, "AFTERSHOCK_CACHE_DIR": str(cache)},
    )


def test_kill_rank_restart_passes_with_metrics(tmp_path: Path, shared_cache: Path) -> None:
    out = tmp_path / "out.json"
    proc = aftershock("run", str(KILL), "--json", str(out), "--run-dir", str(tmp_path / "r"),
                      cache=shared_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    assert record["passed"] is True
    checks = {c["name"]: c for c in record["checks"]}
    assert checks["params_match"]["passed"]
    for metric in ("time_to_detect_s", "time_to_recover_s", "lost_steps"):
        assert isinstance(record["metrics"][metric], int | float), metric
    assert record["metrics"]["generations"] == 1  # one torchrun restart


def test_the_same_scenario_with_an_impossible_budget_fails(
    tmp_path: Path, shared_cache: Path
) -> None:
    tight = tmp_path / "tight.yaml"
    tight.write_text(KILL.read_text().replace("time_to_recover: {max: 30s}",
                                              "time_to_recover: {max: 1ms}"))
    proc = aftershock("run", str(tight), "--run-dir", str(tmp_path / "r"), cache=shared_cache)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "time_to_recover" in ln)
    assert "FAIL" in line
    assert "<= 1ms" in line  # expected, next to the observed value
    assert "1 failed" in proc.stdout


def test_pytest_runs_a_shipped_scenario_as_one_test(tmp_path: Path, shared_cache: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(KILL), "-p", "no:cacheprovider", "-q",
         f"--aftershock-run-dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=580, cwd=ROOT,
        env={**os.environ, "AFTERSHOCK_CACHE_DIR": str(shared_cache)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


OTHERS = sorted(
    p for p in (ROOT / "scenarios").rglob("*.yaml") if p != KILL
)


@pytest.mark.parametrize("scenario", OTHERS, ids=[p.stem for p in OTHERS])
def test_shipped_scenario_passes(scenario: Path, tmp_path: Path, shared_cache: Path) -> None:
    out = tmp_path / "out.json"
    proc = aftershock("run", str(scenario), "--json", str(out), "--run-dir", str(tmp_path / "r"),
                      cache=shared_cache)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
