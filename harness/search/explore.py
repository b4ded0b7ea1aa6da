"""``aftershock explore``: search a scenario's space of fault schedules for one that breaks it.

Hypothesis draws schedules (aftershock.strategies), each is run as an ordinary scenario
through
``runner.run_scenario`` with the scenario's ``expect`` as the oracle, and a failing one is
shrunk by hypothesis toward fewer faults, earlier and simpler triggers and simpler targets.
What hypothesis leaves is then made 1-minimal (every fault is tried away once more), re-run
to tell a bug from a flaky schedule, and written as a standalone scenario that `aftershock
run` fails on.

A failure counts only once it happens again: every schedule that fails is run a second time
at once (a `confirm` attempt), and hypothesis is told it failed only when both runs failed.
A kill at a step alone can hit the moment that matters once by chance (a save's window); told
"fail", hypothesis would shrink from it and never come back to the bug. When no schedule fails
twice, the smallest that failed once is reported as flaky.

Searchers that run at once (``--executor slurm --workers N``) form a Team sharing one example
database: the first to confirm a failure shrinks it; the others stop searching and replay it
from the database, read only, as `replay` runs (harness/search/team.py).

The engine stays out of the run loop: it builds Scenario objects (the type users write) and
calls the runner. The fault-free twin is computed once, before the search, and every run
reads it from the cache (runner.baseline_key: same system, same seed, one twin).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from aftershock.harness.errors import HarnessError, PreflightError, RunFailed, SpecError
from aftershock.harness.run import _files, runner
from aftershock.harness.run.records import CheckResult, RunResult
from aftershock.harness.scenario._space import Space, option_value, sample_fault, with_options
from aftershock.harness.scenario.load import parse_scenario, to_yaml
from aftershock.harness.scenario.spec import LoadedScenario, Scenario, _FaultBase
from aftershock.harness.twin import golden

if TYPE_CHECKING:
    from hypothesis.database import ExampleDatabase

#: Checks that judge how a run went, not the system: `faults_injected` fails when a drawn
#: trigger never came (an event that did not happen) or a fault could not be applied here,
#: and `fault_free_golden` judges the twin, which is checked once before the search.
NOT_ORACLES = ("faults_injected", "fault_free_golden")

Stage = Literal["search", "shrink", "minimize", "confirm", "replay"]
STAGES: tuple[Stage, ...] = ("search", "shrink", "minimize", "confirm", "replay")
Verdict = Literal["pass", "fail", "discarded"]
Status = Literal["confirmed", "flaky", "unconfirmed"]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One run of one schedule."""

    index: int  # 1-based, over the whole exploration
    stage: Stage
    schedule: str  # harness.search.explore.describe() of the faults
    verdict: Verdict
    failed: tuple[str, ...]  # names of the oracle checks that failed
    reason: str  # why it failed or was discarded, in a line
    duration_s: float
    run_dir: str
    searcher: int = 0  # which of a team's searchers ran it (0 alone)


@dataclass(frozen=True, slots=True)
class Finding:
    """A schedule that failed, shrunk and re-run."""

    status: Status  # confirmed: failed every re-run; flaky: passed one; unconfirmed: not re-run
    file: str  # the scenario written for it
    schedule: str
    faults: int
    failed_checks: tuple[str, ...]
    message: str  # the failed checks, observed against expected
    failures: int  # runs of exactly this schedule that failed (the first included)
    passes: int  # and that passed
    found_at_run: int


