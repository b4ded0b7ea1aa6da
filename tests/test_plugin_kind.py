"""A fault kind and a system kind from another package: installed with pip into a folder of
its own, found through the `aftershock.faults` and `aftershock.systems` entry points, and
used by scenarios with no change to Aftershock (tests/fixtures/plugin_package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import ROOT, read_events

PACKAGE = ROOT / "tests" / "fixtures" / "plugin_package"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The job checkpoints when it is told the machine goes: it waits for the notice and says
# how long it was given.
JOB = """\
import pathlib, sys, time
notice = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 20
while not notice.exists():
    if time.monotonic() > deadline:
        sys.exit("no notice")
    time.sleep(0.02)
print(f"notice read: {notice.read_text().strip()} s left", flush=True)
"""

SCENARIO = """\
name: preempted
system:
  command: [{python}, job.py, NOTICE]   # in its working folder, where file faults land
faults:
  - kind: preempt.notice
    at: {{time: 300ms}}
    path: NOTICE
    grace: 7s
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package, installed by pip (its own metadata: entry_points.txt) into a folder."""
    work = tmp_path_factory.mktemp("plugin")
    source = work / "source"
    shutil.copytree(PACKAGE, source)  # the build writes beside the sources: not in the repo
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True, timeout=180)
    assert list(target.glob("aftershock_preempt_notice-*.dist-info/entry_points.txt"))
    return target


def aftershock(*args: str, site: Path | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = [str(site)] if site is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "aftershock", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_an_installed_package_adds_a_fault_kind_a_scenario_can_use(
    site: Path, tmp_path: Path,
) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    scenario = tmp_path / "preempted.yaml"
    scenario.write_text(SCENARIO.format(python=sys.executable))

    # Without the package the kind does not exist ...
    alone = aftershock("validate", str(scenario), site=None, cwd=tmp_path)
    assert alone.returncode == 2
    assert "unknown kind 'preempt.notice'" in alone.stderr
    # ... with it, the catalogue lists it from its own declaration ...
    listed = aftershock("faults", "preempt.notice", "--json", site=site, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)
    assert entry["params"]["grace"].endswith("(duration; default 30s)")
    assert entry["needs"] == ["files"]
    # ... its parameters are checked like any kind's ...
    bad = scenario.with_name("bad.yaml")
    bad.write_text(scenario.read_text().replace("path: NOTICE", "path: ../NOTICE"))
    refused = aftershock("validate", str(bad), site=site, cwd=tmp_path)
    assert refused.returncode == 2
    assert f"{bad}:7:11: faults.0.path: path must be a relative path" in refused.stderr

    # ... and a scenario runs with it: applied, seen by the job, healed.
    out = tmp_path / "out.json"
    run = aftershock("run", str(scenario), "--json", str(out), "--run-dir",
                     str(tmp_path / "runs"), "--plain", site=site, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    (record,) = json.loads(out.read_text())
    (fault,) = record["faults"]
    assert fault["kind"] == "preempt.notice"
    assert fault["injected_at_s"] is not None
    run_dir = Path(record["run_dir"])
    assert "notice read: 7 s left" in (run_dir / "logs" / "launcher.stdout.log").read_text()
    assert not (run_dir / "work" / "NOTICE").exists()  # withdrawn when the run ended
    events = run_dir / "events.jsonl"
    assert [e["kind"] for e in read_events(events, "fault_injected")] == ["preempt.notice"]
    assert [e["kind"] for e in read_events(events, "fault_healed")] == ["preempt.notice"]


def test_an_installed_package_adds_a_system_kind(site: Path, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    scenario = tmp_path / "script.yaml"
    scenario.write_text(
        "name: script\nsystem: {script: job.py, args: ['${run_dir}/NOTICE']}\n"
        "faults:\n  - {kind: preempt.notice, at: {time: 300ms}, path: NOTICE, grace: 2s}\n")
    alone = aftershock("validate", str(scenario), site=None, cwd=tmp_path)
    assert alone.returncode == 2
    assert ("system needs `reference: trainer`, `reference: server`, `command: [...]`, "
            "`nodes: N` or `slurm: {nodes: N, ...}`") in alone.stderr
    # Its own rules and what its target offers are asked like a built-in kind's.
    missing = scenario.with_name("missing.yaml")
    missing.write_text(scenario.read_text().replace("job.py", "nowhere.py"))
    refused = aftershock("validate", str(missing), site=site, cwd=tmp_path)
    assert refused.returncode == 2
    assert f"{missing}:2:18: system.script: no such file" in refused.stderr
    inside = scenario.with_name("inside.yaml")
    inside.write_text(scenario.read_text().replace(
        "{kind: preempt.notice, at: {time: 300ms}, path: NOTICE, grace: 2s}",
        "{kind: collective.error, target: {rank: 0}, at: {step: 1}}"))
    refused = aftershock("validate", str(inside), site=site, cwd=tmp_path)
    assert refused.returncode == 2
    assert "a plain script does not call aftershock.harness.probe.install()" in refused.stderr
    listed = aftershock("faults", "--system", "script", "--json", site=site, cwd=tmp_path)
    kinds = {entry["kind"] for entry in json.loads(listed.stdout)}
    assert {"process.kill", "preempt.notice"} <= kinds
    assert "collective.error" not in kinds

    out = tmp_path / "out.json"
    run = aftershock("run", str(scenario), "--json", str(out), "--run-dir",
                     str(tmp_path / "runs"), "--plain", site=site, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    (record,) = json.loads(out.read_text())
    log = Path(record["run_dir"]) / "logs" / "launcher.stdout.log"
    assert "notice read: 2 s left" in log.read_text()
