"""Checks from other packages (the `aftershock.checks` entry points,
harness/verdict/check_registry.py):
one installed with pip asked for under `expect: {checks: ...}` passes a good run and fails a
broken one; a broken one is one warning line naming its distribution and entry point, and
only a scenario that asks for it fails (exit 3); a check that raises fails, not the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import ROOT

from aftershock.harness.errors import SpecError
from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import Expect
from aftershock.harness.verdict import check_registry
from aftershock.harness.verdict.checks import Outcome, evaluate

PACKAGE = ROOT / "tests" / "fixtures" / "plugin_package"
WARNING = "aftershock: warning: plug-in skipped: "

# The job reports a loss per step; the broken one diverges.
JOB = """\
import sys
from aftershock.harness import probe
probe.hello(world=1)
for step in range(1, 4):
    probe.step(step, world=1, loss=LOSS)
"""
GOOD, DIVERGES = "1.0 / step", "0.5 * 4 ** step"

SCENARIO = f"""\
name: learns
system:
  command: [{sys.executable}, job.py]
faults: []
expect:
  checks:
    final_loss: {{max: 0.5}}
"""


def aftershock(*args: str, site: Path | None, cwd: Path, no_plugins: bool = False
               ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AFTERSHOCK_NO_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([*([str(site)] if site else []), str(ROOT)])
    if no_plugins:
        env["AFTERSHOCK_NO_PLUGINS"] = "1"
    return subprocess.run([sys.executable, "-m", "aftershock", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_installed_check_passes_a_good_run_and_fails_a_broken_one(tmp_path: Path) -> None:
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                   "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-index", "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, capture_output=True, text=True, timeout=180)
    scenario = tmp_path / "learns.yaml"
    scenario.write_text(SCENARIO)

    alone = aftershock("validate", str(scenario), site=None, cwd=tmp_path)
    assert alone.returncode == 2
    assert f"{scenario}:7:5: expect.checks: unknown check 'final_loss'" in alone.stderr
    bad = scenario.with_name("bad.yaml")
    bad.write_text(SCENARIO.replace("max: 0.5", "max: lots"))
    refused = aftershock("validate", str(bad), site=site, cwd=tmp_path)
    assert refused.returncode == 2
    assert f"{bad}:7:5: expect.checks: checks.final_loss: max: Input should be a valid " \
        "number" in refused.stderr

    verdicts = {}
    for name, loss in (("good", GOOD), ("diverges", DIVERGES)):
        (tmp_path / "job.py").write_text(JOB.replace("LOSS", loss))
        out = tmp_path / f"{name}.json"
        run = aftershock("run", str(scenario), "--json", str(out), "--plain", "--run-dir",
                         str(tmp_path / "runs"), site=site, cwd=tmp_path)
        (record,) = json.loads(out.read_text())
        (check,) = [c for c in record["checks"] if c["name"] == "final_loss"]
        verdicts[name] = run.returncode, check["passed"], check["message"]
    assert verdicts["good"] == (0, True, "the last step reported loss 0.333333, within 0.5")
    assert verdicts["diverges"] == (1, False, "the last step reported loss 32, over 0.5")


def install(site: Path, dist: str, version: str, entry_points: str, code: str) -> None:
    """A distribution as pip leaves it: a module, and a .dist-info naming its entry points."""
    site.mkdir(exist_ok=True)
    (site / "broken_checks.py").write_text(textwrap.dedent(code))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


BROKEN = """\
class NoEvaluate:
    name = "loss_within"
    doc = "a check that forgot its evaluation"

class WrongTypes:
    name = "Loss Within"
    doc = 3
    model = int
    def evaluate(self, expect, run):
        return None

