"""Where the pytest plugin puts run folders: pytest's temporary folder, or --aftershock-run-dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import quick_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCENARIO = quick_scenario("quick.one", "expect:\n  completes: true\n", duration=0.5)

# A test using the fixture, on the same scenario file.
FIXTURE_TEST = """\
def test_fixture_run(aftershock):
    aftershock.run("quick.yaml", check=True)
"""


def _runs(under: Path) -> list[Path]:
    """The run folders under ``under`` (each holds the harness's mark)."""
    return sorted(mark.parent for mark in under.rglob(".aftershock-run"))


def test_runs_go_to_pytests_temporary_folder_by_default(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", quick=SCENARIO)
    pytester.makepyfile(test_fixture=FIXTURE_TEST)
    basetemp = pytester.path.parent / "basetemp-of-the-run"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--basetemp={basetemp}")
    result.assert_outcomes(passed=2)
    assert not (pytester.path / ".aftershock").exists()
    runs = _runs(basetemp)
    assert len(runs) == 2, runs
    names = {run.relative_to(basetemp).parts[0] for run in runs}
    assert names == {"quick.one0", "test_fixture_run0"}
    assert _runs(pytester.path) == []


def test_run_dir_option_chooses_the_folder(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", quick=SCENARIO)
    pytester.makepyfile(test_fixture=FIXTURE_TEST)
    chosen = pytester.path.parent / "chosen-runs"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                           f"--aftershock-run-dir={chosen}")
    result.assert_outcomes(passed=2)
    assert _runs(chosen) == [chosen / "quick.one", chosen / "test_fixture_run" / "run-1"]
    assert not (pytester.path / ".aftershock").exists()
