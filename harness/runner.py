"""Run a scenario: launch, inject on schedule, heal, record, check.

The order of teardown is the point of this module: whatever happens (the
system crashes, a check fails, the user presses Ctrl-C, the harness gets
SIGTERM), every applied fault is reverted and every launched process is ended
in ``finally``; a reaper process covers the case where the harness itself is
killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import select
import shlex
import signal
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import faults
from faults._errors import FaultUnavailable
from faults._inotify import FileWatch
from faults._proc import ProcessRef
from faults.heal import heal_orphans, start_reaper
from faults.journal import Journal, UnsafeFolder
from faults.registry import preflight as fault_preflight
from harness import golden
from harness import metrics as _metrics
from harness.checks import Outcome, evaluate
from harness.errors import AftershockError, HarnessError, PreflightError, RunFailed
from harness.loadgen import LoadGenerator, fetch_json
from harness.records import CheckResult, Event, FaultRecord, RunResult
from harness.spec import (
    CommandSystem,
    LoadedScenario,
    Scenario,
    ServerSystem,
    TrainerSystem,
    in_process,
)
from harness.target import LocalTarget, plan_launch
from harness.timeline import Timeline

POLL_S = 0.01
CACHE_ENV = "AFTERSHOCK_CACHE_DIR"


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


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise Interrupted()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller owns signal handling
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _ScheduledFault:
    index: int
    spec: Any
    records: list[FaultRecord] = field(default_factory=list)
    fired: bool = False
    times: int = 0  # how often it fired (for `every`)
    next_step: int | None = None  # repeat due at this committed step
    next_time: float | None = None  # repeat due at this monotonic time


@dataclass
class _Active:
    applied: faults.Applied
    record_index: int
    heal_at: float | None
    duration: timedelta | None = None  # for in-process faults: counted from the probe's report
    fault: int | None = None


@dataclass
class Execution:
    events: list[Event]
    outcome: Outcome
    faults: list[FaultRecord]
    run_dir: Path


def _params(spec: Any) -> dict[str, Any]:
    data = spec.model_dump(exclude={"kind", "target", "at"}, exclude_none=True)
    return {k: (v.total_seconds() if hasattr(v, "total_seconds") else v) for k, v in data.items()}


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
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    # A reused run folder starts clean: an old timeline would replay old events (a server's
    # old address, steps already reached) and an old command file would re-arm old faults.
    for stale in ("events.jsonl", "commands.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    timeline = Timeline(run_dir / "events.jsonl")
    launch = plan_launch(spec.system, run_dir=run_dir, scenario_dir=scenario_dir, seed=seed,
                         extra_args=extra_args)
    target = LocalTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)
    # What this run may touch: a heal refuses any undo path outside these folders.
    folders = {run_dir, Path(target.env()["AFTERSHOCK_NVML_DIR"])}
    folders.update(Path(_storage_root(spec, run_dir, getattr(f, "root", None)))
                   for f in spec.faults if str(f.kind).startswith("storage."))
    try:
        journal = Journal.create(run_id, folders=sorted(folders))
    except UnsafeFolder as exc:
        raise HarnessError(f"cannot keep a heal journal: {exc}") from None
    reaper = start_reaper(journal.path)
    # Journaled before the run's cgroup exists: a harness killed after making it leaves
    # a record that lets the reaper or `aftershock heal` end the group and remove it.
    launch_entry = journal.intend("launch", target.tracking(), op="launch")
    schedule = [_ScheduledFault(i, f) for i, f in enumerate(spec.faults)]
    active: list[_Active] = []
    # The processes faults hit from outside, until the harness sees them end: what a
    # process did after a fault (exited, or went on) is evidence for checks (xid_action).
    watched: list[tuple[ProcessRef, dict[str, Any]]] = []
    records: list[FaultRecord] = []
    armed: dict[int, list[int]] = {}  # fault index -> record indices, in-process faults
    seen: dict[str, int] = {}  # event name -> occurrences, for `at: {event}` triggers
    watches: dict[int, FileWatch] = {}  # fault index -> its `at: {file}` trigger
    prepared: dict[int, faults.Applied] = {}  # fault index -> what its kind set up at launch
    addresses: dict[int, dict[str, list[int]]] = {}  # rank -> published parameter addresses
    max_step = -1
    exit_code: int | None = None
    timed_out = False
    timeout_s = spec.system.timeout.total_seconds()
    rng = random.Random(seed)
    # The reference server runs until its load is served: the load generator starts when
    # the server says where it listens and the run ends when the last request has.
    server = spec.system if isinstance(spec.system, ServerSystem) else None
    loadgen: LoadGenerator | None = None
    load_served = False

    def heal(item: _Active) -> None:
        kind = faults.get(item.applied.kind)
        try:
            kind.revert(item.applied.undo)
        finally:
            if item.applied.journal_id:
                journal.done(item.applied.journal_id)
            ev = timeline.emit("fault_healed", kind=item.applied.kind)
            observer.event(ev)
            old = records[item.record_index]
            records[item.record_index] = FaultRecord(
                old.kind, old.target, old.injected_at_s, round(ev.t - t0, 4), old.detail
            )

    def fire(item: _ScheduledFault, now: float) -> bool:
        target_spec = item.spec.target
        if target_spec.role is not None:
            found = target.role_processes(target_spec.role)
            if not found:
                return False
            ranks = {index: ref for index, ref in enumerate(found)}
            chosen = [0]
            return _inject(item, ranks, chosen, f"role {target_spec.role}", now)
        ranks = target.rank_processes()
        if not ranks:
            return False
        if target_spec.index is not None:
            if target_spec.index not in ranks:
                return False
            chosen = [target_spec.index]
        elif target_spec.replica is not None or target_spec.shard is not None:
            chosen = sorted(
                r for r, (replica, shard) in target.coordinates.items()
                if r in ranks
                and target_spec.replica in (None, replica) and target_spec.shard in (None, shard)
            )
            if not chosen:
                return False
        elif target_spec.pick == "all":
            chosen = sorted(ranks)
        else:
            chosen = [rng.choice(sorted(ranks))]
        return _inject(item, ranks, chosen, None, now)

    def _inject(
        item: _ScheduledFault, ranks: dict[int, ProcessRef], chosen: list[int],
        label: str | None, now: float,
    ) -> bool:
        kind = faults.get(item.spec.kind)
        duration = getattr(item.spec, "duration", None)
        if in_process(item.spec):
            # The probe applies it at the exact step/phase/call and reports the moment;
            # the rank filter travels in the command (a spare may take the rank over).
            at_step = item.spec.at.step
            every = item.spec.every
            if at_step is not None and every is not None and every.steps is not None:
                at_step += item.times * every.steps  # repetition k lands k*N steps later
            params = {**_params(item.spec), "at_step": at_step,
                      "phase": item.spec.at.phase, "fault": item.index,
                      "rank": chosen[0] if len(chosen) == 1 and label is None else None}
            applied = kind.inject(ranks[chosen[0]], params, journal)
            observer.event(timeline.emit("fault_armed", kind=item.spec.kind, fault=item.index,
                                         detail=applied.detail, rank=params["rank"]))
            where = label or (f"rank {params['rank']}" if params["rank"] is not None else "all")
            records.append(FaultRecord(item.spec.kind, where, None, None, applied.detail))
            if applied.journal_id is not None:
                active.append(_Active(applied, len(records) - 1, None, duration, item.index))
            armed.setdefault(item.index, []).append(len(records) - 1)
            return True
        params = fault_params(item)
        # A kind that hits its targets together gets them in one call (a power loss takes
        # every process down at one instant); any other kind one target at a time.
        together = isinstance(kind, faults.GroupKind)
        for group in ([chosen] if together else [[rank] for rank in chosen]):
            rank = group[0]
            if "address_of" in params:
                params = {**params, "address": address_of(rank, params)}
                params.pop("address_of")
                params.pop("index", None)
            # The fault's moment is when applying it began: `ss -K` or a tmpfs copy take
            # long enough that the system can notice before inject() returns.
            began = time.monotonic()
            if together:
                assert isinstance(kind, faults.GroupKind)
                applied = kind.inject_group([ranks[r] for r in group], params, journal)
            else:
                applied = kind.inject(ranks[rank], params, journal)
            fields: dict[str, Any] = {"pid": ranks[rank].pid}
            if label is not None:
                fields["role"] = label
            elif len(group) == 1:
                fields["rank"] = rank
            else:
                fields.update(ranks=group, pids=[ranks[r].pid for r in group])
            if item.spec.at.file is not None and not item.times:
                fields["file"] = watches[item.index].hits[item.spec.at.count - 1]
            ev = timeline.emit(
                "fault_injected", kind=item.spec.kind, detail=applied.detail, fault=item.index,
                at=began, params=params, applied_at=time.monotonic(), **fields,
            )
            observer.event(ev)
            for r in group:
                extra = {"role": label} if label is not None else {"rank": r}
                watched.append((ranks[r], {"pid": ranks[r].pid, "kind": item.spec.kind,
                                           "fault": item.index, **extra}))
            where = label or ("rank " if len(group) == 1 else "ranks ") + ", ".join(
                str(r) for r in group)
            records.append(
                FaultRecord(item.spec.kind, where, round(ev.t - t0, 4), None, applied.detail)
            )
            if applied.journal_id is not None:
                # Counted from the injection, not from the loop's tick: finding the target
                # can take a while on a loaded machine.
                heal_at = (time.monotonic() + duration.total_seconds()
                           if duration is not None else None)
                active.append(_Active(applied, len(records) - 1, heal_at))
        return True

    def fault_params(item: _ScheduledFault) -> dict[str, Any]:
        params = _params(item.spec)
        if str(item.spec.kind).startswith("storage."):
            params["root"] = storage_root(params.get("root"))
        if item.index in prepared:
            params["prepared"] = dict(prepared[item.index].undo)
        return params

    def failed(item: _ScheduledFault, exc: Exception) -> None:
        """A fault that cannot be applied is a record on the timeline, not a crash: the run
        goes on and `faults_injected` fails with the reason."""
        reason = f"{type(exc).__name__}: {exc}"
        observer.event(timeline.emit("fault_failed", kind=item.spec.kind,
                                     fault=item.index, error=reason))
        records.append(FaultRecord(item.spec.kind, item.spec.target.describe(), None, None,
                                   f"could not be applied: {reason}"))
        item.fired = True
        item.times = max(item.times, 1)

    def set_up() -> None:
        """Before launch: what the faults need in place before the system writes a byte
        (a filesystem under its checkpoint folder), then the file triggers (on top of it)."""
        for item in schedule:
            kind = faults.get(item.spec.kind)
            if not isinstance(kind, faults.PreparedKind):
                continue
            params = fault_params(item)
            params["log"] = str(run_dir / "logs" / f"fault{item.index}-{item.spec.kind}.log")
            try:
                applied = kind.prepare(params, journal)
            except Exception as exc:
                failed(item, exc)
                continue
            prepared[item.index] = applied
            observer.event(timeline.emit("fault_prepared", kind=item.spec.kind,
                                         fault=item.index, detail=applied.detail))
        for item in schedule:
            at = item.spec.at
            if at.file is None or item.fired:
                continue
            root = Path(storage_root(getattr(item.spec, "root", None)))
            try:
                watches[item.index] = FileWatch(root, at.file, at.when)
            except (FaultUnavailable, OSError) as exc:
                failed(item, exc)

    def take_file_events() -> None:
        for index, watch in list(watches.items()):
            try:
                watch.poll()
            except FaultUnavailable as exc:  # events were lost: the count is no longer true
                watches.pop(index).close()
                if not schedule[index].fired:
                    failed(schedule[index], exc)

    def fire_safely(item: _ScheduledFault, now: float) -> bool:
        """A fault that cannot be applied is a record on the timeline, not a crash:
        the run goes on and `faults_injected` fails with the reason."""
        try:
            return fire(item, now)
        except Exception as exc:
            failed(item, exc)
            return False

    def address_of(rank: int, params: dict[str, Any]) -> int:
        name = str(params["address_of"])
        known = addresses.get(rank, {})
        if name not in known:
            choices = ", ".join(sorted(known)[:8]) or "none published"
            raise ValueError(f"rank {rank} published no address for {name!r} ({choices}); "
                             "the system must call harness.probe.install(model=...)")
        pointer, numel, size = known[name]
        index = int(params.get("index") or 0)
        if not 0 <= index < numel:
            raise ValueError(f"index {index} is outside {name} ({numel} elements)")
        return int(pointer) + index * int(size)

    def storage_root(given: str | None) -> str:
        return _storage_root(spec, run_dir, given)

    def reschedule(item: _ScheduledFault, now: float) -> None:
        item.times += 1
        every = item.spec.every
        if every is None or item.times >= every.times:
            item.fired = True
            return
        if every.steps is not None and in_process(item.spec) and item.spec.at.step is not None:
            item.next_step = -1  # armed now with its own later step (see _inject)
        elif every.steps is not None:
            item.next_step = max(max_step, 0) + every.steps
        else:
            item.next_time = now + every.time.total_seconds()

    def on_probe_injection(ev: Event) -> None:
        """The probe applied an armed fault: that is the fault's moment on the timeline."""
        index = ev.fields.get("fault")
        if not isinstance(index, int) or index not in armed:
            return
        # Repetitions of one fault share its index: the earliest still waiting fired.
        waiting = [i for i in armed[index] if records[i].injected_at_s is None]
        if not waiting:
            return
        record_index = waiting[0]
        old = records[record_index]
        if old.injected_at_s is None:
            detail = str(ev.fields.get("detail") or ev.fields.get("tensor") or old.detail)
            where = f"rank {ev.rank}" if ev.rank is not None else old.target
            records[record_index] = FaultRecord(old.kind, where, round(ev.t - t0, 4), None,
                                                detail)
        for item in active:
            if item.fault == index and item.heal_at is None and item.duration is not None:
                item.heal_at = time.monotonic() + item.duration.total_seconds()

    t0 = time.monotonic()
    ended: float | None = None  # when the run ended, before teardown (its time limit's clock)
    try:
        with _sigterm_unwinds():
            observer.phase(spec.name, phase, shlex.join(launch.argv))
            set_up()
            target.start()
            tracking: dict[str, Any] = (
                {"tracking": "cgroup", "cgroup": str(target.cgroup)}
                if target.cgroup is not None else
                {"tracking": "env", "tracking_note": target.tracking_note})
            # wall_offset: wall-clock minus monotonic time now, so the timeline (monotonic) can
            # be lined up with other logs (wall clock) later (docs/report.md).
            observer.event(timeline.emit("launch", argv=launch.argv, phase=phase, seed=seed,
                                         wall_offset=time.time() - time.monotonic(),
                                         **tracking))
            while True:
                now = time.monotonic()
                take_file_events()
                for ev in timeline.poll():
                    if ev.source != "harness":
                        seen[ev.event] = seen.get(ev.event, 0) + 1
                        if ev.event == "fault_injected":
                            on_probe_injection(ev)
                        elif ev.event == "tensors" and ev.rank is not None:
                            published = ev.fields.get("tensors")
                            if isinstance(published, dict):
                                addresses[ev.rank] = published
                    if ev.event == "step" and isinstance(ev.fields.get("step"), int):
                        max_step = max(max_step, ev.fields["step"])
                    elif (ev.event == "serving_ready" and server is not None and loadgen is None
                          and isinstance(ev.fields.get("url"), str)):
                        loadgen = LoadGenerator(ev.fields["url"], server.load, seed=seed,
                                                timeline=timeline)
                        loadgen.start()
                    elif ev.event == "hello" and isinstance(ev.fields.get("pid"), int):
                        role = ev.fields.get("role")
                        replica, shard = ev.fields.get("replica"), ev.fields.get("shard")
                        target.note_hello(
                            ev.fields["pid"], ev.rank, role if isinstance(role, str) else None,
                            replica if isinstance(replica, int) else None,
                            shard if isinstance(shard, int) else None,
                        )
                    if ev.source != "harness":
                        observer.event(ev)
                for item in schedule:
                    if item.fired:
                        continue
                    at = item.spec.at
                    if item.times:  # a repeat of an `every` fault
                        due = (item.next_step is not None and max_step >= item.next_step) or (
                            item.next_time is not None and now >= item.next_time)
                        if due and fire_safely(item, now):
                            reschedule(item, now)
                        continue
                    due = (
                        (at.step is not None and (in_process(item.spec) or max_step >= at.step))
                        or (at.time is not None and now - t0 >= at.time.total_seconds())
                        or (at.event is not None and seen.get(at.event, 0) >= at.count)
                        or (at.file is not None and item.index in watches
                            and len(watches[item.index].hits) >= at.count)
                    )
                    if due and fire_safely(item, now):
                        reschedule(item, now)
                for done in [a for a in active if a.heal_at is not None and now >= a.heal_at]:
                    active.remove(done)
                    heal(done)
                for gone in [w for w in watched if not w[0].alive()]:
                    # Seen only while the run goes on: the teardown's kills are not evidence.
                    watched.remove(gone)
                    observer.event(timeline.emit("target_exited", **gone[1]))
                exit_code = target.poll()
                if exit_code is not None:
                    ended = now
                    break
                if loadgen is not None and loadgen.done.is_set():
                    stats = fetch_json(loadgen.url, "/v1/stats")
                    observer.event(timeline.emit("serving_stats", source="client",
                                                 **_serving_stats(stats)))
                    load_served = True
                    ended = now
                    break
                if now - t0 > timeout_s:
                    timed_out = True
                    ended = now
                    observer.event(timeline.emit("timeout", after_s=round(now - t0, 3)))
                    break
                if watches:  # woken the moment a watched file changes, not at the next tick
                    select.select(list(watches.values()), [], [], POLL_S)
                else:
                    time.sleep(POLL_S)
    finally:
        errors: list[str] = []
        for leftover in list(active):
            try:
                heal(leftover)
            except Exception as exc:  # keep healing the rest
                errors.append(f"{leftover.applied.kind}: {exc}")
        for watch in watches.values():
            watch.close()
        if loadgen is not None:
            loadgen.stop()
        teardown = target.stop()
        # What was set up at launch goes once nothing of the system can still use it.
        for index, setup in prepared.items():
            try:
                faults.get(setup.kind).revert(setup.undo)
            except Exception as exc:  # left pending in the journal: heal tries again
                errors.append(f"{setup.kind}: {exc}")
            else:
                if setup.journal_id:
                    journal.done(setup.journal_id)
                timeline.emit("fault_healed", kind=setup.kind, fault=index)
        if load_served:
            # The server ran until its load was served; how it then shut down (SIGTERM,
            # exit 0 expected) is its exit code.
            exit_code = target.poll()
        observer.event(timeline.emit(
            "teardown", tracking=teardown.tracking, survivors=list(teardown.survivors),
            logs_open=list(teardown.logs_open), cgroup_removed=teardown.cgroup_removed))
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
        timeline.emit("run_end", exit_code=exit_code, timed_out=timed_out)
        timeline.close()
        if errors:
            raise HarnessError("could not revert: " + "; ".join(errors))
    for item in schedule:
        if not item.fired and not item.times:
            records.append(FaultRecord(item.spec.kind, item.spec.target.describe(), None, None,
                                       f"trigger {item.spec.at.describe()} not reached, or "
                                       "the target never appeared"))
    events = sorted(
        (Event.from_json(e) for e in _read_json_lines(run_dir / "events.jsonl")),
        key=lambda e: e.t,
    )
    # The run's own duration: the time teardown took (its grace period) is not the job's.
    outcome = Outcome(exit_code, timed_out, round((ended or time.monotonic()) - t0, 3))
    return Execution(events, outcome, records, run_dir)


