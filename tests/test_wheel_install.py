"""The package as a user installs it: the built wheel, pip-installed into a fresh virtual
environment outside the repository, puts one import name (``aftershock``) at the top of
site-packages with its console script and pytest plugin, and a user project
(tests/fixtures/user_project) runs there with no path to the checkout: a shipped scenario
through the pytest plugin and through ``aftershock.run``, an ``@given`` test over
``aftershock.strategies``, and a fault kind and a check from a separately installed plug-in
package (tests/fixtures/plugin_package).

The environment gets its dependencies without a download: each distribution the wheel's
metadata requires (with the ``explore`` and ``reference`` extras, and pytest for the user's
tests) is linked from this interpreter's site-packages into a folder of its own, named in a
``.pth`` file. Only those distributions: the checkout's editable install stays out of sight,
or the test would prove nothing.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from _helpers import ROOT
from packaging.requirements import Requirement

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: The public names (aftershock/__init__.py's __all__); docs/ teach only these.
PUBLIC = [
    "Applied", "Check", "CheckParams", "CheckResult", "Duration", "FaultKind", "FaultParams",
    "FaultRecord", "FaultUnavailable", "KindInfo", "LoadedScenario", "Observer", "Run",
    "RunResult", "Scenario", "Setting", "UndoContext", "__version__", "check", "from_dict",
    "load", "loads", "probe", "run", "strategies",
]
#: The repository's folders a wheel installs under `aftershock` (pyproject's package-dir).
PACKAGES = {"aftershock": "aftershock", "harness": "aftershock/harness",
            "faults": "aftershock/faults", "reference_impl": "aftershock/reference_impl"}
#: The cheapest shipped scenario that runs real processes with a fault: two reference
#: trainer ranks (torch, Gloo), an Xid that is only logged, and a fault-free twin.
SHIPPED = ROOT / "scenarios" / "faults" / "xid_63_log_only.yaml"
USER_PROJECT = ROOT / "tests" / "fixtures" / "user_project"
PLUGIN_PACKAGE = ROOT / "tests" / "fixtures" / "plugin_package"
#: What the user's environment needs beside the wheel's core requirements.
EXTRAS = ("explore", "reference")
USER_NEEDS = ("pytest",)
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", ".aftershock")


@dataclass(frozen=True)
class Venv:
    root: Path
    site: Path
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def run(self, *argv: str, cwd: Path, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)


def build_wheel(source: Path, out: Path) -> Path:
    """``source`` (copied out of the checkout first: a build writes build/ and *.egg-info
    beside its sources, and a stale build/ would put removed modules in the wheel)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, text=True, timeout=180)
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheel_install")
    assert not folder.resolve().is_relative_to(ROOT)
    return folder


@pytest.fixture(scope="module")
def wheel(work: Path) -> Path:
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=_SKIP)
    return build_wheel(source, work / "dist")


def requirement_closure(wheel: Path) -> list[importlib.metadata.Distribution]:
    """The installed distributions that the wheel's requirements (core, EXTRAS) and
    USER_NEEDS call for, with their own requirements, found in this interpreter."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    wanted = [Requirement(line.split(":", 1)[1].strip()) for line in metadata.splitlines()
              if line.startswith("Requires-Dist:")]
    wanted = [r for r in wanted
              if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in EXTRAS)]
    wanted += [Requirement(name) for name in USER_NEEDS]
    found: dict[str, importlib.metadata.Distribution] = {}
    while wanted:
        requirement = wanted.pop()
        key = requirement.name.lower().replace("_", "-")
        if key in found:
            continue
        dist = importlib.metadata.distribution(requirement.name)
        found[key] = dist
        for line in dist.requires or []:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                wanted.append(r)
    return list(found.values())


def link_distributions(dists: list[importlib.metadata.Distribution], folder: Path) -> None:
    """Each distribution's top-level files and folders (its RECORD), linked into ``folder``."""
    folder.mkdir()
    for dist in dists:
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            link = folder / top
            if not link.exists():
                link.symlink_to(Path(str(dist.locate_file(top))))


@pytest.fixture(scope="module")
def venv(work: Path, wheel: Path) -> Venv:
    """A fresh environment with the wheel and the plug-in package installed by pip."""
    root = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=60)
    (site,) = root.glob("lib/python3*/site-packages")
    deps = work / "deps"
    link_distributions(requirement_closure(wheel), deps)
    (site / "_user_deps.pth").write_text(f"{deps}\n")

    plugin_source = work / "plugin_source"
    shutil.copytree(PLUGIN_PACKAGE, plugin_source, ignore=_SKIP)
    plugin = build_wheel(plugin_source, work / "plugin_dist")
    # This interpreter's pip, installing into the new environment (which has none): with
    # its dependencies resolved against what it can see, and no index to fall back on.
    pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python")]
    installed = subprocess.run([*pip, "install", "--no-index", str(wheel), str(plugin)],
                               capture_output=True, text=True, timeout=180)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    checked = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # Nothing of the checkout: no PYTHONPATH, no path or bin folder inside it, no state of
    # the test's own (heal journal, cache) shared with the user's runs.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "AFTERSHOCK_", "PYTEST_", "VIRTUAL_ENV", "HYPOTHESIS"))}
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(ROOT)]
    env["PATH"] = os.pathsep.join([str(root / "bin"), *path])
    env["AFTERSHOCK_STATE_DIR"] = str(work / "state")
    env["AFTERSHOCK_CACHE_DIR"] = str(work / "cache")
    return Venv(root, site, env)


