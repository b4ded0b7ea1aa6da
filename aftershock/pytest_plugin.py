"""pytest plugin: scenario YAML files are test items.

Importing only the standard library and pytest at import time (not ``aftershock.harness``),
so that installing Aftershock costs every pytest run
nothing; the harness is imported when a scenario item actually runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

_SCENARIO_HINT = re.compile(r"^system\s*:", re.MULTILINE)
_NAME = re.compile(r"^name\s*:\s*['\"]?([^'\"\n#]+)", re.MULTILINE)


class AftershockHooks:
    """Hooks other plugins may implement."""

    def pytest_aftershock_result(self, item: pytest.Item, result: Any) -> None:
        """Called with each scenario's RunResult (aftershock.harness.run.records) after it ran."""

    def pytest_aftershock_exploration(self, item: pytest.Item, exploration: Any) -> None:
        """Called with each scenario's Exploration (aftershock.harness.search.explore) after
        ``--aftershock-explore`` searched it."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(AftershockHooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aftershock", "Aftershock scenarios")
    group.addoption("--aftershock-seed", type=int, default=None,
                    help="override every scenario's seed")
    group.addoption("--aftershock-run-dir", default=None, metavar="DIR",
                    help="keep each scenario's run folder under DIR (default: pytest's "
                    "temporary folder, --basetemp)")
    group.addoption("--aftershock-no-cache", action="store_true", default=False,
                    help="re-run fault-free baselines instead of reusing cached ones")
    group.addoption("--aftershock-explore", type=int, default=None, metavar="N",
                    help="explore every collected scenario that has an `explore:` block: "
                    "try N fault schedules, shrink what fails (docs/explore.md)")
    group.addoption("--aftershock-explore-seed", type=int, default=None,
                    help="seed of the search (default: random, shown with each result)")
    parser.addini("aftershock_collect", type="bool", default=True,
                  help="collect scenario YAML files (files with a top-level `system:` key)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "aftershock: an Aftershock scenario run as a test")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix not in (".yaml", ".yml"):
        return None
    if not parent.config.getini("aftershock_collect"):
        return None
    explicit = any(Path(str(a).split("::")[0]).resolve() == file_path.resolve()
                   for a in parent.config.args)
    try:
        text = file_path.read_text(encoding="utf-8")
    except OSError:
        return None
    if explicit or _SCENARIO_HINT.search(text):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


def _folder_name(name: str) -> str:
    """A test's or scenario's name as one folder name: a scenario's name as it is (its
    pattern allows only [a-z0-9._-]), a parametrized test's brackets and the like as ``_``."""
    return re.sub(r"[^\w.-]", "_", name)[:100].lstrip(".") or "scenario"


def _run_root(config: pytest.Config, name: str) -> Path:
    """Where the runs of the scenario or test ``name`` go: DIR/name with --aftershock-run-dir,
    else a new folder in pytest's temporary folder, so runs do not pile up in the working
    folder and pytest's retention rule (the last 3 sessions) removes them."""
    chosen = config.getoption("--aftershock-run-dir")
    if chosen:
        return Path(chosen) / _folder_name(name)
    # The tmp_path fixture's factory; absent only under ``-p no:tmpdir``.
    factory = getattr(config, "_tmp_path_factory", None)
    if isinstance(factory, pytest.TempPathFactory):
        return factory.mktemp(_folder_name(name), numbered=True)
    import tempfile
    return Path(tempfile.mkdtemp(prefix=f"aftershock-{_folder_name(name)}-"))


class AftershockFixture:
    """What the ``aftershock`` fixture gives a test: aftershock.harness.api, with each run in the
    test's own temporary folder (or under --aftershock-run-dir) and the command line's
    --aftershock-* options applied."""

    def __init__(self, root: Path, config: pytest.Config) -> None:
        self.root = root
        self._config = config
        self._runs = 0

    def load(self, path: str | Path) -> Any:
        from aftershock.harness import api
        return api.load(path)

    def loads(self, text: str, *, folder: str | Path = ".") -> Any:
        from aftershock.harness import api
        return api.loads(text, folder=folder)

    def run(self, scenario: Any, *, seed: int | None = None, check: bool = False) -> Any:
        """Run a scenario (a file, or what ``load``/``loads`` gave) into ``root/run-N``;
        ``check``: fail the test with the check table unless it passed."""
        from aftershock.harness import api
        self._runs += 1
        option = self._config.getoption("--aftershock-seed")
        result = api.run(scenario, run_dir=self.root / f"run-{self._runs}",
                         seed=seed if seed is not None else option,
                         use_cache=not self._config.getoption("--aftershock-no-cache"))
        return api.check(result) if check else result


