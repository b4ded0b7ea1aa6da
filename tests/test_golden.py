"""Golden results of fault-free twins (harness/golden.py, `aftershock golden`).

A fault-free twin is computed by the current code, so a bug on the fault-free path (data
order, init, optimizer) is in the twin too and `params_match: fault_free` cannot see it. A
golden result, recorded on purpose and stored beside the scenarios, can.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from _helpers import ROOT

from harness.runner import run_scenario
from harness.spec import LoadedScenario, parse_scenario

FAULTS = ROOT / "scenarios" / "faults"
DATA_ORDER = ROOT / "tests" / "fixtures" / "broken" / "data_order"


def fault_free_copy(source: Path, folder: Path, env: dict[str, str]) -> LoadedScenario:
    """A shipped scenario without its faults, in ``folder`` with its folder's goldens: the
    same system (``env`` added), so the same fault-free twin and the same golden."""
    text = source.read_text()
    text = re.sub(r"\nfaults:\n(?:[ -].*\n)+", "\n", text)
    text = text.split("\nexpect:\n")[0]
    text += "\nexpect:\n  completes: true\n  params_match: fault_free\n"
    if env:
        shown = ", ".join(f"{k}: '{v}'" for k, v in env.items())
        text = text.replace("\nsystem:\n", f"\nsystem:\n  env: {{{shown}}}\n", 1)
    folder.mkdir(parents=True, exist_ok=True)
    if (source.parent / "golden.json").exists():
        shutil.copy(source.parent / "golden.json", folder / "golden.json")
    path = folder / source.name
    path.write_text(text)
    return LoadedScenario(parse_scenario(text, str(path)), path, text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bug_on_the_fault_free_path_fails_against_the_golden(tmp_path: Path) -> None:
    loaded = fault_free_copy(FAULTS / "process_term_restart.yaml", tmp_path / "scenarios",
                             {"PYTHONPATH": f"{DATA_ORDER}{os.pathsep}{ROOT}"})
    assert not loaded.spec.faults
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    assert "[broken variant]" in (tmp_path / "run" / "logs" / "launcher.stderr.log").read_text()
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed
    # The twin has the same bug: the run equals it, whatever the bug.
    assert checks["params_match"].passed
    golden = checks["fault_free_golden"]
    assert not golden.passed, golden.message
    assert "differ" in golden.message
    assert not result.passed
