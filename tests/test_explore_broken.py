"""Explore against deliberately broken reference trainers that every shipped scenario misses.

Each broken variant (tests/fixtures/broken/explore/sitecustomize.py, switched on through the
scenario's ``system.env``; the fault-free twin runs without it) shows only under a schedule
nobody wrote down: a second kill landing while the world recovers from a first, and a kill
between a checkpoint's shard writes and its commit. Explore must find it and shrink it within
40 runs, and what it writes must be minimal: removing any of its faults makes it pass. The
closest shipped scenario runs against the same variant and passes, which is the point.

``make test-explore`` runs this file as its own CI step (a few minutes: every run launches
the reference trainer under torchrun).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli, read_events

from aftershock.harness.run import runner
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario, Scenario
from aftershock.harness.search.explore import NOT_ORACLES, Exploration, explore, judge, run_schedule

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.explore, pytest.mark.timeout(1200)]

BROKEN = ROOT / "tests" / "fixtures" / "broken" / "explore"
VARIANT_ENV = "AFTERSHOCK_INJECT_BROKEN_TRAINER"
BUDGET = 40  # runs, everything included: search, shrinking, minimizing, confirming

RESTART = """\
name: {name}
system:
  reference: trainer
  world: {{replicas: 2, shards: 1}}
  recovery: restart
  steps: {steps}
  checkpoint_every: 10
  max_restarts: 3
  collective_timeout: 2s
  step_sleep: {sleep}
  env: {{PYTHONPATH: "{path}", {variant_env}: {variant}}}
faults:
  - kind: process.kill
    target: {{rank: 1}}
    at: {{step: 25}}
expect:
{expect}
explore:
{explore}
"""


def scenario(tmp_path: Path, *, name: str, variant: str, steps: int, expect: str,
             space: str, sleep: str = "10ms") -> LoadedScenario:
    path = tmp_path / f"{name}.yaml"
    python_path = os.pathsep.join(str(p) for p in (BROKEN, ROOT))
    path.write_text(RESTART.format(name=name, steps=steps, sleep=sleep, path=python_path,
                                   variant_env=VARIANT_ENV, variant=variant, expect=expect,
                                   explore=space))
    return load_scenario(path)


def search(base: LoadedScenario, tmp_path: Path, *, seed: int) -> Exploration:
    found = explore(base, runs=28, shrink_runs=10, confirm=1, seed=seed, database=None,
                    out=tmp_path / "out")
    assert found.runs <= BUDGET, found.runs
    assert found.findings, [(a.schedule, a.verdict, a.reason) for a in found.attempts]
    return found


def assert_minimal(base: LoadedScenario, finding_file: str, tmp_path: Path) -> list[Any]:
    """Each fault of the written scenario is needed: without it, the broken trainer passes.
    A fault triggered by what only the removed one caused (a kill at the second resume, when
    the removed kill made the first) then never lands: the run is discarded, every check
    passing."""
    spec = load_scenario(finding_file).spec
    for index in range(len(spec.faults)):
        fewer = [f for i, f in enumerate(spec.faults) if i != index]
        result = run_schedule(base, fewer, run_dir=tmp_path / f"without-{index}")
        if fewer:
            verdict, _, reason = judge(result)
            failed = [c.name for c in result.checks
                      if not c.passed and c.name not in NOT_ORACLES]
            assert not failed, (index, failed, reason)
            assert verdict == "pass" or (verdict == "discarded" and "not reached" in reason), (
                index, verdict, reason)
        else:  # without its one fault: the broken trainer's bug stays hidden
            assert result.passed, result.failed_checks()
    return list(spec.faults)


@pytest.fixture(autouse=True)
def _cache(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(shared_cache))


@pytest.fixture(autouse=True)
def twins(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every execution of a fault-free twin in the test's process: explore prepares one
    before the search (none when the session's cache has it) and no run reruns it."""
    ran: list[str] = []
    execute = runner.execute

    def counting(spec: Scenario, **kwargs: Any) -> Any:
        if kwargs.get("phase") == "fault-free baseline":
            ran.append(spec.name)
        return execute(spec, **kwargs)

    monkeypatch.setattr(runner, "execute", counting)
    return ran