@pytest.fixture
def aftershock(tmp_path: Path, request: pytest.FixtureRequest) -> AftershockFixture:
    """Run Aftershock scenarios from a test: ``aftershock.run("kill.yaml", check=True)``."""
    if request.config.getoption("--aftershock-run-dir"):
        return AftershockFixture(_run_root(request.config, request.node.name), request.config)
    return AftershockFixture(tmp_path, request.config)


class ScenarioFile(pytest.File):
    def collect(self) -> list[pytest.Item]:
        text = self.path.read_text(encoding="utf-8")
        match = _NAME.search(text)
        name = match.group(1).strip() if match else self.path.stem
        item = ScenarioItem.from_parent(self, name=name)
        item.add_marker("aftershock")
        return [item]


class ScenarioFailed(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class ScenarioItem(pytest.Item):
    def runtest(self) -> None:
        __tracebackhide__ = True
        from aftershock.harness.errors import AftershockError, SpecError
        from aftershock.harness.reporting.report import check_table_text
        from aftershock.harness.run.runner import run_scenario
        from aftershock.harness.scenario.load import load_scenario

        config = self.config
        try:
            loaded = load_scenario(self.path)
        except SpecError as exc:
            raise ScenarioFailed("invalid scenario:\n" + "\n".join(exc.problems)) from None
        run_root = _run_root(config, loaded.spec.name)
        if config.getoption("--aftershock-explore") and loaded.spec.explore is not None:
            self._explore(loaded, run_root)
            return
        try:
            result = run_scenario(
                loaded,
                run_dir=run_root,
                seed=config.getoption("--aftershock-seed"),
                use_cache=not config.getoption("--aftershock-no-cache"),
            )
        except AftershockError as exc:
            raise ScenarioFailed(f"harness error: {exc}") from None
        self.user_properties.append(("run_dir", result.run_dir))
        for key, value in result.metrics.items():
            self.user_properties.append((key, value))
        config.hook.pytest_aftershock_result(item=self, result=result)
        if not result.passed:
            failed = ", ".join(c.name for c in result.failed_checks())
            raise ScenarioFailed(f"checks failed: {failed}\n{check_table_text(result)}")

    def _explore(self, loaded: Any, run_root: Path) -> None:
        """Search the scenario's `explore:` space instead of running its own faults once."""
        __tracebackhide__ = True
        import random

        from aftershock.harness.errors import AftershockError
        from aftershock.harness.search.explore import explore

        config = self.config
        seed = config.getoption("--aftershock-explore-seed")
        seed = random.randrange(2**32) if seed is None else seed
        out = run_root / "explore"
        try:
            exploration = explore(
                loaded, runs=config.getoption("--aftershock-explore"), seed=seed, out=out,
                database=Path(".aftershock") / "hypothesis",
                use_cache=not config.getoption("--aftershock-no-cache"))
        except AftershockError as exc:
            raise ScenarioFailed(f"harness error: {exc}") from None
        self.user_properties += [("explore_seed", seed), ("explore_runs", exploration.runs),
                                 ("runs_per_minute", exploration.runs_per_minute)]
        config.hook.pytest_aftershock_exploration(item=self, exploration=exploration)
        for finding in exploration.findings:
            self.add_report_section("call", "explore", f"{finding.status}: {finding.schedule} "
                                    f"({finding.failures} failed, {finding.passes} passed); "
                                    f"{finding.file}")
            if finding.status == "confirmed":
                raise ScenarioFailed(
                    f"explore found a failing schedule (seed {seed}, {exploration.runs} runs): "
                    f"{finding.schedule}\nfailed {finding.failures} of "
                    f"{finding.failures + finding.passes} run(s): {finding.message}\n"
                    f"written to {finding.file} (keep it as a regression scenario)")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ScenarioFailed):
            return excinfo.value.text
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"scenario: {self.name}"