@dataclass
class Exploration:
    """What one exploration did (``--json`` writes a list of these)."""

    name: str
    file: str
    seed: int
    budget_runs: int
    max_faults: int
    attempts: list[Attempt] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    stopped: str = ""  # budget | time | found | interrupted
    twin: str = ""
    searchers: list[Searcher] = field(default_factory=list)  # a team's, one each; else none
    workers: int = 1  # searchers at once (harness/search/team.py)
    started: float = field(default_factory=time.monotonic)
    elapsed_s: float = 0.0
    search_s: float = 0.0  # the runs only: what `runs_per_minute` divides by

    @property
    def runs(self) -> int:
        return len(self.attempts)

    def count(self, stage: Stage | None = None, verdict: Verdict | None = None) -> int:
        return sum(1 for a in self.attempts
                   if (stage is None or a.stage == stage) and (verdict is None or
                                                                a.verdict == verdict))

    @property
    def runs_per_minute(self) -> float | None:
        return round(60 * self.runs / self.search_s, 2) if self.search_s > 0 else None

    @property
    def failed(self) -> bool:
        return any(f.status == "confirmed" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "file": self.file, "seed": self.seed,
            "budget_runs": self.budget_runs, "max_faults": self.max_faults,
            "runs": self.runs,
            "runs_by_stage": {s: self.count(s) for s in STAGES},
            "discarded": self.count(verdict="discarded"),
            "runs_per_minute": self.runs_per_minute,
            "elapsed_s": round(self.elapsed_s, 3), "stopped": self.stopped, "twin": self.twin,
            "findings": [asdict(f) for f in self.findings],
            "attempts": [asdict(a) for a in self.attempts],
            **({"searchers": [asdict(s) for s in self.searchers]} if self.searchers else {}),
        }


@dataclass(frozen=True, slots=True)
class Searcher:
    """One searcher of a team that shares one example database (``--workers``)."""

    index: int
    seed: int  # its hypothesis seed: `aftershock explore --seed` repeats its search alone
    runs: int
    stopped: str  # as Exploration.stopped, or "replayed": another searcher found a failure
    shrank: bool  # it found the failure that was shrunk (one searcher of the team at most)
    replays_failed: int  # replays of another searcher's failure from the database that failed
    replays_passed: int
    saved: tuple[str, ...] = ()  # the database values it saved (their file names there)
    read: tuple[str, ...] = ()  # and those it read that another searcher had saved
    error: str = ""  # why it ended without a result, if it did


class Team(Protocol):
    """Searchers of one space that run at once and share one example database
    (harness/search/team.py): the first to confirm a failure shrinks it; the others
    stop searching and replay it from the database."""

    def share(self, database: ExampleDatabase) -> ExampleDatabase:
        """The database as this searcher uses it (a team may note what goes through it)."""
        ...

    def claim(self) -> bool:
        """This searcher confirmed a failure: whether it is the first of the team to, and so
        the one that shrinks it."""
        ...

    def claimed_elsewhere(self) -> bool:
        """Whether another searcher of the team has claimed a failure."""
        ...


class ExploreObserver(Protocol):
    """What a live view is told while an exploration runs."""

    def started(self, exploration: Exploration, *, time_limit_s: float | None,
                shrink_runs: int) -> None: ...

    def running(self, index: int, stage: Stage, schedule: str) -> runner.Observer: ...

    def finished_run(self, attempt: Attempt) -> None: ...

    def note(self, text: str) -> None: ...

    def done(self, exploration: Exploration) -> None: ...


class NullExploreObserver:
    def started(self, exploration: Exploration, *, time_limit_s: float | None,
                shrink_runs: int) -> None:
        pass

    def running(self, index: int, stage: Stage, schedule: str) -> runner.Observer:
        return runner.NullObserver()

    def finished_run(self, attempt: Attempt) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def done(self, exploration: Exploration) -> None:
        pass


# ------------------------------------------------------------------------------- helpers


def sigterm_unwinds() -> contextlib.AbstractContextManager[None]:
    """SIGTERM unwinds like Ctrl-C for a whole exploration, between runs too (the runner
    does it only while a run goes on), so that what was found so far is written."""
    return runner._sigterm_unwinds()


def describe(schedule: Sequence[_FaultBase], system: Mapping[str, Any] | None = None) -> str:
    """A schedule in one line: ``process.kill rank 1 @ step 25; ...``, after the system
    options drawn for it, if any: ``[snapshot_every=2] process.kill ...``."""
    drawn = ", ".join(f"{k}={_short(v)}" for k, v in (system or {}).items())
    parts = []
    for fault in schedule:
        data = fault.model_dump(exclude={"kind", "target", "at", "every"},
                                exclude_defaults=True)
        params = ", ".join(f"{k}={_short(v)}" for k, v in data.items())
        kind = str(getattr(fault, "kind", "?"))
        where = fault.target.describe() if not kind.startswith("storage.") else ""
        text = f"{kind}{f'({params})' if params else ''}"
        parts.append(" ".join(p for p in (text, where, "@", fault.at.describe()) if p))
    return (f"[{drawn}] " if drawn else "") + ("; ".join(parts) or "no faults")