def test_the_wheel_holds_only_the_aftershock_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        top_level = z.read(f"{info}/top_level.txt").decode().split()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(f"{info}/entry_points.txt").decode())
    assert top_level == ["aftershock"]
    assert {n.split("/")[0] for n in names} == {"aftershock", info}
    assert dict(entry_points["console_scripts"]) == {"aftershock": "aftershock.harness.cli:main"}
    assert dict(entry_points["pytest11"]) == {"aftershock": "aftershock.pytest_plugin"}
    # Every file of the installed folders, and nothing else: a subpackage or a data file
    # that pyproject's package lists miss would be absent from every install.
    expected = set()
    for folder, under in PACKAGES.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts \
                    and path.suffix != ".pyc" and not path.parent.is_symlink():
                expected.add(f"{under}/{path.relative_to(ROOT / folder).as_posix()}")
    assert {n for n in names if not n.startswith(info)} == expected
    assert {"aftershock/py.typed", "aftershock/harness/py.typed",
            "aftershock/harness/reporting/templates/report.html.j2"} <= names


def test_the_environment_sees_the_install_its_commands_and_public_names(
    venv: Venv, tmp_path: Path,
) -> None:
    probe = """\
import importlib.metadata, importlib.util, json, sys
from pathlib import Path
import aftershock
print(json.dumps({
    "file": aftershock.__file__,
    "dists": [str(d.locate_file("")) for d in importlib.metadata.distributions()
              if d.metadata["Name"] == "aftershock"],
    "installed": sorted({f.parts[0] for f in importlib.metadata.distribution("aftershock").files}),
    "path": sys.path,
    "others": [n for n in ("harness", "faults", "reference_impl", "_aftershock_pytestplugin")
               if importlib.util.find_spec(n) is not None],
    "editable": [str(f) for p in sys.path if Path(p).is_dir()
                 for f in Path(p).glob("__editable__*")],
}))
"""
    seen = venv.run(venv.python, "-c", probe, cwd=tmp_path)
    assert seen.returncode == 0, seen.stderr
    facts = json.loads(seen.stdout)
    assert facts["dists"] == [str(venv.site)]
    # What pip put at the top of site-packages (and `..`: bin/aftershock).
    assert [n for n in facts["installed"] if n != ".."] == [
        "aftershock", f"aftershock-{importlib.metadata.version('aftershock')}.dist-info"]
    assert Path(facts["file"]).is_relative_to(venv.site)
    assert facts["others"] == []
    assert facts["editable"] == []
    assert not [p for p in facts["path"] if p and Path(p).resolve().is_relative_to(ROOT)]

    version = venv.run(str(venv.root / "bin" / "aftershock"), "--version", cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert importlib.metadata.version("aftershock") in version.stdout
    helped = venv.run(venv.python, "-m", "aftershock", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "Usage" in helped.stdout
    names = venv.run(venv.python, "-c", "import aftershock, json\n"
                     "print(json.dumps(aftershock.__all__))\n"
                     "[getattr(aftershock, name) for name in aftershock.__all__]", cwd=tmp_path)
    assert names.returncode == 0, names.stderr
    assert json.loads(names.stdout) == PUBLIC


def test_a_user_project_runs_scenarios_strategies_and_plugins(
    venv: Venv, work: Path,
) -> None:
    project = work / "user_project"
    shutil.copytree(USER_PROJECT, project, ignore=_SKIP)
    shutil.copy2(SHIPPED, project / "shipped.yaml")
    report = project / "report.xml"
    # The scenario file first: its fault-free twin, run once, is in the cache when the API
    # runs the same scenario.
    ran = venv.run(venv.python, "-m", "pytest", "shipped.yaml", "test_user.py",
                   f"--junitxml={report}", cwd=project, timeout=330)
    assert report.is_file(), ran.stdout[-6000:] + ran.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        verdict = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = verdict[0] if verdict else "passed"
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert outcomes == {
        "fault-gpu-xid-63": "passed",
        "test_the_shipped_scenario_through_the_api": "passed",
        "test_any_notice_is_read_and_the_job_finishes": "passed",
        "test_a_fault_kind_and_a_check_from_a_plugin_package": "passed",
    }, ran.stdout[-6000:]
