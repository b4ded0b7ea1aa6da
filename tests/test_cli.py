"""The CLI's contract: exit codes, error format, catalogue, schema, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, cli, quick_scenario

pytestmark = pytest.mark.timeout(120)


MISSPELT = """\
name: misspelt
system:
  reference: trainer
faults:
  - kind: process.kill
    target: {rank: 1}
    at: {step: 5}
    signall: SIGKILL
"""


@pytest.mark.parametrize("command", ["validate", "run"])
def test_misspelt_key_exits_2_with_position_and_no_traceback(
    tmp_path: Path, command: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MISSPELT)
    proc = cli(command, str(path))
    assert proc.returncode == 2
    assert f"{path}:8:5: faults.0.signall: unknown key 'signall'" in proc.stderr
    assert "did you mean 'signal'?" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_validate_accepts_the_shipped_scenarios() -> None:
    proc = cli("validate", str(ROOT / "scenarios"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") >= 3


def test_missing_path_exits_2() -> None:
    proc = cli("validate", "no/such/file.yaml")
    assert proc.returncode == 2
    assert "no/such/file.yaml:1:1: no such file or folder" in proc.stderr


def test_faults_catalogue_json() -> None:
    proc = cli("faults", "--json")
    assert proc.returncode == 0
    kinds = {row["kind"]: row for row in json.loads(proc.stdout)}
    assert {"process.kill", "process.term", "process.freeze"} <= set(kinds)
    assert "SIGSTOP" in kinds["process.freeze"]["caused_by"]


def test_unknown_fault_kind_in_catalogue_exits_2() -> None:
    proc = cli("faults", "nope.nothing")
    assert proc.returncode == 2
    assert "unknown fault kind 'nope.nothing'" in proc.stderr


def test_schema_is_json_schema() -> None:
    proc = cli("schema")
    schema = json.loads(proc.stdout)
    assert schema["title"] == "Aftershock scenario"
    assert "system" in schema["properties"]


def quick(tmp_path: Path, name: str, extra: str = "") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(quick_scenario(name, extra))
    return path


@pytest.mark.slow
def test_run_writes_json_and_junit_and_report_rerenders(tmp_path: Path) -> None:
    scenario = quick(tmp_path, "quick-pass", """\
faults:
  - kind: process.freeze
    target: {rank: 0}
    at: {step: 3}
    duration: 200ms
expect:
  time_to_recover: {max: 10s}
""")
    proc = cli("run", str(scenario), "--json", str(tmp_path / "out.json"),
               "--junit", str(tmp_path / "out.xml"), "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads((tmp_path / "out.json").read_text())
    assert record["passed"] is True
    assert {c["name"] for c in record["checks"]} == {"completes", "faults_injected",
                                                     "time_to_recover"}
    fault = record["faults"][0]
    assert fault["kind"] == "process.freeze"
    assert fault["healed_at_s"] - fault["injected_at_s"] == pytest.approx(0.2, abs=0.15)
    run_dir = Path(record["run_dir"])
    for name in ("events.jsonl", "scenario.yaml", "result.json", "logs/launcher.stdout.log"):
        assert (run_dir / name).exists(), name
    junit = (tmp_path / "out.xml").read_text()
    assert 'name="quick-pass"' in junit
    assert "<failure" not in junit
    again = cli("report", str(run_dir))
    assert again.returncode == 0
    assert "time_to_recover" in again.stdout


@pytest.mark.slow
def test_failed_check_exits_1_and_names_it(tmp_path: Path) -> None:
    scenario = quick(tmp_path, "quick-fail", """\
faults:
  - kind: process.freeze
    target: {rank: 1}
    at: {step: 3}
    duration: 300ms
expect:
  time_to_recover: {max: 1ms}
""")
    proc = cli("run", str(scenario), "--json", "-", "--junit", str(tmp_path / "out.xml"),
               "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1
    (record,) = json.loads(proc.stdout)  # --json - : the record alone on stdout
    failed = [c for c in record["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["time_to_recover"]
    assert failed[0]["expected"] == "<= 1ms"
    # The table (on stderr when the record takes stdout): the failed row shows its
    # observed value next to the expected one, and the summary counts the failure.
    line = next(ln for ln in proc.stderr.splitlines() if "time_to_recover" in ln)
    assert "FAIL" in line
    assert "<= 1ms" in line
    assert "1 failed" in proc.stderr
    assert "<failure" in (tmp_path / "out.xml").read_text()


@pytest.mark.slow
def test_a_crashing_system_fails_completes(tmp_path: Path) -> None:
    path = tmp_path / "crash.yaml"
    command = f"[{sys.executable}, -c, 'raise SystemExit(3)']"
    path.write_text(f"name: crash\nsystem: {{command: {command}}}\n")
    proc = cli("run", str(path), "--json", "-", "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1
    (record,) = json.loads(proc.stdout)
    assert record["checks"][0]["observed"] == "exit 3"