def _short(value: Any) -> str:
    if hasattr(value, "total_seconds"):
        return f"{value.total_seconds():g}s"
    return str(value)


def judge(result: RunResult) -> tuple[Verdict, tuple[str, ...], str]:
    """A run's verdict for the search: fail (an oracle check failed), pass, or discarded (no
    fault landed, or one never did and nothing failed: the schedule did not run as drawn;
    or the machine could not cause a fault)."""
    if result.error is not None:
        return "discarded", (), result.error
    failed = tuple(c.name for c in result.checks
                   if not c.passed and c.name not in NOT_ORACLES)
    landed = [f for f in result.faults if f.injected_at_s is not None]
    if not landed:
        return "discarded", (), _not_landed(result) or "no fault landed"
    if failed:
        return "fail", failed, "; ".join(_check_line(c) for c in result.checks
                                         if c.name in failed)
    if len(landed) < len(result.faults):
        return "discarded", (), _not_landed(result)
    return "pass", (), ""


def _not_landed(result: RunResult) -> str:
    return "; ".join(f"{f.kind} {f.target}: {f.detail}" for f in result.faults
                     if f.injected_at_s is None)


def _check_line(check: CheckResult) -> str:
    return f"{check.name}: {check.message} (observed {check.observed}, expected " \
           f"{check.expected})"


def run_schedule(
    base: LoadedScenario, schedule: Sequence[_FaultBase], *, run_dir: Path | None = None,
    seed: int | None = None, observer: runner.Observer | None = None, use_cache: bool = True,
    system: Mapping[str, Any] | None = None,
) -> RunResult:
    """Run ``base`` with ``schedule`` as its faults (and the options in ``system`` over its
    system), as `aftershock run` would run the scenario written for it (for your own
    ``@given`` tests around aftershock.strategies)."""
    spec = base.spec.model_copy(update={"faults": list(schedule), "explore": None})
    if system:
        spec = spec.model_copy(update={"system": with_options(spec.system, dict(system))})
    text = to_yaml(spec)
    # What runs is exactly what the YAML says: the written scenario and this run agree.
    loaded = LoadedScenario(parse_scenario(text, str(base.path)), base.path, text)
    return runner.run_scenario(loaded, run_dir=run_dir, seed=seed, observer=observer,
                               use_cache=use_cache)


def needs_twin(spec: Scenario) -> str | None:
    """What the scenario's oracle needs from a fault-free twin: digests, outputs, or None."""
    if spec.expect.params_match == "fault_free":
        return "digests"
    if spec.expect.outputs_match == "fault_free":
        return "outputs"
    return None


def _slug(name: str, suffix: str) -> str:
    return f"{name[: 99 - len(suffix)]}-{suffix}"


# -------------------------------------------------------------------------------- engine


class _SearchSpent(BaseException):
    """The search's budget (runs or time) is spent with nothing found: ends hypothesis's
    run at once (a BaseException is not a failing test to hypothesis)."""


class _FoundElsewhere(BaseException):
    """Another searcher of the team claimed a failure: this one stops searching (and does
    not shrink one of its own) to replay that failure from the shared database."""


