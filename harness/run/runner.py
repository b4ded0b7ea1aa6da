"""Run a scenario: launch, inject on schedule, heal, record, check.

The order of teardown is the point of this module: whatever happens (the
system crashes, a check fails, the user presses Ctrl-C, the harness gets
SIGTERM), every applied fault is reverted and every launched process is ended
in ``finally``; a reaper process covers the case where the harness itself is
killed.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from aftershock.faults import FaultUnavailable, contract, file_writers
from aftershock.faults.heal import heal_orphans, start_reaper
from aftershock.faults.journal import Journal, UnsafeFolder
from aftershock.faults.registry import preflight as fault_preflight
from aftershock.harness import systems
from aftershock.harness.errors import AftershockError, HarnessError, PreflightError, RunFailed
from aftershock.harness.run import _load, _room, attempts
from aftershock.harness.run.injector import Injector, acts_on_files, fault_params
from aftershock.harness.run.loadgen import LoadDriver, scenario_load_driver
from aftershock.harness.run.records import CheckResult, Event, FaultRecord, ProcessEnd, RunResult
from aftershock.harness.run.rundir import RESULT_STAGED, claimed, write_result
from aftershock.harness.run.schedule import Progress, Schedule
from aftershock.harness.run.target import SERVED_STOP_GRACE_S, STOP_GRACE_S, Target, Teardown
from aftershock.harness.run.timeline import Timeline, read_events
from aftershock.harness.run.triggers import FileTriggers
from aftershock.harness.scenario import _own_records
from aftershock.harness.scenario.spec import LoadedScenario, Scenario, in_process
from aftershock.harness.systems import Driver
from aftershock.harness.twin import baseline, golden
from aftershock.harness.twin.baseline import CACHE_ENV as CACHE_ENV
from aftershock.harness.twin.baseline import UNTRUSTED as UNTRUSTED_TWIN
from aftershock.harness.twin.baseline import baseline_key as baseline_key
from aftershock.harness.twin.baseline import cache_dir as cache_dir
from aftershock.harness.verdict import metrics as _metrics
from aftershock.harness.verdict.checks import Outcome, evaluate

POLL_S = 0.01
#: A step trigger that fires more than this many steps (or a tenth of its step) past its
#: step is reported (`trigger_late`): the step lines are too sparse, or the run resumed.
LATE_STEPS = 10
# CACHE_ENV, baseline_key and cache_dir live in harness/twin/baseline.py; callers find them here
# too.


class Observer(Protocol):
    """What a live view gets told while a scenario runs."""

    def phase(self, scenario: str, phase: str, detail: str = "") -> None: ...

    def event(self, event: Event) -> None: ...

    def finished(self, result: RunResult) -> None: ...


class NullObserver:
    def phase(self, scenario: str, phase: str, detail: str = "") -> None:
        pass

    def event(self, event: Event) -> None:
        pass

    def finished(self, result: RunResult) -> None:
        pass


class Interrupted(KeyboardInterrupt):
    """SIGTERM reached the harness; unwinds like Ctrl-C so every `finally` heals."""


class RunInterrupted(KeyboardInterrupt):
    """A scenario run was interrupted (Ctrl-C or SIGTERM) after its teardown; ``result``
    is its record, marked interrupted and already written to the run folder."""

    def __init__(self, result: RunResult, exit_code: int) -> None:
        super().__init__(result.error)
        self.result = result
        self.exit_code = exit_code  # the shell's convention: 128 + the signal's number


#: A SIGTERM arrived while an unwinding context was open; cleared when the outermost ends.
#: The handler's exception can be lost: Python swallows one raised in a gc callback (which
#: hypothesis keeps), a ``__del__`` or a weakref callback, and the harness then went on as
#: if no signal had come. So the signal is also remembered, and raised again where the
#: harness looks (each turn of a run's loop, before each run of a search, and when the
#: context ends).
_terminating = False
_unwinding_depth = 0


def raise_if_terminating() -> None:
    """Deliver a SIGTERM whose handler's exception was swallowed where it landed."""
    if _terminating:
        raise Interrupted()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    global _terminating, _unwinding_depth

    def handler(signum: int, frame: object) -> None:
        global _terminating
        _terminating = True
        raise Interrupted()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller owns signal handling
        yield
        return
    _unwinding_depth += 1
    try:
        raise_if_terminating()
        yield
        raise_if_terminating()
    finally:
        signal.signal(signal.SIGTERM, previous)
        _unwinding_depth -= 1
        if _unwinding_depth == 0:
            _terminating = False


