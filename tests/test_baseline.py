"""The fault-free twin's cache, on its own: it runs the twin only through the function it
is handed (the run loop is not its business), and keeps what a good twin produced."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aftershock.harness.run.records import Event
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario, Scenario
from aftershock.harness.twin import baseline
from aftershock.harness.verdict.checks import Outcome

TEXT = """\
name: twin
system: {reference: trainer, step_sleep: 20ms, world: {replicas: 2, shards: 1}}
faults:
  - {kind: process.kill, target: {rank: 1}, at: {step: 5}}
expect: {params_match: fault_free}
"""


def digests_run(calls: list[Scenario], *, exit_code: int = 0) -> Any:
    def run(twin: Scenario) -> Any:
        calls.append(twin)
        events = [Event(2.0, "params", "rank0", {"rank": 0, "digest": "aa"}),
                  Event(2.0, "params", "rank1", {"rank": 1, "digest": "bb"})]
        return SimpleNamespace(events=events, outcome=Outcome(exit_code, False, 2.0))

    return run


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LoadedScenario:
    monkeypatch.setenv(baseline.CACHE_ENV, str(tmp_path / "cache"))
    return LoadedScenario(parse_scenario(TEXT), tmp_path / "twin.yaml", TEXT)


def test_the_twin_runs_through_the_function_handed_in_then_comes_from_the_cache(
    loaded: LoadedScenario, tmp_path: Path,
) -> None:
    calls: list[Scenario] = []
    found, note = baseline.fault_free_result(loaded, seed=3, run_dir=tmp_path / "ff",
                                             use_cache=True, what="digests",
                                             run=digests_run(calls))
    assert found == {"0": "aa", "1": "bb"}
    assert note == f"ran ({tmp_path / 'ff'})"
    (twin,) = calls
    assert twin.faults == []  # the twin goes without faults ...
    assert twin.system.step_sleep == timedelta(0)  # ... and without pacing
    assert twin.system.world == loaded.spec.system.world  # but with the same math

    again, note = baseline.fault_free_result(loaded, seed=3, run_dir=tmp_path / "ff",
                                             use_cache=True, what="digests",
                                             run=digests_run(calls))
    assert again == found
    assert note.startswith("cached (")
    assert len(calls) == 1
    # Another seed is another twin.
    baseline.fault_free_result(loaded, seed=4, run_dir=tmp_path / "ff", use_cache=True,
                               what="digests", run=digests_run(calls))
    assert len(calls) == 2


def test_a_twin_cached_on_another_platform_is_not_reused(
    loaded: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The twin's bits depend on the kernels torch dispatches to (ATEN_CPU_CAPABILITY, the
    # CPU, the torch installation): digests cached under AVX-512 are not an AVX2 run's.
    calls: list[Scenario] = []

    def twin(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        baseline.fault_free_result(loaded, seed=3, run_dir=tmp_path / "ff", use_cache=True,
                                   what="digests", run=digests_run(calls))

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    twin()
    twin()
    assert len(calls) == 1
    twin(ATEN_CPU_CAPABILITY="avx2")
    assert len(calls) == 2  # another ISA: run again
    twin(ATEN_CPU_CAPABILITY="avx2")
    assert len(calls) == 2


def test_a_failed_twin_is_neither_a_result_nor_cached(
    loaded: LoadedScenario, tmp_path: Path,
) -> None:
    calls: list[Scenario] = []
    found, note = baseline.fault_free_result(loaded, seed=0, run_dir=tmp_path / "ff",
                                             use_cache=True, what="digests",
                                             run=digests_run(calls, exit_code=1))
    assert found is None
    assert "fault-free run failed (exit 1)" in note
    baseline.fault_free_result(loaded, seed=0, run_dir=tmp_path / "ff", use_cache=True,
                               what="digests", run=digests_run(calls))
    assert len(calls) == 2  # ran again: nothing was kept from the failed one


def test_the_baseline_module_does_not_import_the_run_loop() -> None:
    import ast

    tree = ast.parse(Path(baseline.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not {m for m in imported if m and m.startswith("aftershock.harness.run.runner")}


def test_two_harnesses_caching_the_same_twin_at_once_both_succeed(
    loaded: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two harness processes (`pytest -n 2` over scenarios of one system, two `aftershock run`s
    # side by side) find the cache empty, run the same twin and write the same entry. They
    # used to share one temporary file: the second os.replace found it gone and the run
    # ended in a harness error. Both writers are held just before their replace.
    import os
    import threading

    real_replace = os.replace
    both_written = threading.Barrier(2, timeout=10)

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).parent.name == "fault_free":
            both_written.wait()
        real_replace(src, dst)

    monkeypatch.setattr(baseline.os, "replace", replace)
    results: list[Any] = []
    errors: list[BaseException] = []

    def harness() -> None:
        try:
            results.append(baseline.fault_free_result(
                loaded, seed=3, run_dir=tmp_path / "ff", use_cache=True, what="digests",
                run=digests_run([])))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=harness) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert errors == []
    assert [found for found, _ in results] == [{"0": "aa", "1": "bb"}] * 2
    (entry,) = (tmp_path / "cache" / "fault_free").iterdir()  # no temporary file left
    assert entry.suffix == ".json"
    again, note = baseline.fault_free_result(loaded, seed=3, run_dir=tmp_path / "ff",
                                             use_cache=True, what="digests",
                                             run=digests_run([]))
    assert again == {"0": "aa", "1": "bb"}
    assert note.startswith("cached (")