class _Failing(Exception):
    """Raised inside the hypothesis test for a failing schedule: its key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


@dataclass
class _Tried:
    spec: Scenario
    verdict: Verdict
    failed: tuple[str, ...]
    reason: str
    index: int
    failures: int = 0
    passes: int = 0
    runs: int = 0  # discarded ones included

    @property
    def reliable(self) -> bool:
        """Failed every run, and was run more than once."""
        return self.runs >= 2 and self.failures == self.runs

    @property
    def outcome(self) -> Verdict:
        """What hypothesis is told: a failure only when it happened again."""
        if self.reliable:
            return "fail"
        return "pass" if self.failures or self.verdict == "fail" else self.verdict


class _Search:
    """The state the hypothesis test function works on: budgets, what ran, the best
    failure so far."""

    def __init__(self, base: LoadedScenario, exploration: Exploration, *, runs: int,
                 shrink_runs: int, deadline: float | None, out: Path, seed: int,
                 observer: ExploreObserver, team: Team | None = None) -> None:
        self.base = base
        self.team = team
        self.exploration = exploration
        self.runs, self.shrink_runs, self.deadline = runs, shrink_runs, deadline
        self.out, self.seed, self.observer = out, seed, observer
        self.tried: dict[str, _Tried] = {}
        self.best: str | None = None  # key of the smallest failing schedule run so far
        self.stage: Stage = "search"
        self.options: tuple[str, ...] = ()  # the system options the space draws

    def describe(self, spec: Scenario) -> str:
        """The schedule of ``spec``, after the values of the options drawn for it."""
        return describe(spec.faults, self.drawn(spec))

    def key(self, spec: Scenario) -> str:
        return to_yaml(spec)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def budget_left(self) -> bool:
        if self.out_of_time():
            return False
        done = self.exploration.count(self.stage)
        limit = {"search": self.runs, "replay": REPLAY_RUNS}.get(self.stage, self.shrink_runs)
        return done < limit

    def verdict_of(self, schedule: Sequence[_FaultBase],
                   system: Mapping[str, Any] | None = None) -> Verdict | None:
        """The schedule's verdict, from an earlier run or a new one. Past the search's
        budget the search ends (_SearchSpent); past the shrinking's, None: the schedule is
        not run and passes for hypothesis, so the best failure stays one really seen."""
        runner.raise_if_terminating()  # a SIGTERM swallowed inside hypothesis's own code
        if self.stage == "search" and self.team is not None and self.team.claimed_elsewhere():
            raise _FoundElsewhere()
        if self.stage == "search" and not self.budget_left():
            raise _SearchSpent()
        spec = self.base.spec.model_copy(update={"faults": list(schedule), "explore": None})
        if system:
            spec = spec.model_copy(update={"system": with_options(spec.system, dict(system))})
        key = self.key(spec)
        if key in self.tried:
            return self.tried[key].outcome
        if not self.budget_left():
            return None
        return self.run_twice_if_failing(spec, key, self.stage).outcome

    def run_twice_if_failing(self, spec: Scenario, key: str, stage: Stage) -> _Tried:
        """Run the schedule; when it fails, run it again at once (a `confirm` attempt): the
        best failure is one that failed both times."""
        tried = self.run(spec, key, stage)
        if tried.runs == 1 and tried.failures == 1:
            tried = self.run(spec, key, "confirm")
        if tried.reliable and (self.best is None
                               or _smaller(spec, self.tried[self.best].spec)):
            self.best = key
        return tried

    def drawn(self, spec: Scenario) -> dict[str, Any]:
        """The values of the drawn system options in ``spec``."""
        return {n: option_value(spec.system, n) for n in self.options}

    def run(self, spec: Scenario, key: str, stage: Stage) -> _Tried:
        exploration = self.exploration
        index = exploration.runs + 1
        schedule = self.describe(spec)
        run_dir = self.out / "runs" / exploration.name / f"{index:03d}-{stage}"
        view = self.observer.running(index, stage, schedule)
        began = time.monotonic()
        try:
            result = run_schedule(self.base, spec.faults, run_dir=run_dir, seed=self.seed,
                                  observer=view, system=self.drawn(spec))
        except SpecError as exc:  # a drawn schedule the loader refuses: a bug of ours
            raise HarnessError(f"a generated schedule does not validate ({schedule}): "
                               f"{exc}") from None
        except RunFailed as exc:
            if not isinstance(exc.__cause__, PreflightError):
                raise
            # This machine cannot cause one of its faults with these parameters: the
            # schedule cannot be run here, which says nothing about the system.
            result = exc.result
        took = time.monotonic() - began
        exploration.search_s += took
        verdict, failed, reason = judge(result)
        attempt = Attempt(index, stage, schedule, verdict, failed, reason, round(took, 3),
                          result.run_dir)
        exploration.attempts.append(attempt)
        tried = self.tried.get(key) or _Tried(spec, verdict, failed, reason, index)
        tried.failures += verdict == "fail"
        tried.passes += verdict == "pass"
        tried.runs += 1
        self.tried[key] = tried
        # Shown only once it is recorded: an interrupt that lands while a failure is on the
        # screen (SIGTERM sent on reading it) must still find it to write.
        self.observer.finished_run(attempt)
        return tried


#: Runs a searcher spends replaying another searcher's failure (each failing one is run twice).
REPLAY_RUNS = 4


def _size(spec: Scenario) -> tuple[int, str]:
    return len(spec.faults), to_yaml(spec)


def _smaller(a: Scenario, b: Scenario) -> bool:
    return _size(a) < _size(b)


def explore(
    loaded: LoadedScenario,
    *,
    runs: int = 30,
    time_limit_s: float | None = None,
    seed: int = 0,
    max_faults: int | None = None,
    out: Path = Path(".aftershock") / "explore",
    database: Path | None = Path(".aftershock") / "hypothesis",
    shrink_runs: int = 20,
    confirm: int = 1,
    use_cache: bool = True,
    observer: ExploreObserver | None = None,
    sink: list[Exploration] | None = None,
    team: Team | None = None,
) -> Exploration:
    """Search ``loaded``'s ``explore:`` space for a failing schedule; shrink, re-run and
    write what is found under ``out``.

    ``runs``: schedules to try (search); ``shrink_runs``: runs hypothesis may spend
    shrinking a failure; ``confirm``: re-runs of the shrunk schedule before it is reported
    (one that passes a re-run is reported as flaky). ``seed`` seeds hypothesis (same seed,
    same code: same schedules); the system's own seed stays the scenario's. ``database``:
    hypothesis's example database (a failure found once is tried first next time); None:
    none. ``time_limit_s`` ends the search and the shrinking early. KeyboardInterrupt (and
    runner.Interrupted, SIGTERM) propagate after what was found so far is written; ``sink``
    gets the Exploration as soon as it starts, so a caller has it even then. ``team``: this
    is one of several searchers sharing ``database`` (harness/search/team.py)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    from aftershock.harness.search import strategies

    observer = observer or NullExploreObserver()
    spec = loaded.spec
    space, unavailable = _runnable_space(loaded, max_faults)
    exploration = Exploration(spec.name, str(loaded.path), seed, runs, space.faults[1])
    if sink is not None:
        sink.append(exploration)
    deadline = time.monotonic() + time_limit_s if time_limit_s is not None else None
    observer.started(exploration, time_limit_s=time_limit_s, shrink_runs=shrink_runs)
    for kind, why in unavailable:
        observer.note(f"left out {kind}: this machine cannot cause it ({why})")
    if not space.kinds:
        raise PreflightError(f"{loaded.path}: this machine cannot cause any fault kind of the "
                             "search: " + "; ".join(f"{k}: {w}" for k, w in unavailable))
    exploration.twin = prepare_twin(loaded, out=out, use_cache=use_cache, observer=observer)
    search = _Search(loaded, exploration, runs=runs, shrink_runs=shrink_runs,
                     deadline=deadline, out=out, seed=spec.seed, observer=observer,
                     team=team)
    search.options = tuple(p.name for p in space.options)

    db: ExampleDatabase | None = (
        DirectoryBasedExampleDatabase(str(database / _database_key(loaded)))
        if database is not None else None)
    if db is not None and team is not None:
        db = team.share(db)

    def hypothesis_test(phases: list[Phase], examples: ExampleDatabase | None
                        ) -> Callable[[], None]:
        # One function for the search and for a replay: hypothesis keys its examples by the
        # test function's source, so a replay reads what the team's searches saved.
        @settings(
            # Schedules that come out alike (each is run once) do not count against `runs`,
            # so hypothesis may call more often; the search ends when `runs` schedules ran.
            max_examples=max(1, runs) * 5, database=examples, deadline=None, phases=phases,
            report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet, print_blob=False,
        )
        @hypothesis_seed(seed)
        @given(strategies.trials_in(space))
        def attempt(trial: tuple[dict[str, Any], list[_FaultBase]]) -> None:
            system, schedule = trial
            verdict = search.verdict_of(schedule, system)
            if verdict == "discarded":
                reject()
            if verdict == "fail":
                if search.stage == "search":
                    # Shrunk once: by the first of a team to confirm a failure.
                    if search.team is not None and not search.team.claim():
                        raise _FoundElsewhere()
                    search.stage = "shrink"
                raise _Failing(search.key(strategies.with_schedule(spec, schedule,
                                                                   system=system)))

        return attempt

    _run_search(hypothesis_test([Phase.reuse, Phase.generate, Phase.shrink], db), search,
                exploration)
    if exploration.stopped == "replayed":
        if db is not None:
            # Read only: a replay that passes here must not delete the failure it replays.
            _replay(hypothesis_test([Phase.reuse], ReadOnlyDatabase(db)), search, exploration)
    else:
        _conclude(search, exploration, confirm=confirm)
    observer.done(exploration)
    return exploration


