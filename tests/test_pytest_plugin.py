"""The pytest plugin, through pytester in a subprocess (pytest-timeout's way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "fixtures" / "ranks_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def scenario(name: str, budget: str) -> str:
    return f"""\
name: {name}
system:
  command: [{sys.executable}, {JOB}]
  env: {{JOB_RANKS: "2", JOB_DURATION: "1.5"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
faults:
  - kind: process.freeze
    target: {{rank: 1}}
    at: {{step: 3}}
    duration: 300ms
expect:
  time_to_recover: {{max: {budget}}}
"""


def test_scenarios_are_collected_and_checked(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", good=scenario("good-one", "20s"), bad=scenario("bad-one", "1ms"))
    pytester.makefile(".yml", unrelated="just: data\n")
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines([
        "*bad.yaml::bad-one FAILED*",
        "*good.yaml::good-one PASSED*",
        "*checks failed: time_to_recover*",
        "*time_to_recover*FAIL*<= 1ms*",
    ])
    result.assert_outcomes(passed=1, failed=1)
    assert "Traceback" not in result.stdout.str()


def test_invalid_scenario_fails_with_its_position(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", broken="name: b\nsystem: {reference: trainer, stepz: 3}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*broken.yaml:2:30: system.stepz: unknown key 'stepz'*"])
    result.assert_outcomes(failed=1)


def test_plugin_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, _aftershock_pytestplugin; "
        "heavy = [m for m in ('torch', 'pydantic', 'rich', 'yaml', 'harness', 'typer') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