@dataclass
class Execution:
    events: list[Event]
    outcome: Outcome
    faults: list[FaultRecord]
    run_dir: Path


#: A fault's own parameters as its kind takes them (kept under this name for callers).
_params = fault_params


def execute(
    spec: Scenario,
    *,
    scenario_dir: Path,
    run_dir: Path,
    seed: int,
    observer: Observer,
    phase: str = "run",
    extra_args: tuple[str, ...] = (),
) -> Execution:
    """Launch the system, drive the fault schedule, tear everything down."""
    _clean_run_dir(run_dir)
    run_id = uuid.uuid4().hex
    timeline = Timeline(run_dir / "events.jsonl")
    kind = systems.of(spec.system)
    launch = kind.launch(spec.system, run_dir=run_dir, scenario_dir=scenario_dir, seed=seed,
                         extra_args=extra_args)
    target = kind.target(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)

    def root_of(fault: Any) -> str:
        return _storage_root(spec, run_dir, getattr(fault, "root", None), scenario_dir)

    # What this run may touch: a heal refuses any undo path outside these folders.
    folders = {run_dir, *target.folders()}
    folders.update(Path(root_of(f)) for f in spec.faults if acts_on_files(f))
    try:
        journal = Journal.create(run_id, folders=sorted(folders))
    except UnsafeFolder as exc:
        raise HarnessError(f"cannot keep a heal journal: {exc}") from None
    reaper = start_reaper(journal.path)
    # Journaled before the run's cgroup exists: a harness killed after making it leaves
    # a record that lets the reaper or `aftershock heal` end the group and remove it.
    launch_entry = journal.intend("launch", target.tracking(), op="launch")
    schedule = Schedule(spec.faults, [in_process(f) for f in spec.faults])
    triggers = FileTriggers()
    t0 = time.monotonic()
    injector = Injector(spec.faults, target=target, journal=journal, timeline=timeline,
                        observer=observer, seed=seed, t0=t0, root_of=root_of,
                        log_dir=run_dir / "logs", guarded=_own_records.guarded(run_dir),
                        read_writers=spec.expect.faults_landed is not None)
    loop = _Loop(list(spec.faults), timeline, observer, target, injector, schedule, triggers, t0,
                 timeout_s=spec.system.timeout.total_seconds(),
                 driver=scenario_load_driver(spec.load, launch.variables, seed=seed,
                                             timeline=timeline)
                 if spec.load is not None else
                 kind.driver(spec.system, seed=seed, timeline=timeline))
    _hand_fsyncs(loop.driver, injector)
    monitor = _load.LoadMonitor(timeline, getattr(target, "cgroup", None))
    try:
        with _sigterm_unwinds():
            observer.phase(spec.name, phase, shlex.join(launch.argv))
            for index in injector.prepare():
                schedule.give_up(index)
            _watch_files(spec, triggers, schedule, injector, root_of, target)
            target.start()
            monitor.start()
            # wall_offset: wall-clock minus monotonic time now, so the timeline (monotonic) can
            # be lined up with other logs (wall clock) later (docs/report.md).
            observer.event(timeline.emit("launch", argv=launch.argv, phase=phase, seed=seed,
                                         wall_offset=time.time() - time.monotonic(),
                                         **target.launched()))
            loop.run()
    except OSError as exc:
        # A write of the harness's own in the run loop that found the disk full: the run
        # ends as when any of its writers finds it (raised below, once all is undone).
        if not timeline.room.note(str(exc.filename or run_dir), exc):
            raise
    finally:
        errors, teardown = _stop_all(spec, loop, target, injector, monitor, triggers, t0)
        if teardown.complete:
            journal.done(launch_entry)
        # else the launch stays pending: the reaper, the next run or `aftershock heal`
        # tries again to end what survived.
        journal.close()
        with contextlib.suppress(Exception):
            reaper.kill()
            reaper.wait(timeout=2)
        # Events written while the target was being stopped still belong to the run (the
        # harness's own went to the observer as they were emitted).
        for ev in timeline.poll():
            if ev.source != "harness":
                observer.event(ev)
        _record_ends(timeline, target, loop, run_dir, observer)
        # The live view shows the exit, not "running" after it.
        with contextlib.suppress(Exception):
            observer.event(timeline.emit("run_end", exit_code=loop.exit_code,
                                         timed_out=loop.timed_out))
        timeline.close()
        if errors:
            raise HarnessError("could not revert: " + "; ".join(errors))
    # A writer found the disk full after the loop's last look (the job's last lines): what
    # was recorded is not whole, so the run is not judged.
    timeline.room.check()
    _note_unreached(schedule, injector, loop.awaited)
    # Judged only whole: a line that is not an event (a fault or a writer that touched the
    # timeline) raises DamagedTimeline, a harness error (exit 3), instead of metrics from
    # what was left; the harness's run_end closed it, so not even a torn last line is fine.
    events = read_events(run_dir / "events.jsonl", complete=True)
    # The run's own duration: the time teardown took (its grace period) is not the job's.
    ended = loop.ended or time.monotonic()
    outcome = Outcome(loop.exit_code, loop.timed_out, round(ended - t0, 3))
    return Execution(events, outcome, injector.in_scenario_order(), run_dir)


