"""Apply a scenario's faults to a running target, keep their records, undo them.

The run loop (harness/run/runner.py) decides *when* (harness/run/schedule.py); the injector does
the rest for one fault at a time: find the processes its target names, set up what its
kind needs before launch (``prepare``), apply it (or arm it in the target's probe), write
what happened to the timeline and to the fault's record, and heal it when its duration
is over or the run ends. A fault that cannot be applied is a record, never a crash.
"""

from __future__ import annotations

import random
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aftershock import faults
from aftershock.faults import ProcessRef, contract, parent_pid, storage
from aftershock.faults import process_command_line as command_line
from aftershock.faults.journal import Journal
from aftershock.harness.run.records import Event, FaultRecord
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.run.triggers import describe_file_state
from aftershock.harness.scenario._duration import format_duration
from aftershock.harness.scenario.spec import HealWhen, in_process

if TYPE_CHECKING:
    from aftershock.harness.run.runner import Observer
    from aftershock.harness.run.target import Target


def acts_on_files(spec: Any) -> bool:
    """A fault whose kind names files relative to a ``root`` (faults/params.py): the harness
    passes that folder, resolved."""
    return "root" in type(spec).model_fields


def fault_params(spec: Any) -> dict[str, Any]:
    """A fault's own parameters as its kind takes them: JSON values, durations in seconds."""
    exclude = {"kind", "target", "at"}
    if isinstance(getattr(spec, "duration", None), HealWhen):
        exclude.add("duration")  # the harness heals it: to the kind, held until the end
    data = spec.model_dump(exclude=exclude, exclude_none=True)
    return {k: (v.total_seconds() if hasattr(v, "total_seconds") else v) for k, v in data.items()}






@dataclass(slots=True)
class _Active:
    """An applied fault that has something to undo."""

    applied: faults.Applied
    record_index: int
    heal_at: float | None
    duration: timedelta | HealWhen | None = None  # in-process: counted from the probe's report
    fault: int | None = None
    # `duration: {until}`: the fault's moment (events before it do not count), how many of
    # the awaited events came since, and the time of the one that ended the fault.
    since: float | None = None
    seen: int = 0
    seen_at: float | None = None


@dataclass(frozen=True, slots=True)
class _Chosen:
    """The processes a fault hits: ``ranks`` by index, the ones ``chosen``, and a label
    when they were picked by role rather than rank."""

    ranks: dict[int, ProcessRef]
    chosen: list[int]
    label: str | None


#: How long a kill's targets may take to stop (SIGSTOP) before the look at its file: a
#: process inside a write stops when the write returns.
STOP_WAIT_S = 2.0


def _stop_for_the_look(refs: Sequence[ProcessRef]) -> list[ProcessRef]:
    """SIGSTOP ``refs`` and wait (STOP_WAIT_S at most) until each is stopped: from then on
    none writes, so what the harness reads of a file is what the kill that follows finds.
    The ones signalled (the caller continues them: a process the kill missed runs on)."""
    sent = [ref for ref in refs if ref.signal(signal.SIGSTOP)]
    deadline = time.monotonic() + STOP_WAIT_S
    while any(ref.alive() and not ref.stopped() for ref in sent) and (
            time.monotonic() < deadline):
        time.sleep(0.001)
    return sent


def _injected_fields(ranks: Mapping[int, ProcessRef], group: list[int], label: str | None,
                     file: str | None, state: dict[str, Any] | None) -> dict[str, Any]:
    """The ``fault_injected`` event's fields naming what was hit: a role, a rank or ranks,
    and the file with its state at the fault's moment."""
    fields: dict[str, Any] = {"pid": ranks[group[0]].pid}
    if label is not None:
        fields["role"] = label
    elif len(group) == 1:
        fields["rank"] = group[0]
    else:
        fields.update(ranks=group, pids=[ranks[r].pid for r in group])
    if file is not None:
        fields["file"] = file
    if state is not None:
        fields.update(state)
    return fields


