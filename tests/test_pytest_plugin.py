"""The pytest plugin, through pytester in a subprocess (pytest-timeout's way)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _helpers import quick_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def scenario(name: str, budget: str) -> str:
    return quick_scenario(name, f"""\
faults:
  - kind: process.freeze
    target: {{rank: 1}}
    at: {{step: 3}}
    duration: 300ms
expect:
  time_to_recover: {{max: {budget}}}
""")


def test_scenarios_are_collected_and_checked(pytester: pytest.Pytester) -> None:
    # One pytest run (a subprocess costs seconds) collects a passing, a failing and an
    # invalid scenario, and leaves YAML that is not a scenario alone.
    pytester.makefile(".yaml", good=scenario("good-one", "20s"), bad=scenario("bad-one", "1ms"),
                      broken="name: b\nsystem: {reference: trainer, stepz: 3}\n")
    pytester.makefile(".yml", unrelated="just: data\n")
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines([
        "*bad.yaml::bad-one FAILED*",
        "*broken.yaml::b FAILED*",
        "*good.yaml::good-one PASSED*",
    ])
    # A failed check: the check table is the message.
    result.stdout.fnmatch_lines(["*checks failed: time_to_recover*",
                                 "*time_to_recover*FAIL*<= 1ms*"])
    # An invalid scenario: its position, no run.
    result.stdout.fnmatch_lines(["*broken.yaml:2:30: system.stepz: unknown key 'stepz'*"])
    result.assert_outcomes(passed=1, failed=2)
    assert "Traceback" not in result.stdout.str()


def test_plugin_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, aftershock.pytest_plugin; "
        "heavy = [m for m in ('torch', 'pydantic', 'rich', 'yaml', 'aftershock.harness', "
        "'aftershock.faults', 'typer') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
