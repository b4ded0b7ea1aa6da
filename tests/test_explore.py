"""The explore engine on a stand-in runner: search, shrink, minimize, confirm, write, replay.

No process runs here: ``runner.run_scenario`` is replaced by a rule over the schedule it is
given (which faults, where, when), so each test knows which schedules fail and can check
what the engine makes of them in milliseconds. The same engine against real processes is in
test_explore_cli.py, and against deliberately broken reference trainers in
test_explore_broken.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness.errors import HarnessError, PreflightError
from aftershock.harness.run import runner
from aftershock.harness.run.records import CheckResult, FaultRecord, RunResult
from aftershock.harness.scenario.load import load_scenario, parse_scenario, to_yaml
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search import explore as engine
from aftershock.harness.search.explore import Exploration, describe, explore

pytestmark = pytest.mark.timeout(120)

BASE = """\
name: stand-in
system:
  command: [python, job.py]
  world: 2
expect:
  completes: true
explore:
  faults: {min: 1, max: 2}
  kinds: [process.kill, {kind: process.freeze, params: {duration: {min: 100ms, max: 2s}}}]
  targets: [rank, random]
  at:
    step: {min: 1, max: 30}
    events: [failure_detected, recovery_done]
"""

Rule = Callable[[Sequence[Any]], str]  # the faults -> "pass", "fail" or "unlanded"


def second_fault_during_recovery(faults: Sequence[Any]) -> str:
    """Fails when a kill at some step is followed by a fault on the failure it causes."""
    kill = any(f.kind == "process.kill" and f.at.step is not None for f in faults)
    on_failure = any(f.at.event == "failure_detected" for f in faults)
    return "fail" if kill and on_failure else "pass"


class StandIn:
    """``runner.run_scenario`` judged by a rule; keeps every scenario it was given."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.ran: list[str] = []
        self.cache_flags: list[bool] = []

    def __call__(self, loaded: LoadedScenario, *, run_dir: Path | None = None,
                 seed: int | None = None, observer: Any = None,
                 use_cache: bool = True) -> RunResult:
        spec = loaded.spec
        assert loaded.text == to_yaml(spec)  # what runs is what would be written
        self.ran.append(describe(spec.faults))
        self.cache_flags.append(use_cache)
        verdict = self.rule(spec.faults)
        landed = None if verdict == "unlanded" else 1.0
        checks = (
            CheckResult("completes", verdict != "fail", "exit 1" if verdict == "fail" else
                        "exit 0", "exit 0", "exited 1" if verdict == "fail" else "exited 0"),
            CheckResult("faults_injected", landed is not None, "", "", ""),
        )
        faults = tuple(FaultRecord(str(f.kind), f.target.describe(), landed, None)
                       for f in spec.faults)
        return RunResult(name=spec.name, file=str(loaded.path), passed=verdict == "pass",
                         seed=seed or 0, duration_s=0.0, checks=checks, metrics={},
                         faults=faults, run_dir=str(run_dir))


@pytest.fixture
def base(tmp_path: Path) -> LoadedScenario:
    path = tmp_path / "stand-in.yaml"
    path.write_text(BASE)
    return load_scenario(path)


def stand_in(monkeypatch: pytest.MonkeyPatch, rule: Rule) -> StandIn:
    fake = StandIn(rule)
    monkeypatch.setattr(runner, "run_scenario", fake)
    return fake


def run(base: LoadedScenario, tmp_path: Path, **options: Any) -> Exploration:
    options.setdefault("runs", 40)
    options.setdefault("seed", 0)
    options.setdefault("database", None)
    return explore(base, out=tmp_path / "out", **options)


