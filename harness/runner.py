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
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import faults
from faults._proc import ProcessRef
from faults.heal import heal_orphans, start_reaper
from faults.journal import Journal
from harness import metrics as _metrics
from harness.checks import Outcome, evaluate
from harness.errors import HarnessError
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
    journal = Journal.create(run_id)
    reaper = start_reaper(journal.path)
    launch_entry = journal.intend(
        "launch", {"env": "AFTERSHOCK_RUN_ID", "value": run_id}, op="launch"
    )
    target = LocalTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)
    schedule = [_ScheduledFault(i, f) for i, f in enumerate(spec.faults)]
    active: list[_Active] = []
    records: list[FaultRecord] = []
    armed: dict[int, list[int]] = {}  # fault index -> record indices, in-process faults
    seen: dict[str, int] = {}  # event name -> occurrences, for `at: {event}` triggers
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
        params = _params(item.spec)
        if str(item.spec.kind).startswith("storage."):
            params["root"] = storage_root(params.get("root"))
        for rank in chosen:
            if "address_of" in params:
                params = {**params, "address": address_of(rank, params)}
                params.pop("address_of")
                params.pop("index", None)
            # The fault's moment is when applying it began: `ss -K` or a tmpfs copy take
            # long enough that the system can notice before inject() returns.
            began = time.monotonic()
            applied = kind.inject(ranks[rank], params, journal)
            fields: dict[str, Any] = {"rank": rank} if label is None else {"role": label}
            ev = timeline.emit(
                "fault_injected", kind=item.spec.kind, pid=ranks[rank].pid,
                detail=applied.detail, fault=item.index, at=began, params=params, **fields,
            )
            observer.event(ev)
            records.append(
                FaultRecord(item.spec.kind, label or f"rank {rank}", round(ev.t - t0, 4), None,
                            applied.detail)
            )
            if applied.journal_id is not None:
                # Counted from the injection, not from the loop's tick: finding the target
                # can take a while on a loaded machine.
                heal_at = (time.monotonic() + duration.total_seconds()
                           if duration is not None else None)
                active.append(_Active(applied, len(records) - 1, heal_at))
        return True

    def fire_safely(item: _ScheduledFault, now: float) -> bool:
        """A fault that cannot be applied is a record on the timeline, not a crash:
        the run goes on and `faults_injected` fails with the reason."""
        try:
            return fire(item, now)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            observer.event(timeline.emit("fault_failed", kind=item.spec.kind,
                                         fault=item.index, error=reason))
            records.append(FaultRecord(item.spec.kind, item.spec.target.describe(), None, None,
                                       f"could not be applied: {reason}"))
            item.fired = True
            item.times = max(item.times, 1)
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
        if given:
            return given.replace("${run_dir}", str(run_dir))
        if isinstance(spec.system, TrainerSystem):
            return str(run_dir / "checkpoints")
        return str(run_dir)

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
    try:
        with _sigterm_unwinds():
            observer.phase(spec.name, phase, " ".join(launch.argv[:6]))
            target.start()
            observer.event(timeline.emit("launch", argv=launch.argv, phase=phase, seed=seed))
            while True:
                now = time.monotonic()
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
                    )
                    if due and fire_safely(item, now):
                        reschedule(item, now)
                for done in [a for a in active if a.heal_at is not None and now >= a.heal_at]:
                    active.remove(done)
                    heal(done)
                exit_code = target.poll()
                if exit_code is not None:
                    break
                if loadgen is not None and loadgen.done.is_set():
                    stats = fetch_json(loadgen.url, "/v1/stats")
                    observer.event(timeline.emit("serving_stats", source="client",
                                                 **_serving_stats(stats)))
                    load_served = True
                    break
                if now - t0 > timeout_s:
                    timed_out = True
                    observer.event(timeline.emit("timeout", after_s=round(now - t0, 3)))
                    break
                time.sleep(POLL_S)
    finally:
        errors: list[str] = []
        for leftover in list(active):
            try:
                heal(leftover)
            except Exception as exc:  # keep healing the rest
                errors.append(f"{leftover.applied.kind}: {exc}")
        if loadgen is not None:
            loadgen.stop()
        target.stop()
        if load_served:
            # The server ran until its load was served; how it then shut down (SIGTERM,
            # exit 0 expected) is its exit code.
            exit_code = target.poll()
        journal.done(launch_entry)
        journal.close()
        with contextlib.suppress(Exception):
            reaper.kill()
            reaper.wait(timeout=2)
        # Events written while the target was being stopped still belong to the run.
        for ev in timeline.poll():
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
    outcome = Outcome(exit_code, timed_out, round(time.monotonic() - t0, 3))
    return Execution(events, outcome, records, run_dir)


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