NO_EVALUATE, WRONG_TYPES = NoEvaluate(), WrongTypes()
"""


@pytest.mark.timeout(120)
def test_a_broken_check_is_one_line_and_other_scenarios_still_run(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, "aftershock-bad-checks", "0.2",
            "[aftershock.checks]\nloss_within = broken_checks:NO_EVALUATE\n"
            "loss_within_typed = broken_checks:WRONG_TYPES\n", BROKEN)
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"name: plain\nsystem:\n  command: [{sys.executable}, -c, pass]\n")

    run = aftershock("run", str(plain), "--plain", "--run-dir", str(tmp_path / "runs"),
                     site=site, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith(WARNING)]
    assert lines == [
        f"{WARNING}aftershock-bad-checks 0.2, entry point aftershock.checks: loss_within = "
        "broken_checks:NO_EVALUATE: check loss_within: no `evaluate` (a function "
        "(expectation, run) -> CheckResult)",
        f"{WARNING}aftershock-bad-checks 0.2, entry point aftershock.checks: "
        "loss_within_typed = broken_checks:WRONG_TYPES: check Loss Within: `name` is "
        "'Loss Within', not a lower-case name: letters, digits, '_'; `doc` is 3, not a "
        "one-line description; `model` is <class 'int'>, not a pydantic model (the check's "
        "arguments) or None",
    ]
    assert "Traceback" not in run.stderr

    used = tmp_path / "used.yaml"
    used.write_text(SCENARIO.replace("final_loss: {max: 0.5}", "loss_within: {percent: 1}"))
    refused = aftershock("validate", str(used), site=site, cwd=tmp_path)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert (f"{used}:7:18: expect.checks.loss_within: plug-in skipped: aftershock-bad-checks "
            "0.2, entry point aftershock.checks: loss_within = broken_checks:NO_EVALUATE"
            in refused.stderr)
    off = aftershock("validate", str(plain), site=site, cwd=tmp_path, no_plugins=True)
    assert off.returncode == 0
    assert off.stderr == ""


class _Within:
    name = "within"
    doc = "the run took at most `seconds`"
    model = None

    @staticmethod
    def evaluate(expect: bool, run: check_registry.Run) -> CheckResult:
        took = run.outcome.duration_s
        return CheckResult("within", took <= 5, took, "<= 5", f"took {took}s")


class _Raises:
    name = "raises"
    doc = "a check with a bug"

    @staticmethod
    def evaluate(expect: bool, run: check_registry.Run) -> CheckResult:
        raise ZeroDivisionError("division by zero")


def test_a_registered_check_runs_after_the_built_in_ones_and_cannot_break_them() -> None:
    with check_registry.PLUGINS.added(_Within()), check_registry.PLUGINS.added(_Raises()):
        expect = Expect(checks={"within": True, "raises": True})
        results = evaluate(expect, outcome=Outcome(0, False, 9.0), metrics={}, faults=[],
                           digests={}, baseline=None, events=[Event(0.0, "step", "rank0")])
        assert [(r.name, r.passed, r.message) for r in results] == [
            ("completes", True, "exited 0"),
            ("within", False, "took 9.0s"),
            ("raises", False, "not observed: the check raised ZeroDivisionError: division by "
             "zero"),
        ]
        with pytest.raises(SpecError) as refused:
            parse_scenario("name: x\nsystem: {command: [echo]}\nexpect:\n  checks:\n"
                           "    within: {seconds: 3}\n    params_match: fault_free\n",
                           "s.yaml")
        assert refused.value.problems == [
            "s.yaml:5:5: expect.checks: check 'within' takes no arguments: write `within: true`"]
    assert "within" not in check_registry.PLUGINS


def test_every_built_in_check_is_declared_once_and_documented() -> None:
    names = [c.name for c in check_registry.built_ins()]
    assert len(names) == len(set(names))
    fields = set(Expect.model_fields) - {"checks"}
    assert {c.field for c in check_registry.built_ins() if c.field} == fields
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert [n for n in names if f"| `{n}" not in doc] == []
    metrics = {c.metric for c in check_registry.built_ins() if c.metric}
    assert [m for m in sorted(metrics) if f"| `{m}` |" not in doc] == []  # its row