def _run_search(attempt: Callable[[], None], search: _Search, exploration: Exploration
                ) -> None:
    """Run hypothesis's search to its end, noting why it stopped and the failure found."""
    from hypothesis.errors import Flaky, HypothesisException

    try:
        with _quiet_hypothesis():
            _unmasking_interrupts(attempt)
        exploration.stopped = "time" if search.out_of_time() else "budget"
    except _SearchSpent:
        exploration.stopped = "time" if search.out_of_time() else "budget"
    except _FoundElsewhere:
        exploration.stopped = "replayed"
    except _Failing as failing:
        exploration.stopped = "found"
        search.best = failing.key if failing.key in search.tried else search.best
    except Flaky:
        # Every verdict is remembered, so hypothesis sees each schedule fail or pass once;
        # should it still call the test flaky, the smallest failure seen stands.
        exploration.stopped = "found"
    except HypothesisException as exc:
        raise HarnessError(f"hypothesis stopped the search: {exc}") from None
    except KeyboardInterrupt:
        exploration.stopped = "interrupted"
        _report(search, status_if_unconfirmed=True)
        raise
    finally:
        exploration.elapsed_s = time.monotonic() - exploration.started


def _replay(attempt: Callable[[], None], search: _Search, exploration: Exploration) -> None:
    """Replay the failures in the shared database (another searcher's, which that one
    shrinks), without shrinking: each is run as the search runs a schedule, failing ones
    twice, as `replay` attempts."""
    from hypothesis.errors import HypothesisException

    search.stage = "replay"
    try:
        with _quiet_hypothesis():
            _unmasking_interrupts(attempt)
    except _Failing:
        pass  # it failed here too
    except HypothesisException:
        pass  # nothing in the database ran as drawn (Unsatisfiable), or it flaked: as seen
    except KeyboardInterrupt:
        exploration.stopped = "interrupted"
        raise
    finally:
        exploration.elapsed_s = time.monotonic() - exploration.started