def test_finds_shrinks_confirms_and_writes_a_failing_schedule(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = stand_in(monkeypatch, second_fault_during_recovery)
    found = run(base, tmp_path)
    assert found.stopped == "found"
    (finding,) = found.findings
    assert finding.status == "confirmed"
    assert found.failed
    # Shrunk all the way: the first kind, rank 0, the first step, the first event.
    assert finding.schedule == ("process.kill rank 0 @ step 1; process.kill rank 0 @ "
                                "event failure_detected")
    assert finding.failures == 2  # the run that found it, and the re-run
    assert finding.passes == 0
    assert finding.failed_checks == ("completes",)
    # Re-run at once when it failed (that re-run is the confirmation `confirm=1` asks for).
    runs_of_it = [a for a in found.attempts if a.schedule == finding.schedule]
    assert [a.stage for a in runs_of_it][1:] == ["confirm"]
    assert runs_of_it[1].index == runs_of_it[0].index + 1
    assert found.count("search") <= 40
    # Every run is one the engine asked for, each schedule once (the re-runs aside), and
    # only a failure is re-run.
    assert len(fake.ran) == found.runs
    assert len(set(fake.ran)) == found.runs - found.count("confirm")
    assert found.count("confirm") == found.count(verdict="fail") // 2
    # Written as a standalone scenario: the base with the schedule, no search space.
    written = load_scenario(finding.file)
    assert Path(finding.file).name == "stand-in-found.yaml"
    assert written.spec.name == "stand-in-found"
    assert written.spec.explore is None
    assert describe(written.spec.faults) == finding.schedule
    assert written.spec.system == base.spec.system
    assert written.spec.expect == base.spec.expect
    assert "--seed 0" in written.spec.description


def test_every_fault_of_a_finding_is_needed(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hypothesis got no shrinking budget here; the engine still tries each fault away, so
    removing any fault of what it reports makes the schedule pass."""
    text = base.text.replace("faults: {min: 1, max: 2}", "faults: {min: 3, max: 3}")
    base.path.write_text(text)
    fake = stand_in(monkeypatch, second_fault_during_recovery)
    found = run(load_scenario(base.path), tmp_path, shrink_runs=0)
    (finding,) = found.findings
    assert finding.faults == 2
    assert found.count("minimize") >= 1
    spec = load_scenario(finding.file).spec
    for index in range(len(spec.faults)):
        fewer = [f for i, f in enumerate(spec.faults) if i != index]
        assert second_fault_during_recovery(fewer) == "pass"
    assert fake.rule(spec.faults) == "fail"


def test_a_schedule_that_passes_its_re_run_is_flaky_not_a_bug(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}

    def first_time_only(faults: Sequence[Any]) -> str:
        key = describe(faults)
        seen[key] = seen.get(key, 0) + 1
        return second_fault_during_recovery(faults) if seen[key] == 1 else "pass"

    stand_in(monkeypatch, first_time_only)
    found = run(base, tmp_path, confirm=3)
    (finding,) = found.findings
    assert finding.status == "flaky"
    assert not found.failed  # exit 0: not a verdict
    assert (finding.failures, finding.passes) == (1, 1)  # stopped at the first pass
    assert Path(finding.file).name == "stand-in-flaky.yaml"


def test_the_budget_runs_out_without_a_failure(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = stand_in(monkeypatch, lambda faults: "pass")
    found = run(base, tmp_path, runs=12)
    assert found.stopped == "budget"
    assert found.findings == []
    assert found.runs == 12 == len(fake.ran)
    assert found.runs_per_minute is not None


def test_a_time_limit_stops_the_search(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = stand_in(monkeypatch, lambda faults: "pass")
    found = run(base, tmp_path, time_limit_s=0)
    assert found.stopped == "time"
    assert fake.ran == []


def test_the_same_seed_gives_the_same_schedules(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedules = []
    for seed in (3, 3, 4):
        fake = stand_in(monkeypatch, lambda faults: "pass")
        run(base, tmp_path, runs=15, seed=seed)
        schedules.append(fake.ran)
    assert schedules[0] == schedules[1]
    assert schedules[0] != schedules[2]


def test_a_failure_found_once_is_replayed_first(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = tmp_path / "db"
    stand_in(monkeypatch, second_fault_during_recovery)
    first = run(base, tmp_path, database=database)
    (finding,) = first.findings
    assert first.count("search") > 1
    # Another seed would search elsewhere; the database puts the failure first.
    fake = stand_in(monkeypatch, second_fault_during_recovery)
    again = run(base, tmp_path, database=database, seed=99)
    assert fake.ran[0] == finding.schedule
    assert again.count("search") == 1
    assert again.findings[0].schedule == finding.schedule


def test_runs_whose_faults_never_landed_are_discarded(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trigger that never came (an event that did not happen) says nothing about the
    system: such a run is neither a pass nor a failure, and never reported."""

    def events_never_come(faults: Sequence[Any]) -> str:
        return "unlanded" if any(f.at.event for f in faults) else "pass"

    stand_in(monkeypatch, events_never_come)
    found = run(base, tmp_path, runs=20)
    assert found.findings == []
    assert found.count(verdict="discarded") > 0
    assert all(a.failed == () for a in found.attempts)


def test_a_search_where_nothing_ran_as_drawn_is_a_harness_error(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(monkeypatch, lambda faults: "unlanded")
    with pytest.raises(HarnessError, match="no schedule ran as drawn: all 5 runs"):
        run(base, tmp_path, runs=5)


def test_an_interrupt_writes_what_was_found_so_far(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = []

    def interrupted_while_shrinking(faults: Sequence[Any]) -> str:
        verdict = second_fault_during_recovery(faults)
        if failures:
            raise runner.Interrupted()
        if verdict == "fail":
            failures.append(faults)
        return verdict

    stand_in(monkeypatch, interrupted_while_shrinking)
    sink: list[Exploration] = []
    with pytest.raises(KeyboardInterrupt):
        run(base, tmp_path, sink=sink)
    (found,) = sink
    assert found.stopped == "interrupted"
    (finding,) = found.findings
    assert finding.status == "unconfirmed"
    assert Path(finding.file).name == "stand-in-unconfirmed.yaml"
    assert describe(load_scenario(finding.file).spec.faults) == describe(failures[0])


def test_an_interrupt_while_a_failure_is_shown_still_writes_it(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI prints a failing run's line and a user (or CI) sends SIGTERM on reading it:
    # the signal may land before the line's call returns. The failure was seen, so it is
    # written (CI once caught a search that had printed FAIL and wrote nothing).
    class InterruptOnFirstFailure(engine.NullExploreObserver):
        def finished_run(self, attempt: engine.Attempt) -> None:
            if attempt.verdict == "fail":
                raise runner.Interrupted()

    stand_in(monkeypatch, second_fault_during_recovery)
    sink: list[Exploration] = []
    with pytest.raises(KeyboardInterrupt):
        run(base, tmp_path, sink=sink, observer=InterruptOnFirstFailure())
    (found,) = sink
    (finding,) = found.findings
    assert finding.status == "unconfirmed"
    assert Path(finding.file).is_file()


def test_an_interrupt_inside_hypothesis_before_its_first_run_is_still_an_interrupt(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM that lands while hypothesis builds its engine (CI saw it under load): the
    # engine's own `except BaseException` then fails an assertion on the runner it never
    # made, so an AssertionError came out, and the CLI said "harness error" with exit 3
    # where an interrupted search exits 143.
    import hypothesis.core

    def signal_lands_here(*args: Any, **kwargs: Any) -> None:
        raise runner.Interrupted()

    stand_in(monkeypatch, second_fault_during_recovery)
    monkeypatch.setattr(hypothesis.core, "ConjectureRunner", signal_lands_here)
    sink: list[Exploration] = []
    with pytest.raises(runner.Interrupted):
        run(base, tmp_path, sink=sink)
    (found,) = sink
    assert found.stopped == "interrupted"
    assert found.findings == []


def test_a_harness_error_inside_hypothesis_is_not_taken_for_an_interrupt(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hypothesis.core

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    stand_in(monkeypatch, second_fault_during_recovery)
    monkeypatch.setattr(hypothesis.core, "ConjectureRunner", broken)
    # Whatever hypothesis makes of it (today its own AssertionError, the bug as context),
    # it is not an interrupt, and the bug is in it.
    with pytest.raises(Exception) as raised:  # noqa: PT011
        run(base, tmp_path)
    assert not isinstance(raised.value, KeyboardInterrupt)
    chain = [raised.value, raised.value.__cause__, raised.value.__context__]
    assert any(isinstance(e, RuntimeError) and str(e) == "a bug" for e in chain), chain


def test_the_fault_free_twin_is_prepared_once_and_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_text("""\
name: twin
system: {reference: trainer, world: {replicas: 2, shards: 1}, steps: 20}
expect: {params_match: fault_free}
explore: {kinds: [process.kill], targets: [rank], at: {step: {min: 1, max: 20}}}
""")
    prepared = []

    def fault_free_result(loaded: LoadedScenario, **kwargs: Any) -> tuple[Any, str]:
        prepared.append(kwargs["use_cache"])
        return {"0": "d", "1": "d"}, "ran"

    monkeypatch.setattr(runner, "fault_free_result", fault_free_result)
    fake = stand_in(monkeypatch, lambda faults: "pass")
    found = explore(load_scenario(path), runs=8, seed=1, database=None, out=tmp_path / "o",
                    use_cache=False)
    assert prepared == [False]  # run once, fresh, as --no-cache asks ...
    assert fake.cache_flags == [True] * 8  # ... and then read by every run
    assert found.twin == "ran"


def test_kinds_this_machine_cannot_cause_are_left_out(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aftershock.faults.registry

    monkeypatch.setattr(aftershock.faults.registry, "preflight", lambda kind, params:
                        ["no freezer here"] if kind == "process.freeze" else [])
    fake = stand_in(monkeypatch, lambda faults: "pass")
    notes: list[str] = []

    class Notes(engine.NullExploreObserver):
        def note(self, text: str) -> None:
            notes.append(text)

    run(base, tmp_path, runs=10, observer=Notes())
    assert notes == ["left out process.freeze: this machine cannot cause it (no freezer here)"]
    assert not any("freeze" in s for s in fake.ran)
    monkeypatch.setattr(aftershock.faults.registry, "preflight", lambda kind, params: ["nothing"])
    with pytest.raises(PreflightError, match="cannot cause any fault kind"):
        run(base, tmp_path, runs=10)


def test_run_schedule_runs_exactly_the_yaml_it_would_write(
    base: LoadedScenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = stand_in(monkeypatch, lambda faults: "pass")
    schedule = parse_scenario(base.text.replace(
        "expect:", "faults:\n  - {kind: process.kill, target: {rank: 1}, at: {step: 3}}\n"
        "expect:")).faults
    result = engine.run_schedule(base, schedule)
    assert result.passed
    assert fake.ran == ["process.kill rank 1 @ step 3"]


def test_the_live_view_and_plain_lines_show_runs_failures_and_findings(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    from aftershock.harness.reporting.report import ExploreLiveObserver, ExplorePlainObserver

    stand_in(monkeypatch, second_fault_during_recovery)
    plain = io.StringIO()
    run(base, tmp_path, observer=ExplorePlainObserver(Console(file=plain, width=200)))
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("[stand-in] exploring ")
    assert any(" search   FAIL " in line for line in lines)
    assert any(" confirm  FAIL " in line for line in lines)
    assert "FAILING SCHEDULE: process.kill rank 0 @ step 1" in plain.getvalue()
    assert "runs/min" in plain.getvalue()

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=80)
    view = ExploreLiveObserver(console)
    with view:
        found = run(base, tmp_path / "live", observer=view)
        panel = io.StringIO()
        Console(file=panel, width=80).print(view._render())
    text = panel.getvalue()
    assert f"runs {found.count('search')}/40 searched" in text
    assert "failures " in text
    assert "shrink runs " in text
    assert "explore stand-in · seed 0" in text
    assert "FAILING SCHEDULE" in screen.getvalue()


def test_a_flaky_shrink_falls_back_to_the_simplest_failure_that_reproduces(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shrinking can end on a schedule that failed once by chance: a kill at a step alone,
    which hit the moment that matters only sometimes (CI: explore shrank `at: {step: 10,
    phase: save}` to `at: {step: 10}`, which failed 1 run of 2). A user needs a scenario
    that fails when run: the engine re-runs the simpler failures seen before it and reports
    the simplest that fails every re-run, naming the flaky one it came from. (Here the lone
    kill fails twice, so the re-run made when it first failed does not catch it; the third
    run, which `confirm=2` asks for, does.)"""
    seen: dict[str, int] = {}
    bug_seen = False

    def rule(faults: Sequence[Any]) -> str:
        nonlocal bug_seen
        verdict = second_fault_during_recovery(faults)
        if verdict == "fail":
            bug_seen = True
            return verdict
        key = describe(faults)
        seen[key] = seen.get(key, 0) + 1
        lone_kill = len(faults) == 1 and faults[0].kind == "process.kill"
        return "fail" if lone_kill and bug_seen and seen[key] <= 2 else "pass"

    stand_in(monkeypatch, rule)
    found = run(base, tmp_path, confirm=2)
    (finding,) = found.findings
    assert finding.status == "confirmed", finding
    assert finding.faults == 2, finding.schedule
    assert (finding.failures, finding.passes) == (3, 0)
    assert found.failed
    # The description names the simpler schedule that did not hold.
    description = load_scenario(Path(finding.file)).spec.description
    assert "failed only 2 of 3 run(s) (flaky)" in description, description
    loaded = load_scenario(Path(finding.file))
    assert second_fault_during_recovery(loaded.spec.faults) == "fail"


def test_shrinking_does_not_follow_a_failure_that_does_not_happen_again(
    base: LoadedScenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule that fails once by chance while shrinking (CI: a kill at a step alone that
    hit a save's window once) must not become the shrinker's new starting point: the engine
    re-runs each failure found while shrinking, and tells hypothesis it passed when the
    re-run passed. So the bug is still shrunk all the way, and the chance failure is
    recorded as flaky (one failure, one pass), not reported."""
    seen: dict[str, int] = {}

    def rule(faults: Sequence[Any]) -> str:
        verdict = second_fault_during_recovery(faults)
        if verdict == "fail":
            return verdict
        key = describe(faults)
        seen[key] = seen.get(key, 0) + 1
        # Every schedule with a kill fails its first run by chance, and never again.
        chance = any(f.kind == "process.kill" for f in faults) and seen[key] == 1
        return "fail" if chance else "pass"

    stand_in(monkeypatch, rule)
    found = run(base, tmp_path, confirm=1)
    (finding,) = found.findings
    assert finding.status == "confirmed", finding
    assert finding.schedule == ("process.kill rank 0 @ step 1; process.kill rank 0 @ "
                                "event failure_detected"), finding.schedule
    assert "flaky" not in Path(finding.file).read_text()
    # Each failure met while shrinking was run again before hypothesis was told.
    shrunk = [a for a in found.attempts if a.stage == "shrink" and a.verdict == "fail"]
    for attempt in shrunk:
        (again,) = [a for a in found.attempts
                    if a.schedule == attempt.schedule and a.index == attempt.index + 1]
        assert again.stage == "confirm", attempt
    assert any(a.verdict == "pass" and a.stage == "confirm" for a in found.attempts)


def test_system_options_are_drawn_shrunk_and_written_with_the_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`explore.system` draws a system option with every schedule: each run is told the
    value (what runs is the scenario written for it), the line names it, and a failure that
    needs a large value shrinks to the smallest declared one that has it, written into the
    found scenario."""
    path = tmp_path / "options.yaml"
    path.write_text(BASE + "  system:\n    timeout: [30s, 60s, 90s]\n")
    ran: list[tuple[float, str]] = []
    rule = StandIn(lambda faults: "pass")

    def judged(loaded: LoadedScenario, **kwargs: Any) -> RunResult:
        timeout = loaded.spec.system.timeout.total_seconds()
        ran.append((timeout, describe(loaded.spec.faults)))
        rule.rule = lambda faults: "fail" if timeout >= 60 else "pass"
        return rule(loaded, **kwargs)

    monkeypatch.setattr(runner, "run_scenario", judged)
    found = run(load_scenario(path), tmp_path)
    assert {t for t, _ in ran} == {30.0, 60.0, 90.0}  # every value came up
    (finding,) = found.findings
    assert finding.status == "confirmed"
    written = load_scenario(finding.file).spec
    assert written.system.timeout.total_seconds() == 60  # the first value that fails
    assert written.explore is None
    assert finding.schedule == f"[timeout=60s] {describe(written.faults)}"
    assert all(a.schedule.startswith("[timeout=") for a in found.attempts)