def _hand_fsyncs(driver: Driver | None, injector: Injector) -> None:
    """A load's journal check reads the journal's fsyncs where a fault's lazy filesystem
    keeps them (storage.lose_unsynced)."""
    if isinstance(driver, LoadDriver):
        driver.sync_history = injector.sync_history


def _stop_all(spec: Scenario, loop: _Loop, target: Target, injector: Injector,
              monitor: _load.LoadMonitor, triggers: FileTriggers, t0: float
              ) -> tuple[list[str], Teardown]:
    """Heal every fault, stop the load and the system, undo what was set up at launch and
    put the teardown on the timeline. What could not be reverted, and how the stop went."""
    timeline, observer = loop.timeline, loop.observer
    # First: a job held in an open by a file trigger goes on before anything is undone (a
    # filesystem it is opening on cannot be unmounted under it).
    triggers.close()
    errors = injector.heal_all()
    monitor.stop()
    if loop.driver is not None:
        loop.driver.stop()
    grace = _served_grace(spec) if loop.driven else STOP_GRACE_S
    teardown = target.stop(grace)
    if timeline.room.full is not None:
        timeline.room.full.stopped_s = round(time.monotonic() - t0, 1)
    # What was set up at launch goes once nothing of the system can still use it.
    errors.extend(injector.unprepare())
    if loop.driven:
        # The system ran until its driver was done (a server's load served); how it then
        # shut down (SIGTERM, exit 0 expected) is its exit code.
        loop.exit_code = target.poll()
    overran: dict[str, Any] = (
        {"overran": list(teardown.overran), "grace_s": grace} if teardown.overran else {})
    observer.event(timeline.emit(
        "teardown", tracking=teardown.tracking, survivors=list(teardown.survivors),
        logs_open=list(teardown.logs_open), cgroup_removed=teardown.cgroup_removed,
        **overran))
    return errors, teardown


def _note_unreached(schedule: Schedule, injector: Injector, awaited: Mapping[int, int]
                    ) -> None:
    """Record each fault that never fired, and each repeat that did not all happen;
    ``awaited``: how often each fault's ``at: {after}`` event was seen."""
    for index in schedule.never_fired():
        injector.unreached(index, awaited=awaited.get(index, 0))
    for index, k, n in schedule.missing_repeats():
        injector.unreached(index, (k, n))


def _record_ends(timeline: Timeline, target: Target, loop: _Loop, run_dir: Path,
                 observer: Observer) -> None:
    """How each process of the system ended (``process_exited``, harness/run/attempts.py),
    read once the teardown is over and every file its processes left is final. The pid and
    the workers found gone are a local target's; a target without them gives less evidence,
    never more. An explanation that fails is a record on the timeline, not a lost run."""
    # The launcher ended by itself; a run stopped by the harness (timeout, load served)
    # says nothing of how it would have.
    exited = loop.exit_code is not None and not loop.driven
    launcher = attempts.LauncherExit(pid=getattr(target, "pid", None),
                                     exit_code=loop.exit_code if exited else None,
                                     t=loop.ended or time.monotonic())
    try:
        found = attempts.process_exits(
            read_events(timeline.path), gone=getattr(target, "workers_gone", {}),
            launcher=launcher, launcher_log=run_dir / "logs" / "launcher.stderr.log")
    except Exception as exc:
        observer.event(timeline.emit("process_exits_unread",
                                     error=f"{type(exc).__name__}: {exc}"))
        return
    for event in found:
        observer.event(timeline.write(event))