def _code_fingerprint(spec: Scenario) -> str:
    """For the reference systems, the source of reference_impl is part of the key, so
    editing the trainer invalidates its golden run. Found without importing it."""
    if not isinstance(spec.system, TrainerSystem | ServerSystem):
        return ""
    patterns = ["*.py"] if isinstance(spec.system, TrainerSystem) else ["*.py", "serving/*.py"]
    found = importlib.util.find_spec("reference_impl")
    digest = hashlib.sha256()
    for folder in found.submodule_search_locations or [] if found else []:
        for pattern in patterns:
            for path in sorted(Path(folder).glob(pattern)):
                digest.update(str(path.relative_to(folder)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def baseline_key(spec: Scenario, seed: int) -> str:
    # The twin's system: test hooks that break the system through the environment
    # (AFTERSHOCK_INJECT_*) are faults, which the twin goes without.
    system = spec.without_faults().system.model_dump(mode="json")
    if isinstance(spec.system, TrainerSystem):
        # Pacing, failure detection and what is kept for recovery (checkpoints, snapshots,
        # idle spares) change timing, never a fault-free run's math: one golden run serves
        # them all. The recovery strategy stays in: it is a different runtime.
        for name in ("step_sleep", "timeout", "collective_timeout", "max_restarts",
                     "checkpoint_every", "spares", "snapshot_every"):
            system.pop(name, None)
    elif isinstance(spec.system, ServerSystem):
        # Timing, detection and the recovery policy never change a fault-free run's tokens;
        # the model, the kernels and the load do.
        for name in ("step_sleep", "timeout", "heartbeat", "dead_after", "wedged_after",
                     "recovery", "journal", "checksums"):
            system.pop(name, None)
        for name in ("retries", "request_timeout"):  # how long clients insist, not what
            system["load"].pop(name, None)
    material = json.dumps({"system": system, "seed": seed, "code": _code_fingerprint(spec)},
                          sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def _fault_free(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool,
    what: str,
) -> tuple[dict[str, Any] | None, str]:
    """What the fault-free twin produced (``what``: its final parameter ``digests`` or its
    requests' ``outputs``), from the cache or by running it."""
    spec = loaded.spec
    key = baseline_key(spec, seed)
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
    found, note = _fault_free(loaded, seed=seed, run_dir=run_dir, observer=observer,
                              use_cache=use_cache, what="digests")
    return (None if found is None else {int(k): str(v) for k, v in found.items()}), note


def fault_free_outputs(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, observer: Observer, use_cache: bool
) -> tuple[dict[str, _metrics.Output] | None, str]:
    """Each request's tokens and logits digests in the fault-free twin (same load, seed)."""
    found, note = _fault_free(loaded, seed=seed, run_dir=run_dir, observer=observer,
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
    """Digests of a deterministic replay of the membership the faulted run recorded.

    The reference trainer writes every generation's first step and live replicas to
    ``output/membership.jsonl``; ``--replay`` recomputes that trajectory without
    faults. Equal digests mean the recovery applied exactly the math it claims."""
    log = run_dir / "output" / "membership.jsonl"
    if not log.exists():
        return None, f"the run recorded no membership log ({log})"
    twin = loaded.spec.without_faults()
    assert isinstance(twin.system, TrainerSystem)
    twin = twin.model_copy(
        update={"system": twin.system.model_copy(update={"step_sleep": timedelta(0)})}
    )
    replay_dir = run_dir / "replay"
    execution = execute(twin, scenario_dir=loaded.path.parent, run_dir=replay_dir, seed=seed,
                        observer=observer, phase="membership replay",
                        extra_args=(f"--replay={log}",))
    digests = _metrics.final_digests(execution.events)
    if execution.outcome.exit_code != 0 or not digests:
        return None, f"the replay failed (exit {execution.outcome.exit_code}); see {replay_dir}"
    return digests, f"replayed ({replay_dir})"


# ------------------------------------------------------------------------ scenario run


def default_run_dir(name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(".aftershock") / "runs" / f"{stamp}-{name}-{uuid.uuid4().hex[:6]}"


def run_scenario(
    loaded: LoadedScenario,
    *,
    run_dir: Path | None = None,
    seed: int | None = None,
    observer: Observer | None = None,
    use_cache: bool = True,
) -> RunResult:
    spec = loaded.spec
    seed = spec.seed if seed is None else seed
    observer = observer or NullObserver()
    run_dir = (run_dir or default_run_dir(spec.name)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.yaml").write_text(loaded.text)
    started = time.monotonic()
    heal_orphans()  # what a crashed earlier run left behind goes first

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
    world = (
        spec.system.world.size if isinstance(spec.system, TrainerSystem)
        else spec.system.world if isinstance(spec.system, CommandSystem)
        else spec.system.workers
    )
    metrics = _metrics.compute(execution.events, world)
    checks = evaluate(
        spec.expect, outcome=execution.outcome, metrics=metrics, faults=execution.faults,
        digests=_metrics.final_digests(execution.events), baseline=baseline,
        events=execution.events, outputs=_metrics.outputs(execution.events),
        baseline_outputs=baseline_outputs,
    )
    missing = {"params_match": spec.expect.params_match and baseline is None,
               "outputs_match": spec.expect.outputs_match and baseline_outputs is None}
    checks = [
        CheckResult(c.name, False, c.observed, c.expected, f"{c.message} ({baseline_note})")
        if missing.get(c.name) else c
        for c in checks
    ]
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
    observer.finished(result)
    return result
