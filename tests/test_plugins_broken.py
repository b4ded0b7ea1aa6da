"""Plug-ins that cannot break the tool: a broken one, from a real installed distribution (its
own .dist-info with entry_points.txt on the path of an `aftershock` process), is one warning
line naming its distribution and entry point; scenarios that do not use it run as before,
one that does fails with that line and exit 3; AFTERSHOCK_NO_PLUGINS=1 loads none."""

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

from aftershock.faults import CAPABILITIES

pytestmark = pytest.mark.timeout(120)

WARNING = "aftershock: warning: plug-in skipped: "

PLAIN = f"""\
name: plain
system:
  command: [{sys.executable}, -c, "print('hi')"]
faults: []
"""


def install(site: Path, dist: str, version: str, entry_points: str,
            modules: dict[str, str]) -> None:
    """A distribution as pip leaves it: its modules, and a .dist-info naming its entry
    points (what importlib.metadata reads)."""
    site.mkdir(exist_ok=True)
    for name, code in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(code))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def aftershock(*args: str, site: Path, cwd: Path, no_plugins: bool = False
               ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AFTERSHOCK_NO_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    if no_plugins:
        env["AFTERSHOCK_NO_PLUGINS"] = "1"
    return subprocess.run([sys.executable, "-m", "aftershock", *args], capture_output=True,
                          text=True, timeout=100, cwd=cwd, env=env)


def warnings_of(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(WARNING)]


def uses(path: Path, fault: str) -> Path:
    path.write_text(PLAIN.replace("faults: []", f"faults:\n  - {fault}"))
    return path


KINDS = """\
from aftershock.faults import Applied, KindInfo
from aftershock.faults.params import FaultParams


class _Kind:
    params = FaultParams
    needs = frozenset({"signals"})

    def inject(self, target, params, journal):
        return Applied(self.info.kind, None, {}, "nothing")

    def revert(self, undo):
        pass


def _info(kind):
    return KindInfo(kind=kind, summary="a test kind", caused_by="nothing")


class NoInfo(_Kind):  # the attribute every command used to trip over
    pass


class Typo(_Kind):
    info = _info("typo.kind")
    acts = "outsde"


class Bare:  # all a kind needs from Python, but no `params`: nothing for a scenario
    info = _info("bare.kind")
    inject, revert = _Kind.inject, _Kind.revert


class Good(_Kind):
    info = _info("good.kind")


class NeedsGpus(_Kind):
    info = _info("gpus.kind")
    needs = frozenset({"gpus"})


NO_INFO, TYPO, BARE = NoInfo(), Typo(), Bare()
SEVERAL = [Good(), NeedsGpus()]
"""


def test_a_kind_without_info_is_one_line_and_other_scenarios_still_run(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, "aftershock-broken", "0.3",
            "[aftershock.faults]\npreempt_notice = broken_kinds:NO_INFO\n",
            {"broken_kinds": KINDS})
    plain = tmp_path / "plain.yaml"
    plain.write_text(PLAIN)

    checked = aftershock("validate", str(plain), site=site, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == f"ok {plain}\n"
    (line,) = checked.stderr.splitlines()  # one line, and nothing else: no traceback
    assert line == (f"{WARNING}aftershock-broken 0.3, entry point aftershock.faults: "
                    "preempt_notice = broken_kinds:NO_INFO: fault kind (a NoInfo): no `info` "
                    "(a faults.KindInfo with a dotted lower-case `kind`, a `summary` and "
                    "`caused_by`)")

    run = aftershock("run", str(plain), "--plain", "--run-dir", str(tmp_path / "runs"),
                     site=site, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert warnings_of(run) == [line]
    listed = aftershock("faults", "--json", site=site, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "process.kill" in {k["kind"] for k in json.loads(listed.stdout)}

    # A scenario that uses it is not wrong: the installation is. Exit 3, naming the plug-in.
    used = uses(tmp_path / "used.yaml", "{kind: preempt.notice, at: {time: 1s}}")
    for command in ("validate", "run"):
        refused = aftershock(command, str(used), site=site, cwd=tmp_path)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"{used}:5:12: faults.0.kind: plug-in skipped: aftershock-broken 0.3" in (
            refused.stderr)
        assert "Traceback" not in refused.stderr
    asked = aftershock("faults", "preempt.notice", site=site, cwd=tmp_path)
    assert asked.returncode == 3
    assert "aftershock: plug-in skipped: aftershock-broken 0.3" in asked.stderr


def test_a_misspelt_acts_a_capability_and_missing_params_are_refused_saying_what_is_allowed(
        tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, "aftershock-sloppy", "1.0",
            "[aftershock.faults]\ntypo = broken_kinds:TYPO\nbare = broken_kinds:BARE\n"
            "several = broken_kinds:SEVERAL\n", {"broken_kinds": KINDS})
    listed = aftershock("faults", "--json", site=site, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    kinds = {k["kind"] for k in json.loads(listed.stdout)}
    assert "good.kind" in kinds  # the good one of a list still registers
    assert not {"typo.kind", "bare.kind", "gpus.kind"} & kinds
    problems = {line.split(" = ")[1].split(":")[1]: line for line in warnings_of(listed)}
    assert sorted(problems) == ["BARE", "SEVERAL", "TYPO"]
    assert problems["TYPO"].endswith(
        "`acts` is 'outsde'; allowed: 'outside', 'inside', 'either'")
    assert problems["BARE"].endswith(
        "fault kind bare.kind: no `params` (an aftershock.faults.params.FaultParams "
        "model; `params = "
        "FaultParams` for a kind without parameters), so no scenario can use it"
    )
    assert "item 1: fault kind gpus.kind: `needs` is" in problems["SEVERAL"]
    assert (
        f"`needs` is frozenset({{'gpus'}}), not a frozenset of {', '.join(CAPABILITIES)}"
    ) in problems["SEVERAL"]

    # A kind without `params` is named as such where it is used, not as "unknown kind".
    used = uses(tmp_path / "bare.yaml", "{kind: bare.kind, at: {time: 1s}}")
    refused = aftershock("validate", str(used), site=site, cwd=tmp_path)
    assert refused.returncode == 3
    assert "unknown kind" not in refused.stderr
    assert (
        f"{used}:5:12: faults.0.kind: plug-in skipped: aftershock-sloppy 1.0, entry point "
        "aftershock.faults: bare = broken_kinds:BARE: fault kind bare.kind: no `params`"
        in (refused.stderr)
    )
    good = uses(
        tmp_path / "good.yaml", "{kind: good.kind, target: {role: launcher}, at: {time: 1s}}"
    )
    assert aftershock("validate", str(good), site=site, cwd=tmp_path).returncode == 0


SYSTEMS = """\
class Half:  # a system kind with its declarations and none of its methods
    name = "script"
    tag = ("script", None)
    shape = "`script: FILE`"
    order = 100
    family = "training"
    golden = None


HALF = Half()
"""


def test_a_broken_system_kind_and_a_preset_that_cannot_be_imported_are_named(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    install(
        site,
        "aftershock-more",
        "2.1",
        "[aftershock.systems]\nscript = broken_systems:HALF\n"
        "[aftershock.presets]\nmyframe = not_there.presets:MYFRAME\n",
        {"broken_systems": SYSTEMS},
    )
    plain = tmp_path / "plain.yaml"
    plain.write_text(PLAIN)
    checked = aftershock("validate", str(plain), site=site, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    # The preset group is loaded only when a scenario asks for a preset.
    (system,) = warnings_of(checked)
    assert system.startswith(
        f"{WARNING}aftershock-more 2.1, entry point aftershock.systems: "
        "script = broken_systems:HALF: system kind script: "
    )
    assert "no `model` (a pydantic model (aftershock.harness.scenario.schema.Strict))" in system
    assert "no `launch` (a method)" in system

    script = tmp_path / "script.yaml"
    script.write_text("name: s\nsystem: {script: job.py}\nfaults: []\n")
    refused = aftershock("validate", str(script), site=site, cwd=tmp_path)
    assert refused.returncode == 3, refused.stderr
    assert f"{script}:2:9: system: plug-in skipped: aftershock-more 2.1" in refused.stderr

    preset = tmp_path / "preset.yaml"
    preset.write_text(
        PLAIN.replace("faults: []", "faults: []").replace(
            "  command:", "  preset: myframe\n  command:"
        )
    )
    refused = aftershock("validate", str(preset), site=site, cwd=tmp_path)
    assert refused.returncode == 3, refused.stderr
    assert (
        f"{preset}:3:11: system.preset: plug-in skipped: aftershock-more 2.1, entry point "
        "aftershock.presets: myframe = not_there.presets:MYFRAME: cannot be imported: "
        "ModuleNotFoundError: No module named 'not_there'"
    ) in refused.stderr


def test_no_plugins_loads_no_entry_point_at_all(tmp_path: Path) -> None:
    site = tmp_path / "site"
    marker = tmp_path / "imported"
    install(
        site,
        "aftershock-preempt-notice",
        "0.1.0",
        "[aftershock.faults]\npreempt_notice = aftershock_preempt_notice:NOTICE\n"
        "loud = loud:KIND\n",
        {"loud": f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\nKIND = 1\n"},
    )
    shutil.copy(
        ROOT / "tests" / "fixtures" / "plugin_package" / "aftershock_preempt_notice.py", site
    )
    notice = uses(tmp_path / "notice.yaml", "{kind: preempt.notice, at: {time: 1s}}")

    off = aftershock("faults", "--json", site=site, cwd=tmp_path, no_plugins=True)
    assert off.returncode == 0, off.stderr
    assert "preempt.notice" not in {k["kind"] for k in json.loads(off.stdout)}
    assert off.stderr == ""
    assert not marker.exists()  # not even imported
    refused = aftershock("validate", str(notice), site=site, cwd=tmp_path, no_plugins=True)
    assert refused.returncode == 2
    assert "unknown kind 'preempt.notice'" in refused.stderr
    assert not marker.exists()

    on = aftershock("faults", "--json", site=site, cwd=tmp_path)
    assert "preempt.notice" in {k["kind"] for k in json.loads(on.stdout)}
    assert marker.exists()
    (loud,) = warnings_of(on)
    assert loud.endswith(
        "loud = loud:KIND: fault kind (a int): no `info` (a faults.KindInfo with a dotted "
        "lower-case `kind`, a `summary` and `caused_by`); no `inject` (a method: "
        "inject(target, params, journal)); no `revert` (a method: revert(undo))"
    )
    assert aftershock("validate", str(notice), site=site, cwd=tmp_path).returncode == 0