#: What a run writes in its folder: the harness's records, and the folders it gives the
#: system (its output, checkpoints, TMPDIR, simulated NVML, logs). The fault-free twin's
#: folder (``fault_free``) is its own run folder, cleaned by its own run.
RUN_DIR_MARK = ".aftershock-run"
_RUN_WRITES = ("events.jsonl", "commands.jsonl", "result.json", RESULT_STAGED,
               "harness_error.txt", "output", "checkpoints", "tmp", "nvml", "logs", "work")


def _clean_run_dir(run_dir: Path) -> None:
    """A reused run folder starts clean: an old timeline would replay old events, an old
    command file re-arm old faults, a server's old journal answer every request without
    computing it, a trainer's old checkpoints be resumed from. Only a folder a run made
    (its mark) is emptied, and only of what a run writes. Any other folder is used as it
    is and stays unmarked: one that held something else when a run first used it is never
    emptied."""
    if (run_dir / RUN_DIR_MARK).exists():
        for name in _RUN_WRITES:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        return  # someone else's folder: leave it unmarked, so it is never emptied
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_DIR_MARK).touch()


def _watch_files(spec: Scenario, triggers: FileTriggers, schedule: Schedule,
                 injector: Injector, root_of: Any, target: Target) -> None:
    """The file triggers, from launch on (after prepare: on top of what it mounted). An
    `opened` trigger asks the run's own processes (only those: bounded) who writes."""

    def writing(path: Path) -> bool:
        return bool(file_writers([ref.pid for ref in target.processes()], path).writers)

    for index, fault in enumerate(spec.faults):
        at = fault.at
        if at.file is None or schedule.finished(index):
            continue
        try:
            triggers.watch(index, Path(root_of(fault)), at.file, at.when, writing,
                           count=at.count)
        except (FaultUnavailable, OSError) as exc:
            injector.failed(index, exc)
            schedule.give_up(index)