def test_explore_finds_a_crash_loop_guard_that_throws_a_good_checkpoint_away(
    tmp_path: Path, twins: list[str]
) -> None:
    """After a resume, the broken trainer notes the step until its next commit and takes a
    world that dies before then for a crash loop caused by that checkpoint: it withdraws it.
    One kill never trips it; a second one during the recovery makes the world resume from an
    older checkpoint than one it reported saved before the first kill (checkpoint_durable).
    The shipped kill_during_recovery_restart kills the rejoining rank inside the restore,
    before the resume completes, and passes this trainer."""
    # 50 ms a step: a kill triggered by a step lands within that step, not steps later.
    base = scenario(tmp_path, name="crash-loop", variant="crash_loop_guard", steps=40,
                    sleep="50ms",
                    expect="  completes: true\n  params_match: fault_free\n"
                           "  checkpoint_durable: true",
                    space="  faults: {min: 1, max: 2}\n  kinds: [process.kill]\n"
                          "  targets: [rank]\n"
                          "  at: {step: {min: 21, max: 39}, events: [checkpoint_loaded]}")
    found = search(base, tmp_path, seed=0)
    assert len(twins) <= 1, twins  # the fault-free twin: at most once, before the search
    (finding,) = found.findings
    assert finding.status == "confirmed", finding
    assert finding.failed_checks == ("checkpoint_durable",)
    assert finding.faults == 2
    # The second kill landed during the recovery: after the world resumed, before it
    # committed anything newer.
    confirm = [a for a in found.attempts if a.stage == "confirm"][-1]
    events = read_events(Path(confirm.run_dir) / "events.jsonl")
    kills = [e["t"] for e in events if e["event"] == "fault_injected"]
    assert len(kills) == 2
    resumed = [e["t"] for e in events if e["event"] == "checkpoint_loaded" and e["t"] < kills[1]]
    saved = [e["t"] for e in events if e["event"] == "checkpoint_saved"
             and resumed and resumed[-1] < e["t"] < kills[1]]
    assert resumed, "the second kill landed before any resume"
    assert not saved, "a checkpoint was committed between the resume and the second kill"
    assert_minimal(base, finding.file, tmp_path)
    # The hand-written schedule for this class of bug misses it.
    shipped = _with_variant(ROOT / "scenarios" / "training" / "kill_during_recovery_restart.yaml",
                            "crash_loop_guard", tmp_path)
    proc = cli("run", str(shipped), "--run-dir", str(tmp_path / "shipped"),
               cache=Path(os.environ["AFTERSHOCK_CACHE_DIR"]), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    (shipped_run,) = (tmp_path / "shipped").glob("*/events.jsonl")
    assert read_events(shipped_run, "test_bug")  # the broken trainer ran, and passed


def test_explore_finds_a_start_that_refuses_a_torn_first_save(
    tmp_path: Path, twins: list[str]
) -> None:
    """With nothing committed to resume from, the broken trainer refuses to start from
    scratch over a step folder that holds every rank's shard but no COMMIT. Only a kill
    inside the first save, after the shard writes and before the commit (the trainer's
    `save` fault point), leaves such a folder with nothing committed: every restart then
    refuses and the job fails. The shipped storage_crash_during_save kills at the third
    save, with two checkpoints committed, and passes this trainer."""
    base = scenario(tmp_path, name="torn-start", variant="refuse_torn_start", steps=30,
                    expect="  completes: true\n  params_match: fault_free",
                    space="  faults: {min: 1, max: 2}\n  kinds: [process.kill]\n"
                          "  targets: [rank]\n"
                          "  at: {step: {min: 1, max: 20}, phases: [save]}")
    found = search(base, tmp_path, seed=0)
    assert len(twins) <= 1, twins
    (finding,) = found.findings
    assert finding.status == "confirmed", finding
    assert "completes" in finding.failed_checks
    faults = assert_minimal(base, finding.file, tmp_path)
    (kill,) = faults
    assert kill.at.phase == "save"
    assert kill.at.step is not None
    assert kill.at.step <= 10  # the first save: nothing committed before it
    assert kill.target.rank == 0  # the rank that writes the COMMIT
    shipped = _with_variant(ROOT / "scenarios" / "faults" / "storage_crash_during_save.yaml",
                            "refuse_torn_start", tmp_path)
    proc = cli("run", str(shipped), "--run-dir", str(tmp_path / "shipped"),
               cache=Path(os.environ["AFTERSHOCK_CACHE_DIR"]), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    (shipped_run,) = (tmp_path / "shipped").glob("*/events.jsonl")
    assert read_events(shipped_run, "test_bug")  # the broken trainer ran, and passed


def _with_variant(shipped: Path, variant: str, tmp_path: Path) -> Path:
    """A copy of a shipped scenario whose trainer is the broken variant."""
    python_path = os.pathsep.join(str(p) for p in (BROKEN, ROOT))
    text = shipped.read_text().replace(
        "  recovery: restart\n",
        f"  recovery: restart\n  env: {{PYTHONPATH: \"{python_path}\", "
        f"{VARIANT_ENV}: {variant}}}\n", 1)
    assert text != shipped.read_text()
    copy = tmp_path / shipped.name
    copy.write_text(text)
    return copy