def _runnable_space(loaded: LoadedScenario, max_faults: int | None
                    ) -> tuple[Space, list[tuple[str, str]]]:
    """The scenario's search space less the kinds this machine cannot cause, and those
    left out with why."""
    from aftershock.harness.search import strategies

    try:
        space = strategies.space_of(loaded.spec, max_faults=max_faults)
    except ValueError as exc:
        raise SpecError([f"{loaded.path}:1:1: explore: {exc}"]) from None
    return _runnable(space)


def _conclude(search: _Search, exploration: Exploration, *, confirm: int) -> None:
    """After the search: shrink, confirm and write the failure found; report a flaky one;
    refuse a search none of whose schedules ran as drawn."""
    if search.best is not None:
        try:
            _minimize(search)
            _report(search, status_if_unconfirmed=False, confirm=confirm)
        except KeyboardInterrupt:
            exploration.stopped = "interrupted"
            _report(search, status_if_unconfirmed=True)
            raise
        finally:
            exploration.elapsed_s = time.monotonic() - exploration.started
    elif exploration.count(verdict="fail"):
        _report(search, status_if_unconfirmed=False)  # failed once, passed its re-run: flaky
    elif exploration.count(verdict="discarded") == exploration.runs and exploration.runs:
        raise HarnessError(
            f"no schedule ran as drawn: all {exploration.runs} runs were discarded (a fault "
            f"never landed or could not be applied; the last: "
            f"{exploration.attempts[-1].reason}); narrow `explore:` to what this system and "
            "machine can do")