class _Loop:
    """The run loop: read the timeline, apply what is due, heal what is over, until the
    system exits, its load is served or its time is up. Its state is the run's outcome."""

    def __init__(self, faults_: list[Any], timeline: Timeline, observer: Observer,
                 target: Target, injector: Injector, schedule: Schedule,
                 triggers: FileTriggers, t0: float, *, timeout_s: float,
                 driver: Driver | None) -> None:
        self.faults = faults_
        self.timeline = timeline
        self.observer = observer
        self.target = target
        self.injector = injector
        self.schedule = schedule
        self.triggers = triggers
        self.t0 = t0
        self.timeout_s = timeout_s
        self.driver = driver
        self.driven = False  # the run ended because its driver was done
        self.exit_code: int | None = None
        self.timed_out = False
        self.ended: float | None = None  # when the run ended, before teardown
        self.max_step = -1
        self.first_step: int | None = None  # the first committed step the run showed
        self.seen: dict[str, int] = {}  # event name -> occurrences, for `at: {event}` triggers
        # fault -> the system's events matching its `at: {after}` so far
        self.awaited: dict[int, int] = {}
        self._after = [(i, f.at.after) for i, f in enumerate(faults_)
                       if getattr(f.at, "after", None) is not None]

    def run(self) -> None:
        while True:
            raise_if_terminating()
            # A writer of the run found its disk full: stopped now, not at its timeout.
            self.timeline.room.check()
            now = time.monotonic()
            for index, exc in self.triggers.poll():
                if not self.schedule.finished(index):
                    self.injector.failed(index, exc)
                    self.schedule.give_up(index)
            for ev in self.timeline.poll():
                self._read(ev)
            progress = Progress(now=now, elapsed=now - self.t0, max_step=self.max_step,
                                seen=self.seen, file_hits=self.triggers.hits(),
                                awaited=self.awaited)
            for index in self.schedule.due(progress):
                if self._apply(index):
                    self.schedule.fired(index, progress)
            self.injector.heal_due(now)
            self.injector.note_exits()
            if self._over(now):
                return
            self.triggers.wait(POLL_S)

    def _read(self, ev: Event) -> None:
        if ev.source != "harness":
            self.seen[ev.event] = self.seen.get(ev.event, 0) + 1
            for index, after in self._after:
                if after.matches(ev.event, ev.rank, ev.fields.get("role")):
                    self.awaited[index] = self.awaited.get(index, 0) + 1
            self.injector.observe(ev)
        if ev.event == contract.STEP and isinstance(ev.fields.get("step"), int):
            self.max_step = max(self.max_step, ev.fields["step"])
            if self.first_step is None:
                self.first_step = ev.fields["step"]
        if self.driver is not None:
            self.driver.observe(ev)
        self.target.observe(ev)
        if ev.source != "harness":
            self.observer.event(ev)

    def _apply(self, index: int) -> bool:
        """Apply a due fault; a fault that cannot be applied is a record on the timeline,
        not a crash: the run goes on and `faults_injected` fails with the reason."""
        fault = self.faults[index]
        first = not self.schedule.repetition(index)
        file = (self.triggers.path(index, fault.at.count)
                if first and fault.at.file is not None else None)
        # Whether the job waits in its open of the file until the fault is in (`created`).
        landing = self.triggers.landing(index) if file is not None else None
        try:
            applied = self.injector.apply(index, arm_step=self.schedule.arm_step(index),
                                          file=file, landing=landing)
        except Exception as exc:
            self.triggers.release(index)
            self.injector.failed(index, exc)
            self.schedule.give_up(index)
            return False
        if applied and file is not None:
            self.triggers.release(index)  # the fault is in: the held open goes on
        if applied and first and fault.at.step is not None and not in_process(fault):
            self._late(index, int(fault.at.step))
        return applied

    def _late(self, index: int, at_step: int) -> None:
        """Warn when a step trigger fired far past its step: the fault did not hit the
        moment the scenario names (a run that resumed from an old snapshot at step 175
        fired a `step: 60` fault there)."""
        past = self.max_step - at_step
        resumed = self.first_step is not None and self.first_step > at_step
        if past <= max(LATE_STEPS, at_step // 10) and not resumed:
            return
        self.observer.event(self.timeline.emit(
            "trigger_late", fault=index, kind=self.faults[index].kind, at_step=at_step,
            step=self.max_step, first_step=self.first_step, resumed=resumed))

    def _over(self, now: float) -> bool:
        self.exit_code = self.target.poll()
        if self.exit_code is not None:
            self.ended = now
            return True
        if self.driver is not None and self.driver.done():
            closing = self.driver.finish()
            if closing is not None:
                self.observer.event(closing)
            self.driven = True
            self.ended = now
            return True
        if now - self.t0 > self.timeout_s:
            self.timed_out = True
            self.ended = now
            self.observer.event(self.timeline.emit("timeout", after_s=round(now - self.t0, 3)))
            return True
        return False


def _served_grace(spec: Scenario) -> float:
    """Seconds a system whose load was served gets after SIGTERM: a command's
    ``stop_grace``, otherwise :data:`SERVED_STOP_GRACE_S`."""
    grace = getattr(spec.system, "stop_grace", None)
    return SERVED_STOP_GRACE_S if grace is None else float(grace.total_seconds())


def _storage_root(spec: Scenario, run_dir: Path, given: str | None, scenario_dir: Path) -> str:
    """The folder a file fault's ``path`` is relative to: its ``root`` (``${run_dir}``
    expanded), else where the system keeps its files (a command: where it works; a relative
    ``cwd`` is relative to the scenario's folder, as the command is started there)."""
    if given:
        return given.replace("${run_dir}", str(run_dir))
    base = scenario_dir.resolve()
    root = str(systems.of(spec.system).default_root(spec.system, run_dir.resolve()))
    return str((base / root.replace("${scenario_dir}", str(base))).resolve())


# ----------------------------------------------------------------- fault-free baseline


def fault_free_result(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool,
    what: str,
) -> tuple[dict[str, Any] | None, str]:
    """What the fault-free twin produced (``what``: its final parameter ``digests`` or its
    requests' ``outputs``), from the cache or by running it (harness/twin/baseline.py)."""

    def run(twin: Scenario) -> Execution:
        # Through the module's `execute`, looked up now: tests wrap it to break the faulted
        # run only (tests/_broken.py), and the twin must tell them it is the twin.
        return execute(twin, scenario_dir=loaded.path.parent, run_dir=run_dir, seed=seed,
                       observer=observer, phase="fault-free baseline")

    return baseline.fault_free_result(loaded, seed=seed, run_dir=run_dir, use_cache=use_cache,
                                      what=what, run=run)


def fault_free_digests(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool
) -> tuple[dict[int, str] | None, str]:
    """Final parameter digests of the fault-free twin, from cache or by running it."""
    found, note = fault_free_result(loaded, seed=seed, run_dir=run_dir, observer=observer,
                                    use_cache=use_cache, what="digests")
    return (None if found is None else {int(k): str(v) for k, v in found.items()}), note


def fault_free_outputs(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool
) -> tuple[dict[str, _metrics.Output] | None, str]:
    """Each request's tokens and logits digests in the fault-free twin (same load, seed)."""
    found, note = fault_free_result(loaded, seed=seed, run_dir=run_dir, observer=observer,
                                    use_cache=use_cache, what="outputs")
    if found is None:
        return None, note
    try:
        return {k: _metrics.Output.from_json(v) for k, v in found.items()}, note
    except (TypeError, ValueError) as exc:
        return None, f"unreadable fault-free outputs ({exc}); {note}"


def replay_digests(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer
) -> tuple[dict[int, str] | None, str]:
    """The final digests the membership the run recorded implies, recomputed by the
    independent oracle (aftershock.harness.oracle): from the model's math alone, not by the trainer.

    The reference trainer writes every generation's first step and live replicas to
    ``output/membership.jsonl``. Replaying that log with the trainer's own code would repeat
    any bug of that code (a wrong gradient average passes itself), so the oracle restates the
    math instead. A layout it cannot reproduce bitwise is "not observed", never a pass."""
    from aftershock.harness import oracle

    spec = loaded.spec
    if not systems.of(spec.system).replays(spec.system):
        return None, "not observed: this system records no membership to replay"
    log = run_dir / "output" / "membership.jsonl"
    if not log.exists():
        return None, f"not observed: the run recorded no membership log ({log})"
    try:
        schedule = oracle.read_membership(log)
    except (OSError, ValueError) as exc:
        return None, f"not observed: {exc}"
    observer.phase(spec.name, "independent replay", f"{len(schedule)} generation(s) from {log}")
    expected = oracle.trainer_digests(spec.system, seed=seed, schedule=schedule)
    return expected.digests, expected.note


# ------------------------------------------------------------------------ scenario run


def default_run_dir(name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(".aftershock") / "runs" / f"{stamp}-{name}-{uuid.uuid4().hex[:6]}"


def preflight(loaded: LoadedScenario) -> None:
    """Refuse, before anything is launched, a scenario whose faults this machine cannot
    cause (a missing tool, kernel feature or privilege), with what to install."""
    problems = [
        f"fault {index} ({fault.kind}): {need}"
        for index, fault in enumerate(loaded.spec.faults)
        for need in fault_preflight(fault.kind, _params(fault))
    ]
    if problems:
        raise PreflightError(f"{loaded.path}: this machine cannot cause the scenario's faults: "
                             + "; ".join(problems))


def _world(spec: Scenario) -> int | None:
    return systems.of(spec.system).world(spec.system)


def assess(
    spec: Scenario,
    *,
    events: Sequence[Event],
    outcome: Outcome,
    faults: Sequence[FaultRecord],
    baseline: dict[int, str] | None,
    baseline_outputs: dict[str, _metrics.Output] | None,
    baseline_note: str,
) -> tuple[dict[str, float | int | None], list[CheckResult]]:
    """The metrics and checks of one run's timeline. `aftershock run` and `aftershock report
    --recheck` both judge through this one function, so a re-check is the verdict a run
    would have given."""
    world = _world(spec)
    metrics = _metrics.compute(events, world)
    metrics.update(_load.summary(events))
    checks = evaluate(
        spec.expect, outcome=outcome, metrics=metrics, faults=faults,
        digests=_metrics.final_digests(events), baseline=baseline,
        events=events, outputs=_metrics.outputs(events),
        baseline_outputs=baseline_outputs, world=world,
        file_triggers={i: f.at.when for i, f in enumerate(spec.faults) if f.at.file is not None},
    )
    missing = {"params_match": spec.expect.params_match and baseline is None,
               "outputs_match": spec.expect.outputs_match and baseline_outputs is None}
    # A latency budget missed on a starved machine says so: load, or a slow recovery?
    starved = _load.starved_note(metrics)
    if starved is not None:
        checks = [replace(c, message=f"{c.message}; {starved}")
                  if not c.passed and c.name in _load.LATENCY_CHECKS else c for c in checks]
    # A twin the cache had but could not prove its own ran again: the check says so.
    distrusted = baseline_note.startswith(UNTRUSTED_TWIN)
    checks = [
        CheckResult(c.name, False, c.observed, c.expected, f"{c.message} ({baseline_note})")
        if missing.get(c.name) else
        replace(c, message=f"{c.message} ({baseline_note})")
        if distrusted and c.name in missing else c
        for c in checks
    ]
    return metrics, checks


def run_scenario(
    loaded: LoadedScenario,
    *,
    run_dir: Path | None = None,
    seed: int | None = None,
    observer: Observer | None = None,
    use_cache: bool = True,
) -> RunResult:
    """Run one scenario and write its record (``result.json``), whatever happens, holding
    its run folder for the whole run (another run there raises RunDirBusy, exit 2).

    An interrupted run raises RunInterrupted and a harness failure RunFailed, each
    carrying the run's record (marked as such) after the teardown healed everything;
    an unexpected exception's traceback is kept in the run folder (``harness_error.txt``).
    """
    run_dir = (run_dir or default_run_dir(loaded.spec.name)).resolve()
    with claimed(run_dir):
        return _run_claimed(loaded, run_dir=run_dir, seed=seed, observer=observer,
                            use_cache=use_cache)


def _run_claimed(loaded: LoadedScenario, *, run_dir: Path, seed: int | None,
                 observer: Observer | None, use_cache: bool) -> RunResult:
    spec = loaded.spec
    seed = spec.seed if seed is None else seed
    observer = observer or NullObserver()
    _clean_run_dir(run_dir)
    started = time.monotonic()
    # Room for the record, held from now until it is written: a job that fills the disk
    # under the run folder must not take the room its record needs.
    reserve = _room.Reserve(run_dir)
    kept = ""  # where the record of a run without a verdict was written

    def unfinished(error: str, *, interrupted: bool = False) -> RunResult:
        nonlocal kept
        result = _unfinished(loaded, seed=seed, run_dir=run_dir, started=started, error=error,
                             interrupted=interrupted)
        kept = _keep(result, run_dir, reserve)
        with contextlib.suppress(Exception):  # the record matters more than its rendering
            observer.finished(result)
        return result

    try:
        try:
            with _sigterm_unwinds():
                reserve.take()
                (run_dir / "scenario.yaml").write_text(loaded.text)
                preflight(loaded)
                # What a crashed earlier run left behind goes first; the user hears what was
                # refused.
                for item in heal_orphans():
                    observer.phase(spec.name, "heal", item.describe())
                result = _checked_run(loaded, seed=seed, run_dir=run_dir, observer=observer,
                                      use_cache=use_cache, started=started, reserve=reserve)
        except OSError as exc:  # a record of the run's own, written while no job ran
            if not _room.is_full(exc):
                raise
            raise _room.RunDirFull(
                run_dir, f"writing {exc.filename or run_dir}: {exc.strerror or exc}") from None
    except KeyboardInterrupt as exc:
        sigterm = isinstance(exc, Interrupted)
        result = unfinished(
            f"interrupted by {'SIGTERM' if sigterm else 'SIGINT'} after "
            f"{time.monotonic() - started:.1f}s; no check was evaluated", interrupted=True)
        raise RunInterrupted(result, 143 if sigterm else 130) from None
    except _room.RunDirFull as exc:
        result = unfinished(f"harness error: {exc}")
        raise RunFailed(exc.describe(kept), result) from exc
    except AftershockError as exc:
        result = unfinished(f"harness error: {exc}")
        raise RunFailed(str(exc), result) from exc
    except Exception as exc:
        # A bug of the harness, not a verdict on the system: say so in one line, keep the
        # traceback for the bug report.
        trace = run_dir / "harness_error.txt"
        with contextlib.suppress(OSError):
            trace.write_text(traceback.format_exc())
        message = f"unexpected {type(exc).__name__}: {exc} (traceback: {trace})"
        result = unfinished(f"harness error: {message}")
        raise RunFailed(message, result) from exc
    finally:
        reserve.release()
    observer.finished(result)
    return result


def _keep(result: RunResult, run_dir: Path, reserve: _room.Reserve) -> str:
    """Write the record of a run without a verdict where there is room, and say where: its
    run folder, with the reserve given back first; else a new folder in the system's
    temporary folder; else nowhere, and the record is in what is said (on stderr)."""
    reserve.release()
    try:
        return f"record written to {write_result(run_dir, result)}"
    except OSError as exc:
        first = exc.strerror or str(exc)
    fallback: Path | None = None
    with contextlib.suppress(OSError):
        fallback = Path(tempfile.mkdtemp(prefix=f"aftershock-{run_dir.name}-"))
        return (f"no room for the record in the run folder ({first}): record written to "
                f"{write_result(fallback, result)}")
    if fallback is not None:
        with contextlib.suppress(OSError):
            fallback.rmdir()
    return (f"no room for the record in the run folder ({first}) nor in "
            f"{tempfile.gettempdir()}; the record: {json.dumps(result.to_json())}")


def _unfinished(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, started: float, error: str,
    interrupted: bool,
) -> RunResult:
    """The record of a run that did not get to its checks: what its timeline shows so far,
    no verdict (``passed`` is false, ``error`` says why)."""
    metrics: dict[str, float | int | None] = {}
    ends: tuple[ProcessEnd, ...] = ()
    crash_loop: str | None = None
    with contextlib.suppress(Exception):  # a timeline cut short may be too thin to measure
        path = run_dir / "events.jsonl"
        events = read_events(path)  # a damaged one raises: no metrics from what was left
        ends, crash_loop = attempts.summarize(events)
        metrics = _metrics.compute(events, _world(loaded.spec))
    result = RunResult(
        name=loaded.spec.name, file=str(loaded.path), passed=False, seed=seed,
        duration_s=round(time.monotonic() - started, 3), checks=(), metrics=metrics, faults=(),
        run_dir=str(run_dir), error=error, interrupted=interrupted, ends=ends,
        crash_loop=crash_loop,
    )
    return result


def _checked_run(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool,
    started: float, reserve: _room.Reserve,
) -> RunResult:
    spec = loaded.spec
    baseline: dict[int, str] | None = None
    baseline_note = ""
    if spec.expect.params_match == "fault_free":
        baseline, baseline_note = fault_free_digests(
            loaded, seed=seed, run_dir=run_dir / "fault_free", observer=observer,
            use_cache=use_cache,
        )

    baseline_outputs: dict[str, _metrics.Output] | None = None
    if spec.expect.outputs_match == "fault_free":
        baseline_outputs, baseline_note = fault_free_outputs(
            loaded, seed=seed, run_dir=run_dir / "fault_free", observer=observer,
            use_cache=use_cache,
        )

    execution = execute(spec, scenario_dir=loaded.path.parent, run_dir=run_dir, seed=seed,
                        observer=observer)
    if spec.expect.params_match == "replay":
        baseline, baseline_note = replay_digests(
            loaded, seed=seed, run_dir=run_dir, observer=observer
        )
    metrics, checks = assess(
        spec, events=execution.events, outcome=execution.outcome, faults=execution.faults,
        baseline=baseline, baseline_outputs=baseline_outputs, baseline_note=baseline_note,
    )
    if spec.expect.params_match == "fault_free":
        golden_check = golden.check(loaded, seed=seed, what="digests", found=baseline)
    else:
        golden_check = golden.check(loaded, seed=seed, what="outputs", found=baseline_outputs)
    if golden_check is not None:
        checks.append(golden_check)
    ends, crash_loop = attempts.summarize(execution.events)
    result = RunResult(
        name=spec.name,
        file=str(loaded.path),
        passed=all(c.passed for c in checks),
        seed=seed,
        duration_s=round(time.monotonic() - started, 3),
        checks=tuple(checks),
        metrics=metrics,
        faults=tuple(execution.faults),
        run_dir=str(run_dir),
        proofs=_metrics.metric_proofs(execution.events, _world(spec)),
        ends=ends,
        crash_loop=crash_loop,
    )
    reserve.release()  # the room held for the record
    write_result(run_dir, result)
    return result