class Injector:
    """Applies, records and heals the faults of one run.

    ``root_of(fault)``: the folder a fault's files are relative to (its ``root``, else the
    system's default). ``t0``: the run's start, which records count from.
    """

    def __init__(
        self, faults_: Sequence[Any], *, target: Target, journal: Journal, timeline: Timeline,
        observer: Observer, seed: int, t0: float, root_of: Callable[[Any], str],
        log_dir: Path, guarded: Sequence[str] = (), read_writers: bool = True,
    ) -> None:
        self._faults = list(faults_)
        # Whether a file-triggered fault first asks which of the run's processes hold its
        # file open for writing (`faults_landed` needs it): a scan of their descriptors,
        # which on a loaded machine can take long enough for a save to finish first.
        self._read_writers = read_writers
        self._target = target
        self._journal = journal
        self._timeline = timeline
        self._observer = observer
        self._rng = random.Random(seed)
        self._t0 = t0
        self._root_of = root_of
        self._log_dir = log_dir
        self._guarded = list(guarded)  # the harness's own records: no file fault touches them
        self.records: list[FaultRecord] = []
        self._active: list[_Active] = []
        # The processes faults hit from outside, until the harness sees them end: what a
        # process did after a fault (exited, or went on) is evidence for checks (xid_action).
        self._watched: list[tuple[ProcessRef, dict[str, Any]]] = []
        self._armed: dict[int, list[int]] = {}  # fault index -> record indices (in-process)
        self._prepared: dict[int, faults.Applied] = {}  # fault index -> its launch-time setup
        self._published: dict[int, dict[str, list[int]]] = {}  # rank -> parameter addresses

    # ------------------------------------------------------------------ before launch

    def prepare(self) -> list[int]:
        """What the faults need in place before the system writes a byte (a filesystem under
        its checkpoint folder); the faults that could not be prepared (recorded as failed)."""
        failed: list[int] = []
        for index, spec in enumerate(self._faults):
            kind = faults.get(spec.kind)
            if not isinstance(kind, faults.PreparedKind):
                continue
            params = self._params(index)
            params["log"] = str(self._log_dir / f"fault{index}-{spec.kind}.log")
            try:
                applied = kind.prepare(params, self._journal)
            except Exception as exc:
                self.failed(index, exc)
                failed.append(index)
                continue
            self._prepared[index] = applied
            self._observer.event(self._timeline.emit("fault_prepared", kind=spec.kind,
                                                     fault=index, detail=applied.detail))
        return failed

    def sync_history(self, path: Path) -> dict[str, Any] | None:
        """When each fsync of the file at ``path`` returned and the size it made durable,
        where a prepared lazy filesystem (``storage.lose_unsynced``) has it; else None."""
        for applied in self._prepared.values():
            found = storage.sync_history(applied, path)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ while running

    def apply(self, index: int, *, arm_step: int | None = None, file: str | None = None,
              landing: Mapping[str, Any] | None = None) -> bool:
        """Apply fault ``index`` now if its target is there (True); False: not yet. Raises
        what applying it raised (see :meth:`failed`). ``arm_step``: the step an in-process
        fault is armed for; ``file``: the path that triggered it (`at: {file}`);
        ``landing``: whether the trigger holds the job in its open (harness/run/triggers.py)."""
        chosen = self._choose(self._faults[index].target)
        if chosen is None:
            return False
        if in_process(self._faults[index]):
            self._arm(index, chosen, arm_step)
        else:
            self._inject(index, chosen, file, landing)
        return True

    def failed(self, index: int, exc: BaseException) -> None:
        """A fault that cannot be applied is a record on the timeline, not a crash: the run
        goes on and `faults_injected` fails with the reason."""
        spec = self._faults[index]
        reason = f"{type(exc).__name__}: {exc}"
        self._observer.event(self._timeline.emit("fault_failed", kind=spec.kind,
                                                 fault=index, error=reason))
        self.records.append(FaultRecord(spec.kind, spec.target.describe(), None, None,
                                        f"could not be applied: {reason}", index))

    def unreached(self, index: int, repetition: tuple[int, int] | None = None, *,
                  awaited: int = 0) -> None:
        """Fault ``index`` never fired; ``repetition`` (k, of n): its k-th repetition;
        ``awaited``: how often the event its ``at: {after}`` waits for was seen."""
        spec = self._faults[index]
        after = getattr(spec.at, "after", None)
        if repetition is not None:
            k, n = repetition
            detail = f"repetition {k} of {n} never came: the run ended first"
        elif after is not None and awaited < after.count:
            detail = (f"trigger {spec.at.describe()} not reached: the system reported "
                      f"{after.describe()} {awaited} of {after.count} time(s), so the state "
                      "the fault is meant for was never observed")
        else:
            detail = (f"trigger {spec.at.describe()} not reached, or the target never "
                      "appeared")
        self.records.append(FaultRecord(spec.kind, spec.target.describe(), None, None,
                                        detail, index))

    def observe(self, event: Event) -> None:
        """What the system's own events mean for the faults: the probe applied an armed
        fault (its moment on the timeline), or a rank published its parameters' addresses."""
        if event.source == "harness":
            return
        self._await_until(event)
        if event.event == contract.FAULT_INJECTED:
            self._probe_applied(event)
        elif event.event == contract.TENSORS and event.rank is not None:
            published = event.fields.get("tensors")
            if isinstance(published, dict):
                self._published[event.rank] = published

    def in_scenario_order(self) -> list[FaultRecord]:
        """The records in the order of the scenario's faults (repetitions of one fault in the
        order they were applied), not in the order the faults found their targets: a rank
        that appeared between two lookups lets fault 1 be applied a poll before fault 0."""
        return sorted(self.records, key=lambda r: -1 if r.fault is None else r.fault)

    def heal_due(self, now: float) -> None:
        """Heal every fault whose duration is over, or whose awaited event came."""
        for done in [a for a in self._active if a.seen_at is not None
                     or (a.heal_at is not None and now >= a.heal_at)]:
            self._active.remove(done)
            self._heal(done)

    def note_exits(self) -> None:
        """A process a fault hit has ended: evidence of what it did after the fault. Seen only
        while the run goes on: the teardown's kills are not evidence."""
        for gone in [w for w in self._watched if not w[0].alive()]:
            self._watched.remove(gone)
            self._observer.event(self._timeline.emit("target_exited", **gone[1]))

    # ------------------------------------------------------------------ teardown

    def heal_all(self) -> list[str]:
        """Heal every fault still applied; what could not be reverted."""
        errors: list[str] = []
        for leftover in list(self._active):
            self._active.remove(leftover)
            try:
                self._heal(leftover)
            except Exception as exc:  # keep healing the rest
                errors.append(f"{leftover.applied.kind}: {exc}")
        return errors

    def unprepare(self) -> list[str]:
        """Undo what was set up at launch, once nothing of the system can still use it; what
        could not be (left pending in the journal: a heal tries again)."""
        errors: list[str] = []
        for index, setup in self._prepared.items():
            try:
                faults.get(setup.kind).revert(setup.undo)
            except Exception as exc:
                errors.append(f"{setup.kind}: {exc}")
            else:
                if setup.journal_id:
                    self._journal.done(setup.journal_id)
                self._timeline.emit("fault_healed", kind=setup.kind, fault=index)
        return errors

    # ------------------------------------------------------------------ the parts

    def _choose(self, selector: Any) -> _Chosen | None:
        """The processes ``selector`` (a scenario's ``target``) names now; None while there
        are none (the fault stays due)."""
        target = self._target
        if selector.filters:
            return self._choose_processes(selector)
        if selector.role is not None:
            found = target.role_processes(selector.role)
            if not found:
                return None
            return _Chosen(dict(enumerate(found)), [0], f"role {selector.role}")
        if selector.node is not None:
            found = target.node_processes(selector.node)
            if not found:
                return None
            return _Chosen(dict(enumerate(found)), [0], f"node {selector.node}")
        ranks = target.rank_processes()
        if selector.index is not None:
            self._refuse_ambiguous(selector.index)
        if not ranks:
            return None
        return self._choose_ranks(selector, ranks)

    def _refuse_ambiguous(self, index: int) -> None:
        """Raise where several processes claim rank ``index``."""
        claims: dict[int, list[int]] = getattr(self._target, "ambiguous_ranks", dict)()
        claimed = claims.get(index)
        if claimed:
            # torchft's replica groups each have RANK=0: "rank 0" is whichever had the lower
            # pid, which no scenario means.
            raise ValueError(
                f"{len(claimed)} processes say RANK={index} (pids "
                f"{', '.join(map(str, claimed))}): `rank` cannot tell them apart; name "
                "the one meant by another coordinate (`env: {REPLICA_GROUP_ID: '1'}`, "
                "`cmdline`, `role: worker`), or have the job announce its rank "
                "(a log probe with `event: hello`, docs/own-job.md)")

    def _choose_ranks(self, selector: Any, ranks: dict[int, ProcessRef]) -> _Chosen | None:
        """The ranks ``selector`` names among those running; None if none is."""
        target = self._target
        if selector.index is not None:
            if selector.index not in ranks:
                return None
            chosen = [selector.index]
        elif selector.replica is not None or selector.shard is not None:
            chosen = sorted(
                r for r, (replica, shard) in target.coordinates.items()
                if r in ranks
                and selector.replica in (None, replica) and selector.shard in (None, shard)
            )
            if not chosen:
                return None
        elif selector.pick == "all":
            chosen = sorted(ranks)
        else:
            chosen = [self._rng.choice(sorted(ranks))]
        return _Chosen(ranks, chosen, None)

    def _choose_processes(self, selector: Any) -> _Chosen | None:
        """The live processes an ``env``/``cmdline``/``role: agent|worker`` target names:
        of a process and its descendants that all match, the topmost; all of them, or one
        seeded pick."""
        target = self._target
        pool = (target.role_processes(selector.role) if selector.role is not None
                else target.processes())
        pattern = re.compile(selector.cmdline) if selector.cmdline is not None else None
        found = []
        for ref in pool:
            if selector.env is not None:
                environ = faults.process_environ(ref.pid)
                if any(environ.get(k) != v for k, v in selector.env.items()):
                    continue
            if pattern is not None and not pattern.search(command_line(ref.pid)):
                continue
            found.append(ref)
        pids = {ref.pid for ref in found}
        found = sorted((ref for ref in found if parent_pid(ref.pid) not in pids),
                       key=lambda ref: ref.pid)
        if not found:
            return None
        chosen = list(range(len(found)))
        if selector.pick == "random":
            chosen = [self._rng.choice(chosen)]
        return _Chosen(dict(enumerate(found)), chosen, selector.describe())

    def _params(self, index: int) -> dict[str, Any]:
        spec = self._faults[index]
        params = fault_params(spec)
        if acts_on_files(spec):
            params["root"] = self._root_of(spec)
            params["guarded"] = self._guarded
        if index in self._prepared:
            params["prepared"] = dict(self._prepared[index].undo)
        return params

    def _arm(self, index: int, found: _Chosen, arm_step: int | None) -> None:
        """The probe applies it at the exact step/phase/call and reports the moment; the rank
        filter travels in the command (a spare may take the rank over)."""
        spec = self._faults[index]
        kind = faults.get(spec.kind)
        rank = found.chosen[0] if len(found.chosen) == 1 and found.label is None else None
        params = {**fault_params(spec), "at_step": arm_step, "phase": spec.at.phase,
                  "fault": index, "rank": rank}
        applied = kind.inject(found.ranks[found.chosen[0]], params, self._journal)
        self._observer.event(self._timeline.emit("fault_armed", kind=spec.kind, fault=index,
                                                 detail=applied.detail, rank=rank))
        where = found.label or (f"rank {rank}" if rank is not None else "all")
        self.records.append(FaultRecord(spec.kind, where, None, None, applied.detail, index))
        if applied.journal_id is not None:
            self._active.append(_Active(applied, len(self.records) - 1, None,
                                        getattr(spec, "duration", None), index))
        self._armed.setdefault(index, []).append(len(self.records) - 1)

    def _inject(self, index: int, found: _Chosen, file: str | None,
                landing: Mapping[str, Any] | None = None) -> None:
        spec = self._faults[index]
        kind = faults.get(spec.kind)
        duration: timedelta | HealWhen | None = getattr(spec, "duration", None)
        params = self._params(index)
        # A kind that hits its targets together gets them in one call (a power loss takes
        # every process down at one instant); any other kind one target at a time.
        together = isinstance(kind, faults.GroupKind)
        ranks, label = found.ranks, found.label
        for group in ([found.chosen] if together else [[rank] for rank in found.chosen]):
            rank = group[0]
            resolve = faults.hooks(kind).resolve
            if resolve is not None and label is None:
                try:
                    params = resolve(params, self._published.get(rank, {}))
                except ValueError as exc:
                    raise ValueError(f"rank {rank} {exc}") from None
            applied, state, began = self._look_and_apply(
                index, [ranks[r] for r in group], params, file, landing, together=together)
            fields = _injected_fields(ranks, group, label, file, state)
            ev = self._timeline.emit(
                contract.FAULT_INJECTED, kind=spec.kind, detail=applied.detail, fault=index,
                at=began, params=params, applied_at=time.monotonic(), **fields,
            )
            self._observer.event(ev)
            for r in group:
                extra = {"role": label} if label is not None else {"rank": r}
                self._watched.append((ranks[r], {"pid": ranks[r].pid, "kind": spec.kind,
                                                 "fault": index, **extra}))
            self._note_applied(index, applied, ev, group, label, file, state, duration)

    def _look_and_apply(self, index: int, refs: list[ProcessRef], params: dict[str, Any],
                        file: str | None, landing: Mapping[str, Any] | None, *, together: bool
                        ) -> tuple[faults.Applied, dict[str, Any] | None, float]:
        """Apply fault ``index`` to ``refs`` (together, or the one), with what its trigger's
        file was at that moment, and when applying began."""
        spec = self._faults[index]
        kind = faults.get(spec.kind)
        # What the file was at the fault's moment, read just before it is sent: a kill
        # closes the writer's descriptors, so afterwards nothing would say it was open.
        # A kill's targets are stopped first, so the file cannot change (nor its save end)
        # between that look and the kill however long a loaded machine makes it.
        stopped = (_stop_for_the_look(refs)
                   if file is not None and spec.kind == "process.kill" else [])
        try:
            state = self._file_state(index, file) if file is not None else None
            if state is not None and landing:
                state.update(landing)
            # The fault's moment is when applying it began: `ss -K` or a tmpfs copy take
            # long enough that the system can notice before inject() returns.
            began = time.monotonic()
            if together:
                assert isinstance(kind, faults.GroupKind)
                applied = kind.inject_group(refs, params, self._journal)
            else:
                applied = kind.inject(refs[0], params, self._journal)
        finally:
            for ref in stopped:  # killed: gone; not applied: running again
                ref.signal(signal.SIGCONT)
        if state is not None and stopped:
            state["file_looked_stopped"] = True
        return applied, state, began

    def _note_applied(self, index: int, applied: faults.Applied, ev: Event, group: list[int],
                      label: str | None, file: str | None, state: dict[str, Any] | None,
                      duration: timedelta | HealWhen | None) -> None:
        """Record an applied fault for the report, and for its heal if it has one."""
        where = label or ("rank " if len(group) == 1 else "ranks ") + ", ".join(
            str(r) for r in group)
        detail = applied.detail
        if state is not None:
            detail += f"; {describe_file_state(str(file), state)}"
        self.records.append(FaultRecord(self._faults[index].kind, where,
                                        round(ev.t - self._t0, 4), None, detail, index))
        if applied.journal_id is not None:
            # Counted from the injection, not from the loop's tick: finding the target can
            # take a while on a loaded machine.
            held = duration.max if isinstance(duration, HealWhen) else duration
            heal_at = (time.monotonic() + held.total_seconds() if held is not None else None)
            since = float(ev.fields.get("at", ev.t)) if isinstance(duration, HealWhen) else None
            self._active.append(_Active(applied, len(self.records) - 1, heal_at, duration,
                                        since=since))

    def _file_state(self, index: int, file: str) -> dict[str, Any]:
        """The file a trigger named, now: its size (None: gone) and, where the scenario
        expects `faults_landed`, which of the run's processes hold it open for writing (only
        the run's: the scan stays bounded); otherwise ``file_open`` is None (not read)."""
        path = Path(self._root_of(self._faults[index])) / file
        try:
            size: int | None = path.stat().st_size
        except OSError:
            size = None
        if not self._read_writers:
            return {"file_size": size, "file_open": None}
        held = faults.file_writers([ref.pid for ref in self._target.processes()], path)
        # Open, or not: unknown (None) when a process that might hold it could not be read.
        is_open = True if held.writers else None if held.unreadable else False
        state: dict[str, Any] = {"file_size": size, "file_open": is_open,
                                 "file_writers": list(held.writers)}
        if held.unreadable:
            state["file_unreadable"] = list(held.unreadable)
        return state

    def _probe_applied(self, ev: Event) -> None:
        """The probe applied an armed fault: that is the fault's moment on the timeline."""
        index = ev.fields.get("fault")
        if not isinstance(index, int) or index not in self._armed:
            return
        # Repetitions of one fault share its index: the earliest still waiting fired.
        waiting = [i for i in self._armed[index] if self.records[i].injected_at_s is None]
        if not waiting:
            return
        record_index = waiting[0]
        old = self.records[record_index]
        detail = str(ev.fields.get("detail") or ev.fields.get("tensor") or old.detail)
        where = f"rank {ev.rank}" if ev.rank is not None else old.target
        self.records[record_index] = FaultRecord(old.kind, where, round(ev.t - self._t0, 4),
                                                 None, detail, old.fault)
        for item in self._active:
            if item.fault == index and item.heal_at is None and item.duration is not None:
                held = item.duration
                if isinstance(held, HealWhen):
                    item.since, held = ev.t, held.max
                item.heal_at = time.monotonic() + held.total_seconds()

    def _heal(self, item: _Active) -> None:
        """Undo one fault. One whose undo raised is not healed: its journal entry stays
        pending (``aftershock heal`` reports it) and the timeline does not say healed."""
        # Dated when the heal began, as an injection is: a thawed process runs before revert
        # returns (an engine's unpause returns after the node runs again), and nothing the
        # heal caused may come before it on the timeline.
        began = time.monotonic()
        faults.get(item.applied.kind).revert(item.applied.undo)
        if item.applied.journal_id:
            self._journal.done(item.applied.journal_id)
        fields, note = self._until_outcome(item)
        ev = self._timeline.emit("fault_healed", at=began, kind=item.applied.kind, **fields)
        self._observer.event(ev)
        old = self.records[item.record_index]
        self.records[item.record_index] = FaultRecord(
            old.kind, old.target, old.injected_at_s, round(ev.t - self._t0, 4),
            old.detail + note, old.fault,
        )

    def _await_until(self, event: Event) -> None:
        """Count ``event`` for each applied fault held until such an event."""
        for item in self._active:
            until = item.duration.until if isinstance(item.duration, HealWhen) else None
            if until is None or item.since is None or item.seen_at is not None:
                continue
            if event.event != until.event or event.t < item.since or (
                    until.rank is not None and event.rank != until.rank):
                continue
            item.seen += 1
            if item.seen >= until.count:
                item.seen_at = event.t  # healed on the loop's next pass (heal_due)

    def _until_outcome(self, item: _Active) -> tuple[dict[str, Any], str]:
        """For a fault held ``until`` an event: ``fault_healed``'s fields saying whether the
        event was seen (``until_seen``; false: healed at ``max``, or when the run ended,
        without it) and a note for the fault's record."""
        if not isinstance(item.duration, HealWhen):
            return {}, ""
        awaited = item.duration.until.describe()
        if item.seen_at is not None:
            return ({"until": awaited, "until_seen": True, "until_at": item.seen_at},
                    f"; held until {awaited}, seen at +{item.seen_at - self._t0:.2f}s")
        limit = format_duration(item.duration.max)
        return ({"until": awaited, "until_seen": False},
                f"; {awaited} not observed while it held (at most {limit}): healed without it")