def _unmasking_interrupts(call: Callable[[], None]) -> None:
    """``call()``, but an interrupt that another exception hides is raised as itself.

    A signal can land inside hypothesis's own code, whose cleanup may then fail on the state
    it never finished making (an ``assert`` on a runner not yet built, seen under load): that
    error, not the interrupt, would come out, and an interrupted search would end as a
    harness error. Only an exception whose chain holds the interrupt is replaced.
    """
    try:
        call()
    except Exception as exc:
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:
            if isinstance(cause, KeyboardInterrupt):
                raise cause from None
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        raise


def _runnable(space: Space) -> tuple[Space, list[tuple[str, str]]]:
    """The space without the kinds this machine cannot cause (a missing tool, kernel feature
    or privilege: runner.preflight), and those kinds with why."""
    from aftershock.faults.registry import preflight

    kept, left_out = [], []
    for kind in space.kinds:
        params = {p.name: p.first() for p in kind.params}
        needs = preflight(kind.kind, runner._params(sample_fault(kind.kind, params)))
        if needs:
            left_out.append((kind.kind, "; ".join(needs)))
        else:
            kept.append(kind)
    return dataclasses.replace(space, kinds=tuple(kept)), left_out


@contextlib.contextmanager
def _quiet_hypothesis() -> Iterator[None]:
    """Hypothesis warns when a test run is long or the shrinker gives up on time; the
    exploration reports its own budgets."""
    import warnings

    from hypothesis.errors import HypothesisWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisWarning)
        yield


#: A value hypothesis keeps is a few hundred bytes: anything far larger was not written by it.
_DB_VALUE_LIMIT = 1 << 20


def database_problems(folder: Path) -> list[str]:
    """Why hypothesis's example database under ``folder`` cannot be read safely: it reads
    each value whole, so a value linked to /dev/zero grew until MemoryError, and a FIFO
    would hang it. Every entry must be a folder or a regular file of at most 1 MiB, and no
    link; the problems name each entry, for the user to remove it (or pass --no-db)."""
    problems: list[str] = []
    for root, dirs, files in os.walk(folder):  # follows no linked folder
        for name in [*dirs, *files]:
            path = Path(root) / name
            why = _files.refusal(path)
            if why is None and path.lstat().st_size > _DB_VALUE_LIMIT:
                why = f"{path.lstat().st_size} bytes, more than hypothesis ever writes"
            if why is not None and not (path.is_dir() and not path.is_symlink()):
                problems.append(f"{path}: {why}; the example database is not read: remove "
                                "it, or run with --no-db")
    return problems


def _database_key(loaded: LoadedScenario) -> str:
    """One folder of examples per scenario: hypothesis keys its examples by the test
    function, which is the same for every exploration."""
    where = hashlib.sha256(str(loaded.path.resolve()).encode()).hexdigest()[:8]
    return f"{loaded.spec.name}-{where}"


def prepare_twin(loaded: LoadedScenario, *, out: Path, use_cache: bool,
                  observer: ExploreObserver) -> str:
    """Compute (or find) the fault-free twin once, so that every run reads it from the
    cache, and check it against its golden: a wrong twin would make every verdict wrong."""
    what = needs_twin(loaded.spec)
    if what is None:
        return "not needed"
    observer.note("fault-free twin: " + ("checking the cache" if use_cache else "running"))
    found, note = runner.fault_free_result(
        loaded, seed=loaded.spec.seed, run_dir=out / "runs" / loaded.spec.name / "fault-free",
        observer=runner.NullObserver(), use_cache=use_cache, what=what)
    if found is None:
        raise HarnessError(f"the fault-free twin failed, so no run can be judged: {note}")
    check = golden.check(loaded, seed=loaded.spec.seed, what=what, found=found)
    if check is not None and not check.passed:
        raise HarnessError(f"the fault-free twin does not match its golden, so no run can be "
                           f"judged: {check.message}")
    observer.note(f"fault-free twin: {note}")
    return note