def _storage_root(spec: Scenario, run_dir: Path, given: str | None) -> str:
    """The folder a storage fault's ``path`` is relative to."""
    if given:
        return given.replace("${run_dir}", str(run_dir))
    if isinstance(spec.system, TrainerSystem):
        return str(run_dir / "checkpoints")
    return str(run_dir)


def _serving_stats(stats: dict[str, object] | None) -> dict[str, Any]:
    """The server's own counters (``GET /v1/stats``), flattened for the timeline."""
    if stats is None:
        return {"available": False}
    flat: dict[str, Any] = {"available": True}
    engine = stats.get("engine")
    for source in (engine if isinstance(engine, dict) else {}, stats):
        for key, value in source.items():
            if isinstance(value, int | float | str | bool) and key not in flat:
                flat[key] = value
    return flat


def _read_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as handle:
        for line in handle:
            with contextlib.suppress(ValueError):
                data = json.loads(line)
                if isinstance(data, dict) and "t" in data and "event" in data:
                    yield data


# ----------------------------------------------------------------- fault-free baseline


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aftershock"


def _code_fingerprint(spec: Scenario, scenario_dir: Path) -> str:
    """The code a fault-free twin runs, by content, so that editing it invalidates the twin.

    For the reference systems, the source of reference_impl (found without importing it).
    For a command, every file named in the command line (its script, the interpreter, a
    ``--config=FILE``) and every declared ``inputs`` file (a module run with ``-m``, data)."""
    digest = hashlib.sha256()
    if isinstance(spec.system, CommandSystem):
        for path in _command_files(spec.system, scenario_dir):
            digest.update(str(path).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
        return digest.hexdigest()
    patterns = ["*.py"] if isinstance(spec.system, TrainerSystem) else ["*.py", "serving/*.py"]
    found = importlib.util.find_spec("reference_impl")
    for folder in found.submodule_search_locations or [] if found else []:
        for pattern in patterns:
            for path in sorted(Path(folder).glob(pattern)):
                digest.update(str(path.relative_to(folder)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _command_files(system: CommandSystem, scenario_dir: Path) -> list[Path]:
    """The files a command names that exist (relative ones from its working directory), and
    its declared inputs. Arguments naming the run's own folder change every run: skipped."""
    base = system.workdir(scenario_dir)
    files, _ = system.input_files(scenario_dir)
    named = set(files)
    for arg in system.command:
        if "${run_dir}" in arg:
            continue
        arg = arg.replace("${scenario_dir}", str(scenario_dir.resolve()))
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else None
        for candidate in (arg, value):
            if candidate and (base / candidate).is_file():
                named.add((base / candidate).resolve())
    return sorted(named)


def baseline_key(spec: Scenario, seed: int, *, scenario_dir: Path = Path(".")) -> str:
    """The cache key of a scenario's fault-free twin: what decides its result (the system
    without pacing, detection and what only recovery keeps: golden.twin_system), its
    environment, the seed and the code it runs (``scenario_dir``: where the scenario file
    is, from which a command's relative paths are found)."""
    system = golden.twin_system(spec)
    # The twin's environment: test hooks that break the system through it (AFTERSHOCK_INJECT_*)
    # are faults, which the twin goes without.
    system["env"] = dict(spec.without_faults().system.env)
    material = json.dumps({"system": system, "seed": seed,
                           "code": _code_fingerprint(spec, scenario_dir)}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def fault_free_result(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool,
    what: str,
) -> tuple[dict[str, Any] | None, str]:
    """What the fault-free twin produced (``what``: its final parameter ``digests`` or its
    requests' ``outputs``), from the cache or by running it."""
    spec = loaded.spec
    key = baseline_key(spec, seed, scenario_dir=loaded.path.parent)
    cached = cache_dir() / "fault_free" / f"{key}.json"
    if use_cache and cached.exists():
        with contextlib.suppress(ValueError, OSError, KeyError):
            data = json.loads(cached.read_text())
            return dict(data[what]), f"cached ({cached})"
    twin = spec.without_faults()
    if isinstance(twin.system, TrainerSystem | ServerSystem):
        # Pacing never changes the math; the golden run goes at full speed.
        fast = twin.system.model_copy(update={"step_sleep": timedelta(0)})
        twin = twin.model_copy(update={"system": fast})
    execution = execute(
        twin, scenario_dir=loaded.path.parent, run_dir=run_dir, seed=seed,
        observer=observer, phase="fault-free baseline",
    )
    found: dict[str, Any]
    if what == "outputs":
        found = {rid: out.to_json() for rid, out in _metrics.outputs(execution.events).items()}
        complete = _metrics.serving(execution.events)["lost_requests"] == 0
    else:
        found = {str(k): v for k, v in _metrics.final_digests(execution.events).items()}
        complete = True
    if execution.outcome.exit_code != 0 or not found or not complete:
        return None, (f"fault-free run failed (exit {execution.outcome.exit_code}"
                      f"{'' if complete else ', requests lost'}); see {run_dir}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps({what: found, "seed": seed, "scenario": spec.name}))
    os.replace(tmp, cached)
    return found, f"ran ({run_dir})"


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
    independent oracle (harness.oracle): from the model's math alone, not by the trainer.

    The reference trainer writes every generation's first step and live replicas to
    ``output/membership.jsonl``. Replaying that log with the trainer's own code would repeat
    any bug of that code (a wrong gradient average passes itself), so the oracle restates the
    math instead. A layout it cannot reproduce bitwise is "not observed", never a pass."""
    from harness import oracle

    spec = loaded.spec
    assert isinstance(spec.system, TrainerSystem)
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
    return (
        spec.system.world.size if isinstance(spec.system, TrainerSystem)
        else spec.system.world if isinstance(spec.system, CommandSystem)
        else spec.system.workers
    )


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
    checks = evaluate(
        spec.expect, outcome=outcome, metrics=metrics, faults=faults,
        digests=_metrics.final_digests(events), baseline=baseline,
        events=events, outputs=_metrics.outputs(events),
        baseline_outputs=baseline_outputs, world=world,
    )
    missing = {"params_match": spec.expect.params_match and baseline is None,
               "outputs_match": spec.expect.outputs_match and baseline_outputs is None}
    checks = [
        CheckResult(c.name, False, c.observed, c.expected, f"{c.message} ({baseline_note})")
        if missing.get(c.name) else c
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
    """Run one scenario and write its record (``result.json``), whatever happens.

    An interrupted run raises RunInterrupted and a harness failure RunFailed, each
    carrying the run's record (marked as such) after the teardown healed everything;
    an unexpected exception's traceback is kept in the run folder (``harness_error.txt``).
    """
    spec = loaded.spec
    seed = spec.seed if seed is None else seed
    observer = observer or NullObserver()
    run_dir = (run_dir or default_run_dir(spec.name)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.yaml").write_text(loaded.text)
    started = time.monotonic()

    def unfinished(error: str, *, interrupted: bool = False) -> RunResult:
        result = _unfinished(loaded, seed=seed, run_dir=run_dir, started=started, error=error,
                             interrupted=interrupted)
        with contextlib.suppress(Exception):  # the record matters more than its rendering
            observer.finished(result)
        return result

    try:
        with _sigterm_unwinds():
            preflight(loaded)
            # What a crashed earlier run left behind goes first; the user hears what was
            # refused.
            for item in heal_orphans():
                observer.phase(spec.name, "heal", item.describe())
            result = _checked_run(loaded, seed=seed, run_dir=run_dir, observer=observer,
                                  use_cache=use_cache, started=started)
    except KeyboardInterrupt as exc:
        sigterm = isinstance(exc, Interrupted)
        result = unfinished(
            f"interrupted by {'SIGTERM' if sigterm else 'SIGINT'} after "
            f"{time.monotonic() - started:.1f}s; no check was evaluated", interrupted=True)
        raise RunInterrupted(result, 143 if sigterm else 130) from None
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
    observer.finished(result)
    return result


def _unfinished(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, started: float, error: str,
    interrupted: bool,
) -> RunResult:
    """The record of a run that did not get to its checks: what its timeline shows so far,
    no verdict (``passed`` is false, ``error`` says why)."""
    metrics: dict[str, float | int | None] = {}
    with contextlib.suppress(Exception):  # a timeline cut short may be too thin to measure
        path = run_dir / "events.jsonl"
        events = sorted((Event.from_json(e) for e in _read_json_lines(path)), key=lambda e: e.t)
        metrics = _metrics.compute(events, _world(loaded.spec))
    result = RunResult(
        name=loaded.spec.name, file=str(loaded.path), passed=False, seed=seed,
        duration_s=round(time.monotonic() - started, 3), checks=(), metrics=metrics, faults=(),
        run_dir=str(run_dir), error=error, interrupted=interrupted,
    )
    with contextlib.suppress(OSError):
        (run_dir / "result.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _checked_run(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool,
    started: float,
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
    )
    (run_dir / "result.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result