def _minimize(search: _Search) -> None:
    """Try every fault of the best failure away once more (hypothesis may have run out of
    shrinking budget before it tried them all), until removing any fault makes it pass."""
    assert search.best is not None
    improved = True
    while improved:
        improved = False
        best = search.tried[search.best].spec
        if len(best.faults) <= 1:
            return
        for index in range(len(best.faults)):
            fewer = [f for i, f in enumerate(best.faults) if i != index]
            candidate = best.model_copy(update={"faults": fewer})
            key = search.key(candidate)
            tried = (search.tried.get(key)
                     or search.run_twice_if_failing(candidate, key, "minimize"))
            if tried.outcome == "fail":
                search.best = key
                improved = True
                break


#: How many other failures are re-run when the smallest one turns out flaky.
FALLBACKS = 3


def _reproduces(search: _Search, key: str, confirm: int) -> bool:
    """Re-run the schedule ``key`` until ``confirm`` re-runs of it were made (the one made
    when it first failed counts): whether every run failed."""
    tried = search.tried[key]
    while tried.reliable and tried.runs - 1 < confirm:
        search.run(tried.spec, key, "confirm")
    return tried.reliable  # one pass, or a run not as drawn, is enough to doubt it


def _fallbacks(search: _Search, flaky: str) -> list[str]:
    """The other schedules that failed and never passed, smallest first: shrinking may have
    ended on one that failed once by chance (a kill that hit the moment that matters only
    sometimes), while a larger one on its way failed for a reason."""
    failed = [(key, t) for key, t in search.tried.items() if key != flaky and t.reliable]
    failed.sort(key=lambda item: (_size(item[1].spec), -item[1].index))
    return [key for key, _ in failed[:FALLBACKS]]


def _report(search: _Search, *, status_if_unconfirmed: bool, confirm: int = 0) -> None:
    """Re-run the best failure until it has had ``confirm`` re-runs and write it: confirmed
    when every re-run failed too, flaky when one passed; unconfirmed when interrupted before
    its first re-run. When the best one is flaky, the next simplest failures are re-run in
    turn, and the first that fails every re-run is written instead (its description names
    the flaky one). When no schedule failed twice, the smallest that failed once is written
    (flaky, or unconfirmed when interrupted before its re-run)."""
    key = search.best
    flaky: _Tried | None = None
    if key is None:
        once = [(k, t) for k, t in search.tried.items() if t.failures]
        if not once:
            return
        key = min(once, key=lambda item: (_size(item[1].spec), item[1].index))[0]
    elif not status_if_unconfirmed and not _reproduces(search, key, confirm):
        for other in _fallbacks(search, key):
            if _reproduces(search, other, confirm):
                flaky, key = search.tried[key], other
                break
    search.best = key
    tried = search.tried[key]
    status: Status = ("confirmed" if tried.reliable
                      else "unconfirmed" if tried.runs == tried.failures else "flaky")
    exploration = search.exploration
    suffix = {"confirmed": "found", "flaky": "flaky", "unconfirmed": "unconfirmed"}[status]
    name = _slug(exploration.name, suffix)
    runs_of_it = tried.runs
    schedule = search.describe(tried.spec)
    description = (
        f"Found by `aftershock explore {exploration.file} --seed {exploration.seed}` "
        f"(run {tried.index}), shrunk to {len(tried.spec.faults)} fault(s): {schedule}. "
        f"It failed {tried.failures} of {runs_of_it} run(s) of exactly this schedule"
        + (" and was interrupted before a re-run" if status == "unconfirmed" else "")
        + f": {tried.reason}"
        + ("" if flaky is None else
           f". The simpler schedule {search.describe(flaky.spec)} failed only "
           f"{flaky.failures} of {flaky.runs} run(s) (flaky), so this is "
           "the simplest failure found that failed every re-run"))
    written = tried.spec.model_copy(update={"name": name, "description": description})
    file = search.out / f"{name}.yaml"
    file.parent.mkdir(parents=True, exist_ok=True)
    text = to_yaml(written)
    parse_scenario(text, str(file))  # what is written loads
    file.write_text(text)
    exploration.findings.append(Finding(
        status=status, file=str(file), schedule=schedule, faults=len(tried.spec.faults),
        failed_checks=tried.failed, message=tried.reason, failures=tried.failures,
        passes=tried.passes, found_at_run=tried.index))
