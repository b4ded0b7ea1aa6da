"""Metrics computed from a run's timeline. Definitions: docs/metrics.md.

Everything here is a pure function of the events, so a recorded run can be
re-checked (``aftershock report``) and every metric can be tested on
hand-written timelines.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from aftershock.faults import contract
from aftershock.harness.run.records import Event


def first_fault_time(events: Sequence[Event]) -> float | None:
    return next((e.t for e in events if e.event == contract.FAULT_INJECTED), None)


def fault_landed(events: Sequence[Event], last: bool = False) -> float | None:
    """When the first fault (``last``: the last one) had certainly taken effect: when
    applying it ended (``applied_at``; a SIGSTOP has landed once kill() returned). The
    fault's moment is when applying it began, so that a fast reaction is not measured
    short; a step committed in between may still precede the fault's effect and proves
    nothing."""
    faults = (e for e in (reversed(events) if last else events)
              if e.event == contract.FAULT_INJECTED)
    fault = next(faults, None)
    if fault is None:
        return None
    applied = fault.fields.get("applied_at")
    return max(fault.t, float(applied)) if isinstance(applied, int | float) else fault.t


def committed_after_faults(events: Sequence[Event] | Reading) -> bool | None:
    """Whether the system went on after its last fault, as far as the harness saw before it
    stopped observing (``run_over``): it committed a step after the fault had landed, or it
    reported its final parameters (``params``: its work was done, before the fault, as for a
    kill on the way out, or after it). Without either, no count of the work it redid or
    skipped describes a recovery: it may simply have stopped. None when it committed no
    step at all; True without a fault, if it committed any."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    over = run_over(reading.events)
    times = [c.t for c in reading.commits if c.t < over]
    if not times:
        return None
    landed = fault_landed(reading.events, last=True)
    finished = any(e.event == contract.PARAMS and e.t < over for e in reading.events)
    return landed is None or max(times) > landed or finished


def run_over(events: Sequence[Event]) -> float:
    """When the harness stopped observing: its timeout, else the end of the run. After it,
    the harness heals every fault (a frozen rank is thawed) and stops the system, so what
    the system does then is no evidence of anything it did by itself."""
    return next((e.t for e in events if e.event in (contract.TIMEOUT, contract.RUN_END)), math.inf)


def detection(events: Sequence[Event]) -> Event | None:
    """The first event after the fault in which the system acknowledges a failure."""
    t_fault = first_fault_time(events)
    if t_fault is None:
        return None
    return next((e for e in events if e.event == contract.FAILURE_DETECTED and e.t >= t_fault),
                None)


@dataclass(frozen=True, slots=True)
class FaultDetection:
    """One fault, and what answered it: the first ``failure_detected`` at or after it
    (None: none did), or, when nothing was detected before the next fault, that the system
    rode through it (``rode_through``)."""

    fault: Event
    detected: Event | None
    rode_through: bool


def detections(events: Sequence[Event], world: int | None = None) -> list[FaultDetection]:
    """Each fault injected, with its detection: the first ``failure_detected`` at or after
    it. A fault nothing detected before the next one landed may have needed nothing: the
    system rode through it (a 1 s hang under a 3 s timeout) when every rank of the world
    that was committing before it committed a step in that same world after it had landed
    and before the next fault (for serving: every request in flight at it finished, with
    its stall over before the next fault). Such a fault does not take the next fault's
    detection as its own."""
    ordered = sorted(events, key=lambda e: e.t)
    found = [e for e in ordered if e.event == contract.FAILURE_DETECTED]
    faults = [e for e in ordered if e.event == contract.FAULT_INJECTED]
    serving = is_serving(ordered)
    reading = None if serving else Reading.of(ordered)
    records = requests(ordered) if serving else []
    size = None if serving else full_world(ordered, world)
    over = run_over(ordered)
    out = []
    for fault, nxt in zip(faults, [f.t for f in faults[1:]] + [over], strict=True):
        detected = next((d for d in found if d.t >= fault.t), None)
        if detected is not None and detected.t < nxt:
            out.append(FaultDetection(fault, detected, False))
            continue
        rode = _rode(fault, nxt, reading, records, size)
        out.append(FaultDetection(fault, None if rode else detected, rode))
    return out


def _rode(fault: Event, nxt: float, reading: Reading | None,
          records: Sequence[RequestRecord], size: int | None) -> bool:
    """Whether the system rode through ``fault`` before ``nxt`` (``reading``: the training
    timeline; None: serving, judged from the clients' ``records``)."""
    if reading is None:
        taken = serving_time_to_recover(records, fault.t)
        return taken is not None and fault.t + taken < nxt
    applied = fault.fields.get("applied_at")
    landed = max(fault.t, float(applied)) if isinstance(applied, int | float) else fault.t
    return _rode_through(reading, fault.t, landed, nxt, size)


def _rode_through(reading: Reading, t_fault: float, landed: float, until: float,
                  size: int | None) -> bool:
    """Every rank of the world committing before ``t_fault`` committed one step in that
    same (named) world after ``landed`` and before ``until``."""
    before = [c for c in reading.commits if c.t < t_fault]
    if not before or not size or before[-1].world is None:
        return False
    world = before[-1].world
    ranks: dict[int, set[int]] = defaultdict(set)
    for c in reading.commits:
        if c.world == world and c.proven and landed < c.t < until:
            ranks[c.step].add(c.rank)
    return any(len(r) >= size for r in ranks.values())


def time_to_detect(events: Sequence[Event]) -> float | None:
    """Fault injected -> first event in which the system acknowledges a failure."""
    t_fault = first_fault_time(events)
    detected = detection(events)
    return None if detected is None or t_fault is None else detected.t - t_fault


def full_world(events: Sequence[Event], configured: int | None) -> int | None:
    """Ranks at full strength: configured, else the ranks seen before the first fault."""
    if configured:
        return configured
    t_fault = first_fault_time(events)
    # Ranks as Reading numbers them: rank 0 of two torchft replica groups is two ranks.
    ordered = sorted(events, key=lambda e: e.t)
    ranks = {
        rank
        for e, rank in zip(ordered, _member_ranks(ordered), strict=True)
        if e.event == contract.STEP and rank is not None and (t_fault is None or e.t < t_fault)
    }
    return len(ranks) or None


# --------------------------------------------------------------------- worlds and commits

#: A world's identity: a generation (restart count, membership plan), a quorum id, ...
#: Two steps with the same identity were committed by one world.
World = int | str


@dataclass(frozen=True, slots=True)
class Commit:
    """One rank's report that it committed a step, in the world it named."""

    t: float  # on the timeline's clock: the committer's own, or when its log line was read
    step: int
    rank: int
    world: World | None  # None: the report named no world
    proven: bool  # `t` is the committer's own clock, not only an upper bound
    # Its writer did not exist yet at this time: the log file its line was read from had not
    # appeared (``log_appeared``), so the line, and the step it reports, came after it.
    # None: unknown (a probe event, the launcher's pipe, a file seen at the first look).
    written_after: float | None = None
    # The launcher (and replica group) whose process reported it, when its line says.
    launcher: str | None = None


def proven_time(event: Event) -> bool:
    """Whether ``event.t`` is the emitter's own clock. Probe events are stamped by the
    process that writes them. A log line is stamped when the harness reads it, which is
    only an upper bound on when it was written (``clock: read``), unless its probe parsed
    the line's own time (``clock: line``, harness/run/target.py)."""
    return event.source != "log" or event.fields.get("clock") == "line"


def log_files_appeared(events: Iterable[Event]) -> dict[str, float]:
    """Each per-process log file's latest moment of absence: the last look of the harness's
    tailer that did not find it (``log_appeared``'s ``absent_at``). Every line in it was
    written after that moment, by a writer that had not yet opened it: for torchrun's
    per-attempt files (``attempt_N/<rank>/stdout.log``), by a worker started after it. A
    file found at the tailer's first look has no such moment."""
    found: dict[str, float] = {}
    for e in events:
        where, absent = e.fields.get("path"), e.fields.get("absent_at")
        if e.event == contract.LOG_APPEARED and isinstance(where, str) \
                and isinstance(absent, int | float) and not isinstance(absent, bool):
            found[where] = float(absent)
    return found


def _identity(value: object) -> World | None:
    if isinstance(value, bool) or not isinstance(value, int | str) or value == "":
        return None
    return value


@dataclass(frozen=True, slots=True)
class Reading:
    """A timeline read once for the training metrics: its events in time order, with the
    rank and the world of each, and every step report as a ``Commit``.

    An event's world is its ``generation``; a probe event without one is in the
    generation its process (pid) last named in a ``hello`` or ``step``, which is what the
    probe stamps on later events (older timelines lack the stamp). A log line names its
    world through its probe's ``generation`` group, else the generation its process last
    entered (``world_changed``: torchft's quorum id), else torchrun's restart count
    (``attempt``, from its per-process file) when one launcher started the whole job
    (:func:`one_launcher`); else none.

    With several launchers (torchft's replica groups, one torchrun per node) each numbers
    its ranks from 0: a log line's rank is then its place among every (launcher, replica,
    rank) the run showed, so rank 0 of two groups are two ranks."""

    events: list[Event]
    ranks: list[int | None]
    worlds: list[World | None]
    commits: list[Commit]

    @classmethod
    def of(cls, events: Sequence[Event]) -> Reading:
        ordered = sorted(events, key=lambda e: e.t)
        ranks = _member_ranks(ordered)
        attempts_are_worlds = one_launcher(ordered) is None
        declared: dict[tuple[object, ...], World] = {}
        worlds: list[World | None] = []
        found: list[Commit] = []
        appeared = log_files_appeared(ordered)
        for e, rank in zip(ordered, ranks, strict=True):
            world = _world_of(e, rank, declared, attempts_are_worlds)
            worlds.append(world)
            commit = _commit_of(e, rank, world, appeared)
            if commit is not None:
                found.append(commit)
        return cls(ordered, ranks, worlds, found)


def _world_of(e: Event, rank: int | None, declared: dict[tuple[object, ...], World],
              attempts_are_worlds: bool) -> World | None:
    """The world ``e`` was in (see :class:`Reading`); ``declared`` holds, and is updated
    with, the world each process last named."""
    world = _identity(e.fields.get("generation"))
    process: tuple[object, ...]
    names: tuple[str, ...]  # the events in which a process names its world
    if e.source != "log":
        pid = e.fields.get("pid")
        process = ("pid", pid) if isinstance(pid, int) else ("source", e.source, rank)
        names = (contract.HELLO, contract.STEP)
    else:
        # One process's lines: its own file, or its name in a shared stream.
        process = ("log", e.fields.get("stream"), e.fields.get("replica_id"), rank)
        names = (contract.HELLO, contract.STEP, contract.WORLD_CHANGED)
    if world is not None and e.event in names:
        declared[process] = world
    elif world is None:
        world = declared.get(process)
    if world is None and e.source == "log" and attempts_are_worlds:
        world = _identity(e.fields.get("attempt"))
    return world


def _commit_of(e: Event, rank: int | None, world: World | None,
               appeared: Mapping[str, float]) -> Commit | None:
    """The step ``e`` reports committed, if it is a step report."""
    step = e.fields.get("step")
    if e.event != contract.STEP or not isinstance(step, int) or isinstance(step, bool):
        return None
    stream = e.fields.get("stream") if e.source == "log" else None
    after = [a for a in (appeared.get(stream) if isinstance(stream, str) else None,
                         e.fields.get("written_after"))
             if isinstance(a, int | float) and not isinstance(a, bool)]
    return Commit(e.t, step, rank if rank is not None else 0, world, proven_time(e),
                  max(after) if after else None, _launcher(e))


def _launcher(event: Event) -> str | None:
    """The launcher (and replica group) a log line's process belongs to, when it says."""
    if event.source != "log":
        return None
    launcher, replica = event.fields.get("launcher"), event.fields.get("replica")
    if launcher is None and replica is None:
        return None
    return f"{launcher or ''}#{'' if replica is None else replica}"


def _member_ranks(ordered: Sequence[Event]) -> list[int | None]:
    """Each event's rank; a log line's, with several launchers or replica groups, its place
    among every (launcher, replica, rank) the log lines showed."""
    ranks = [e.rank for e in ordered]
    keys = [(_launcher(e), e.rank) if e.source == "log" and e.rank is not None else None
            for e in ordered]
    members = sorted({(launcher, rank) for launcher, rank in filter(None, keys)
                      if launcher is not None})
    if len({launcher for launcher, _ in members}) < 2:
        return ranks
    place: dict[tuple[str | None, int], int | None] = {
        member: i for i, member in enumerate(members)}
    # A line that names no launcher (a launcher's shared pipe) keeps the rank it says.
    return [place.get(key, r) if key is not None else r
            for key, r in zip(keys, ranks, strict=True)]


def launchers(events: Iterable[Event]) -> tuple[set[int], set[str]]:
    """What the run showed of the launchers that started its workers: the agent pids the
    harness saw start a worker (``process_started``'s ``agent``: torchrun's agent, the same
    over its restarts) and the torchrun folders the log lines came from (``launcher``:
    each torchrun makes its own under ``--log-dir``)."""
    agents: set[int] = set()
    folders: set[str] = set()
    for e in events:
        agent, folder = e.fields.get("agent"), e.fields.get("launcher")
        if e.event == contract.PROCESS_STARTED and isinstance(agent, int):
            agents.add(agent)
        if e.source == "log" and isinstance(folder, str):
            folders.add(folder)
    return agents, folders


def one_launcher(events: Sequence[Event]) -> str | None:
    """None when the evidence shows one launcher started the whole job, so that its
    restart count (``attempt_N``) numbers the job's worlds; else why it does not. The
    evidence: the harness saw exactly one agent start workers, and every per-process log
    file lies in one torchrun's folder. Two launchers (torchft's replica groups, one
    torchrun per node) each count their own restarts: both at ``attempt_0`` is no proof
    that they trained together."""
    agents, folders = launchers(events)
    if len(agents) > 1 or len(folders) > 1:
        shown = (f"{len(agents)} launchers started workers" if len(agents) > 1 else
                 f"the log files lie in {len(folders)} torchrun folders")
        return (f"{shown} (each its own torchrun, e.g. torchft's replica groups), so a "
                "restart count (attempt_N) names no world")
    if not agents:
        return ("the harness saw no launcher start a worker, so it cannot tell that one "
                "torchrun launched the whole job and its restart count (attempt_N) names "
                "the world")
    return None


def commits(events: Sequence[Event]) -> list[Commit]:
    """Every step report, in time order, with its world."""
    return Reading.of(events).commits


@dataclass(frozen=True, slots=True)
class _Worlds:
    """Who was in which world when: what tells a replaced world from a live one."""

    first_seen: dict[World | None, float]  # first hello or step of each world
    members: dict[World | None, set[int]]  # ranks that committed a step in it
    # The last time a member of each world turned up (hello or step) in another named
    # world: (when, rank, that world).
    departed: dict[World | None, tuple[float, int, World]]

    @classmethod
    def of(cls, reading: Reading) -> _Worlds:
        first_seen: dict[World | None, float] = {}
        members: dict[World | None, set[int]] = defaultdict(set)
        moves: list[tuple[float, int, World | None]] = []
        for e, rank, world in zip(reading.events, reading.ranks, reading.worlds, strict=True):
            if e.event not in (contract.HELLO, contract.STEP):
                continue
            first_seen.setdefault(world, e.t)
            if e.event == contract.STEP:
                rank = 0 if rank is None else rank
                members[world].add(rank)
            elif rank is None:
                continue  # a spare's hello: it plays no rank yet
            moves.append((e.t, rank, world))
        departed: dict[World | None, tuple[float, int, World]] = {}
        for t, rank, other in moves:
            if other is None:
                continue
            for world, ranks in members.items():
                if world != other and rank in ranks:
                    departed[world] = (t, rank, other)
        return cls(first_seen, dict(members), departed)

    def left(self, world: World | None, after: float) -> tuple[float, int, World] | None:
        """(when, rank, where) a member of ``world`` last turned up in another named world,
        if that was after ``after``; None if every member stayed after it."""
        last = self.departed.get(world)
        return last if last is not None and last[0] > after else None

    def final(self) -> World | None:
        """The newest world that committed a step."""
        committed = [w for w in self.first_seen if w in self.members]
        return max(committed, key=lambda w: self.first_seen[w], default=None)


def ranks_text(ranks: Iterable[int]) -> str:
    listed = sorted(ranks)
    return ("rank " if len(listed) == 1 else "ranks ") + ", ".join(str(r) for r in listed)


def _name(world: World | None) -> str:
    return "the unnamed world" if world is None else f"generation {world}"


# ------------------------------------------------------------------------ recovery


@dataclass(frozen=True, slots=True)
class Recovery:
    """When the system was whole again after the fault, or why that was not observed."""

    seconds: float | None  # fault -> the step that proves it; None: not observed
    generation: World | None = None  # the world that recovered
    step: int | None = None
    reason: str = ""  # why it was not observed
    # The least it can have taken: `seconds` itself when every rank's commit carries its own
    # time; less when some are read times (upper bounds) of writers started after the fault.
    at_least: float | None = None
    proof: str = ""  # what proves `seconds` (PROOF_*)


#: What proves a time metric (``metric_proofs``, the report's metric line).
PROOF_OWN_CLOCK = "own clock"  # the emitter's time: the probe's, or the line's `time` group
PROOF_WRITER_STARTED = "read time, writer started after the fault (upper bound)"
PROOF_READ_TIME = "read time (upper bound)"  # when its log line was read: at most this


def proven_after(c: Commit, landed: float) -> bool:
    """Whether ``c`` provably was committed after ``landed``: by its committer's own clock,
    or because its line was read from a log file that did not yet exist then (its writer
    started after it; its read time is then only an upper bound)."""
    return c.proven or (c.written_after is not None and c.written_after >= landed)


def recovery(events: Sequence[Event] | Reading, world: int | None) -> Recovery:
    """Fault injected -> the first step committed after the fault (with several: after the
    last had landed, timed from the first), by the committers' own
    clocks, by every rank of the full world in one world (same generation), before the
    harness stopped observing, where that world was not replaced afterwards (a member
    turned up in another world) and did not fail (a failure it reported, or the run ending
    in failure while it was the last).

    A step line whose time is only when the harness read it proves it was committed
    after the fault only when its log file appeared after the fault (its writer started
    after it: torchrun's file of a later attempt); its read time is then an upper bound,
    and the recovery is proven to have taken at most ``seconds`` and at least
    ``at_least`` (from when the file was last seen absent). Steps that name no world
    never prove they were committed by one world."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    ordered = reading.events
    t_fault = first_fault_time(ordered)
    if t_fault is None:
        return Recovery(None, reason="no fault was injected")
    size = full_world(ordered, world)
    if not size:
        return Recovery(None, reason="the world's size is unknown (no rank reported a step "
                        "before the fault)")
    several = sum(1 for e in ordered if e.event == contract.FAULT_INJECTED) > 1
    named = _named_after(reading, t_fault, several)
    if isinstance(named, Recovery):
        return named
    # Each rank's first commit of each step in each world; the step is whole once `size`
    # ranks of that world committed it.
    first: dict[tuple[World | None, int], dict[int, float]] = defaultdict(dict)
    # The earliest each of those commits can have been: its own time, else when its
    # writer's log file was last seen absent.
    earliest: dict[tuple[World | None, int], dict[int, float]] = defaultdict(dict)
    for c in named:
        first[(c.world, c.step)].setdefault(c.rank, c.t)
        earliest[(c.world, c.step)].setdefault(
            c.rank, c.t if c.proven or c.written_after is None else c.written_after)
    whole = sorted((max(by_rank.values()), w, s) for (w, s), by_rank in first.items()
                   if len(by_rank) >= size)
    return (_lasting(reading, whole, earliest, t_fault, several)
            or _closest(first, size, several))


def _named_after(reading: Reading, t_fault: float, several: bool) -> list[Commit] | Recovery:
    """The commits that can prove a recovery: after the last fault landed, before the
    harness stopped observing, proven after it, naming their world; or why there are none."""
    ordered = reading.events
    # After every fault: a world whole between two faults, that the second one then froze
    # without replacing it or making it report a failure, recovered from the first only.
    landed, over = fault_landed(ordered, last=True) or t_fault, run_over(ordered)
    after = [c for c in reading.commits if landed < c.t < over]
    if not after:
        return Recovery(None, reason="no step was reported after the "
                        + ("last fault" if several else "fault"))
    proven = [c for c in after if proven_after(c, landed)]
    if not proven:
        return Recovery(None, reason="the steps reported after the fault carry only the time "
                        "their log lines were read, which cannot prove they were committed "
                        "after it, and no step line came from a log file that appeared after "
                        "it (give the step probe a (?P<time>...) group, or have each worker "
                        "write its own log file, as torchrun's --log-dir with --redirects "
                        "does, and follow them with `logs:`)")
    named = [c for c in proven if c.world is not None]
    if not named:
        return Recovery(None, reason="the steps committed after the fault name no world (a "
                        "generation in the probe's hello, or a (?P<generation>...) group in the "
                        "step probe), so one world's step cannot be told from another's")
    return named


def _lasting(reading: Reading, whole: Sequence[tuple[float, World | None, int]],
             earliest: Mapping[tuple[World | None, int], Mapping[int, float]],
             t_fault: float, several: bool) -> Recovery | None:
    """The first whole world (``whole``: when, which, at what step) that lasted: neither
    replaced nor failed; why none did; None when no world was whole."""
    fates = _Fates.of(reading)
    doomed: list[str] = []
    for t, w, s in whole:
        whole_at = (f"{_name(w)} was whole at step {s} {t - t_fault:.3f} s after the "
                    + ("first fault" if several else "fault"))
        why = fates.doomed(w, t)
        if why is not None:
            doomed.append(f"{whole_at}, but {why}")
            continue
        low = max(earliest[(w, s)].values()) - t_fault
        exact = low >= t - t_fault
        return Recovery(t - t_fault, w, s, at_least=t - t_fault if exact else low,
                        proof=PROOF_OWN_CLOCK if exact else PROOF_WRITER_STARTED)
    return Recovery(None, reason="; ".join(doomed[:2])) if doomed else None


@dataclass(frozen=True, slots=True)
class _Fates:
    """What can undo a whole world: its members turning up elsewhere, a failure it
    reported (each world's last), and the run ending in failure (``ended``: its exit code,
    None when it did not) while it was the newest world."""

    known: _Worlds
    failed_at: dict[World | None, float]
    ended: object
    newest: World | None

    @classmethod
    def of(cls, reading: Reading) -> _Fates:
        failed_at: dict[World | None, float] = {}
        for e, w in zip(reading.events, reading.worlds, strict=True):
            if e.event == contract.FAILURE_DETECTED:
                failed_at[w] = e.t
        end = next((e for e in reversed(reading.events) if e.event == contract.RUN_END), None)
        ended_badly = end is not None and end.fields.get("exit_code") not in (0, None) and \
            not end.fields.get("timed_out")
        known = _Worlds.of(reading)
        newest = max(known.first_seen, key=lambda w: known.first_seen[w], default=None)
        return cls(known, failed_at, end.fields.get("exit_code") if end and ended_badly
                   else None, newest)

    def doomed(self, w: World | None, t: float) -> str | None:
        """Why world ``w``, whole at ``t``, did not last, or None."""
        moved, failed = self.known.left(w, t), self.failed_at.get(w)
        if moved is not None:
            when, rank, other = moved
            return (f"was replaced: rank {rank} turned up in {_name(other)} "
                    f"{when - t:.3f} s later")
        if failed is not None and failed > t:
            return f"reported a failure {failed - t:.3f} s later"
        if self.ended is not None and w == self.newest:
            return f"the run ended in failure (exit {self.ended})"
        return None


def _closest(first: Mapping[tuple[World | None, int], Mapping[int, float]], size: int,
             several: bool) -> Recovery:
    """No world recovered: the one that came closest, the most ranks committing one step
    after the fault."""
    (w, s), by_rank = max(first.items(), key=lambda item: (len(item[1]), -min(item[1].values())))
    missing = set(range(size)) - set(by_rank)
    lacking = ranks_text(missing) if missing else f"{size - len(by_rank)} more ranks"
    fault = "the last fault" if several else "the fault"
    return Recovery(None, reason=f"no world had every rank commit a step after {fault}; "
                    f"closest: {_name(w)} committed step {s} without {lacking}")


def time_to_recover(events: Sequence[Event] | Reading, world: int | None) -> float | None:
    """Fault injected -> the first step that proves recovery (see ``recovery``)."""
    return recovery(events, world).seconds


def metric_proofs(events: Sequence[Event], world: int | None) -> dict[str, str]:
    """What proves each time metric that was observed: its events' own clocks
    (``PROOF_OWN_CLOCK``), or read times that only bound it from above, for recovery with
    the lower bound its writers' start gives. Serving's times are the clients' clocks."""
    if is_serving(events):
        return {}
    proofs: dict[str, str] = {}
    detected = detection(events)
    if detected is not None:
        proofs["time_to_detect_s"] = PROOF_OWN_CLOCK if proven_time(detected) \
            else PROOF_READ_TIME
    found = recovery(events, full_world(events, world))
    if found.seconds is not None:
        proofs["time_to_recover_s"] = found.proof if found.proof == PROOF_OWN_CLOCK else (
            f"{found.proof}; at least {found.at_least:.3f} s")
    return proofs


# --------------------------------------------------------------- history: forks and gaps


@dataclass(frozen=True, slots=True)
class Fork:
    """A step committed after the fault by more than one world that kept going."""

    step: int
    worlds: tuple[World | None, ...]


class _Lines:
    """Each rank's line of descent: its commits, in time order, for as long as each one
    builds on the one before. A rank breaks its line when it commits a step it already
    passed (it rolled back, e.g. a restart from a checkpoint) or enters another world
    further ahead than its next step (its state was replaced, e.g. healed from a peer).
    Entering another world at its next step carries the line on (a survivor that stays)."""

    def __init__(self, found: Sequence[Commit]) -> None:
        self.by_rank: dict[int, list[Commit]] = defaultdict(list)
        for c in found:
            self.by_rank[c.rank].append(c)
        self.last: dict[int, Commit] = {}  # id(commit) -> the last commit of its line
        self.place: dict[int, int] = {}  # id(commit) -> its index among its rank's commits
        self._merged: dict[tuple[int, int], dict[World, int]] = {}  # see _entered
        self.worlds = {rank: {c.world for c in run} for rank, run in self.by_rank.items()}
        for run in self.by_rank.values():
            end = run[-1]
            for i in range(len(run) - 1, -1, -1):
                self.last[id(run[i])] = end
                self.place[id(run[i])] = i
                if i and self._breaks(run[i - 1], run[i]):
                    end = run[i - 1]
        self.top = max((c.step for c in found), default=0)

    @staticmethod
    def _breaks(before: Commit, after: Commit) -> bool:
        return after.step <= before.step or (after.step > before.step + 1
                                             and after.world != before.world)

    def advances_apart(self, a: Commit, b: Commit) -> bool:
        """``a``'s line made progress after ``b`` was committed, other than as the world that
        ``b``'s world merged into. ``b``'s line ends where its rank goes on in a world it had
        not been in, further ahead (it took that world's state: on a busy machine, a torchft
        replica that started late trained alone while its peer was frozen, then healed from
        it). Every member of a world takes part in each of its steps, so that world's steps
        from the one ``b``'s rank entered it at came after ``b``'s line had ended: one
        history going on. Progress anywhere else counts, and so does any progress when
        ``b``'s world is one ``a``'s rank was in (it went on without that member: a zombie)."""
        run, end = self.by_rank[a.rank], self.last[id(a)]
        if end is a or end.t <= b.t:
            return False
        if b.world in self.worlds[a.rank]:
            return True
        entered = self._entered(b)
        for i in range(self.place[id(end)], self.place[id(a)], -1):  # its line, from the end
            c = run[i]
            if c.t <= b.t:
                return False
            if c.world is None or c.world not in entered or c.step < entered[c.world]:
                return True
        return False

    def _entered(self, c: Commit) -> dict[World, int]:
        """The worlds ``c``'s rank went on in after ``c``'s line ended, new to it, each with
        the first step it committed there."""
        own, end = self.by_rank[c.rank], self.last[id(c)]
        key = (c.rank, self.place[id(end)])
        found = self._merged.get(key)
        if found is None:
            cut = key[1] + 1
            before = {o.world for o in own[:cut]}
            found = {}
            for o in own[cut:]:
                if o.world is not None and o.world not in before:
                    found.setdefault(o.world, o.step)
            self._merged[key] = found
        return found

    def completes(self, c: Commit) -> bool:
        """Its line runs unbroken to the run's last step: what it built is a result."""
        last = self.last[id(c)]
        return last is self.by_rank[c.rank][-1] and last.step >= self.top


def forks(events: Sequence[Event] | Reading) -> list[Fork] | None:
    """Steps committed by two worlds that both went on from them, the second commit after
    the fault: a split brain. Two commits of one step in different worlds fork when the
    earlier one's line still made progress after the later one was committed (two worlds
    advancing at once, a zombie included), or when both lines run unbroken to the run's
    last step (two results). A world that was given up (its ranks rolled back, or took
    another world's state) and redone is one history with lost work (``lost_steps``);
    so is the earlier line's progress in the world the later one's rank went on to, once
    it had taken that world's state (``_Lines.advances_apart``).
    None when some step after the fault names no world: then two worlds cannot be told
    apart."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    t_fault = first_fault_time(reading.events)
    if t_fault is None:
        return []
    found = reading.commits
    if any(c.world is None for c in found if c.t > t_fault):
        return None
    lines = _Lines(found)
    per_step: dict[int, list[Commit]] = defaultdict(list)
    for c in found:
        per_step[c.step].append(c)
    return [Fork(step, tuple(dict.fromkeys(c.world for c in done)))
            for step, done in sorted(per_step.items()) if _forks(done, t_fault, lines)]


def _forks(done: Sequence[Commit], t_fault: float, lines: _Lines) -> bool:
    """Whether the commits of one step (in time order) hold two worlds that both went on,
    the second commit after the fault."""
    # In each pair `a` came first.
    pairs = [(a, b) for a, b in itertools.combinations(done, 2)
             if b.t > t_fault and a.world != b.world and a.world is not None]
    return any(lines.advances_apart(a, b) or (lines.completes(a) and lines.completes(b))
               for a, b in pairs)


def forked_steps(events: Sequence[Event] | Reading) -> int | None:
    """Steps committed after the fault by two histories (see ``forks``)."""
    found = forks(events)
    return None if found is None else len(found)


def lost_steps(events: Sequence[Event] | Reading) -> int:
    """Work done twice: for each step, every commit of it after the first, where a world
    commits a step as often as its most repeating rank did (a world rolled back within
    itself, or a restarted world, redoes steps; two worlds of a split brain each do them).
    A commit after the fault that names no world counts as its launcher's own (each
    torchft replica group, each node's torchrun): unless the evidence shows one world, a
    step two launchers committed after the fault was done twice. Counted in the step
    line's own unit (what its ``step`` numbers: an optimizer step, an epoch).
    """
    reading = events if isinstance(events, Reading) else Reading.of(events)
    t_fault = first_fault_time(reading.events)
    counts: dict[int, dict[object, dict[int, int]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(int)))
    for c in reading.commits:
        unnamed = c.world is None and t_fault is not None and c.t > t_fault
        world: object = ("launcher", c.launcher) if unnamed and c.launcher else c.world
        counts[c.step][world][c.rank] += 1
    return sum(max(sum(max(by_rank.values()) for by_rank in by_world.values()) - 1, 0)
               for by_world in counts.values())


def step_unit(events: Sequence[Event]) -> str:
    """What one step of ``lost_steps`` and ``skipped_steps`` is: the step numbers the job's
    step reports count, which the harness cannot convert (an epoch for a job that reports
    epochs, torchft's Manager step for the ``torchft`` preset)."""
    first = next((e for e in events if e.event == contract.STEP), None)
    if first is None:
        return "steps as the job numbers them"
    line = first.fields.get("line")
    if first.source == "log" and isinstance(line, str):
        shown = line.strip()
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return f"steps as its step lines number them ({shown!r})"
    return "steps as the job's probe reports them (probe.step)"


def skipped_steps(events: Sequence[Event] | Reading) -> int | None:
    """Steps the history jumped over: a world going from step a to b > a+1 (its steps in
    the order any member first committed them), or a new world whose first step is not
    the one after where it resumed (its ``checkpoint_loaded``/``recovery_done`` step, else
    the newest step committed before it, if that is below). A world, not each rank: a
    rank's lost report (two ranks' log lines run together) is no skip when the rest of its
    world committed the step. None when no world is ever seen committing two consecutive
    steps: a job that reports every k-th step shows gaps that are not skips."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    found = reading.commits
    runs: dict[World | None, list[int]] = defaultdict(list)
    seen: set[tuple[World | None, int]] = set()
    for c in found:
        if (c.world, c.step) not in seen:
            seen.add((c.world, c.step))
            runs[c.world].append(c.step)
    pairs = [(a, b) for run in runs.values() for a, b in itertools.pairwise(run)]
    if not any(b == a + 1 for a, b in pairs):
        return None
    skipped: set[int] = set()
    for a, b in pairs:
        skipped.update(range(a + 1, b))
    return len(skipped | _skipped_at_starts(reading))


def _skipped_at_starts(reading: Reading) -> set[int]:
    """The steps each new world jumped over as it started: from where it resumed (its
    ``checkpoint_loaded``/``recovery_done`` step, else the newest step committed before
    it, if that is below) to its first step."""
    found = reading.commits
    resumed: dict[World | None, list[tuple[float, int]]] = defaultdict(list)
    for e, w in zip(reading.events, reading.worlds, strict=True):
        step = e.fields.get("step")
        if e.event in (contract.CHECKPOINT_LOADED, contract.RECOVERY_DONE) \
                and isinstance(step, int):
            resumed[w].append((e.t, step))
    starts: dict[World | None, Commit] = {}
    for c in found:
        starts.setdefault(c.world, c)
    skipped: set[int] = set()
    for start in list(starts.values())[1:]:  # the first world starts where the job does
        points = [s for t, s in resumed.get(start.world, []) if t <= start.t]
        below = [c.step for c in found if c.t < start.t and c.step < start.step]
        if points:
            skipped.update(range(points[0] + 1, start.step))
        elif below:
            skipped.update(range(max(below) + 1, start.step))
    return skipped


def steps_committed(events: Sequence[Event]) -> int | None:
    steps = [e.fields["step"] for e in events
             if e.event == contract.STEP and isinstance(e.fields.get("step"), int)]
    return max(steps) if steps else None


def final_world(events: Sequence[Event] | Reading) -> World | None:
    """The newest world that committed a step: the one whose parameters are the run's
    result. None when no step names a world (then every report is of one unnamed world)."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    return _Worlds.of(reading).final()


def final_digests(events: Sequence[Event] | Reading) -> dict[int, str]:
    """Each rank's last reported parameter digest in the final world. A digest another
    world reported (a survivor of a world that was replaced, as it crashed) is not the
    run's result."""
    reading = events if isinstance(events, Reading) else Reading.of(events)
    final = final_world(reading)
    digests: dict[int, str] = {}
    for e, rank, w in zip(reading.events, reading.ranks, reading.worlds, strict=True):
        if e.event == contract.PARAMS and isinstance(e.fields.get("digest"), str) and w == final:
            digests[rank if rank is not None else 0] = e.fields["digest"]
    return digests


def generations(events: Sequence[Event]) -> int:
    """New generations after the first: world restarts under `restart` (torchrun's
    restart count), membership changes under hot_spare and elastic; for a job without
    ``hello``, the restart counts of the workers its launcher started."""
    seen = {e.fields.get("generation") for e in events if e.event == contract.HELLO}
    seen.discard(None)
    if not seen:
        # A job that says nothing of itself: the restart counts of the workers its launcher
        # started, as the harness saw them in the process tree (process_started).
        seen = {e.fields.get("generation") for e in events if e.event == contract.PROCESS_STARTED}
        seen.discard(None)
    return max(len(seen) - 1, 0)


def min_step_rate(events: Sequence[Event], window_s: float = 2.0) -> float | None:
    """The slowest progress of the run: the fewest steps committed (first report of each
    step number) in any window of ``window_s`` seconds, per second, from the first step to
    the last; in a run the harness had to stop at its timeout, to the timeout: a job that
    hung after its last step made no progress until then, and that is its slowest."""
    first: dict[int, float] = {}
    for e in events:
        step = e.fields.get("step")
        if e.event == contract.STEP and isinstance(step, int):
            first.setdefault(step, e.t)
    times = sorted(first.values())
    if len(times) < 2:
        return None
    stopped = next((e.t for e in events if e.event == contract.TIMEOUT), None)
    end = times[-1] if stopped is None else max(times[-1], stopped)
    if end - times[0] < window_s:
        return None
    return _slowest_window(times, end, window_s)


def _slowest_window(times: Sequence[float], end: float, window_s: float) -> float | None:
    """The fewest of ``times`` (sorted) in any window of ``window_s`` from the first to
    ``end``, per second, the windows a quarter window apart."""
    slowest = None
    lo = 0
    start = times[0]
    while start + window_s <= end:
        lo = bisect.bisect_left(times, start, lo)
        hi = bisect.bisect_left(times, start + window_s, lo)
        rate = (hi - lo) / window_s
        slowest = rate if slowest is None else min(slowest, rate)
        start += window_s / 4
    return slowest


# ------------------------------------------------------------------------------ serving


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the load generator, as its ``request_done``/``request_failed``
    event recorded it (times on the run's monotonic clock)."""

    id: str
    done: bool
    sent: float
    tokens: tuple[int, ...]
    times: tuple[float, ...]
    max_tokens: int
    duplicates: int
    # The server's digest of the logits row each token was chosen from; None where it sent
    # none (or the event predates digests).
    digests: tuple[str | None, ...] = ()
    # Some chunk carried no token_index: the client counted tokens in order, so a repeated
    # token could not be told from a new one.
    unindexed: bool = False
    # The finish_reason the server gave with the last token, if it gave one.
    finish_reason: str | None = None
    # Why the client gave the request up (request_failed), as it recorded it.
    error: str | None = None

    @classmethod
    def of(cls, event: Event) -> RequestRecord | None:
        f = event.fields
        tokens, times = f.get("tokens"), f.get("times")
        if not isinstance(tokens, list) or not isinstance(times, list):
            return None
        given = f.get("digests")
        listed = given if isinstance(given, list) else []
        digests = tuple(d if isinstance(d, str) and d else None for d in listed[: len(tokens)])
        digests += (None,) * (len(tokens) - len(digests))
        return cls(str(f.get("request")), event.event == contract.REQUEST_DONE,
                   float(f.get("sent", event.t)), tuple(int(x) for x in tokens),
                   tuple(float(x) for x in times), int(f.get("max_tokens") or len(tokens)),
                   int(f.get("duplicates") or 0), digests, bool(f.get("unindexed")),
                   str(f["finish_reason"]) if f.get("finish_reason") else None,
                   str(f["error"]) if event.event == contract.REQUEST_FAILED and f.get("error")
                   else None)


def requests(events: Sequence[Event]) -> list[RequestRecord]:
    """Every request that ended, plus one empty failed record per request that was sent
    but never ended (the run stopped under it)."""
    ended: dict[str, RequestRecord] = {}
    sent: dict[str, float] = {}
    for e in events:
        if e.event == contract.REQUEST_SENT and e.source == "client":
            sent[str(e.fields.get("request"))] = e.t
        elif e.event in (contract.REQUEST_DONE, contract.REQUEST_FAILED) and e.source == "client":
            record = RequestRecord.of(e)
            if record is not None:
                ended[record.id] = record
    for rid, t in sent.items():
        if rid not in ended:
            ended[rid] = RequestRecord(rid, False, t, (), (), 0, 0, ())
    return sorted(ended.values(), key=lambda r: r.sent)


@dataclass(frozen=True, slots=True)
class Output:
    """What the client of one request received: its tokens and, per token, the server's
    digest of the logits row the token was chosen from (None where it sent none)."""

    tokens: tuple[int, ...]
    digests: tuple[str | None, ...]

    def to_json(self) -> dict[str, list[int] | list[str | None]]:
        return {"tokens": list(self.tokens), "digests": list(self.digests)}

    @classmethod
    def from_json(cls, data: object) -> Output:
        """Read ``to_json``'s form back; a bare token list (a baseline cached before digests
        existed) has unknown digests, which `outputs_match` refuses to take on trust."""
        if isinstance(data, list):
            return cls(tuple(int(t) for t in data), (None,) * len(data))
        if not isinstance(data, dict):
            raise ValueError(f"not a request's output: {data!r:.100}")
        tokens = tuple(int(t) for t in data.get("tokens") or ())
        digests = tuple(d if isinstance(d, str) and d else None
                        for d in data.get("digests") or ())
        return cls(tokens, (digests + (None,) * len(tokens))[: len(tokens)])


def outputs(events: Sequence[Event]) -> dict[str, Output]:
    """Request id -> what its client received (for `outputs_match`)."""
    return {r.id: Output(r.tokens, r.digests) for r in requests(events)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): an observed value, never an interpolation."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def serving_recovery(records: Sequence[RequestRecord], events: Sequence[Event]
                     ) -> float | None:
    """The first fault -> every request in flight at any fault streams again
    (``serving_time_to_recover`` of each fault, measured from the first). None when the
    requests one of them hit never streamed again, or one of them hit no request: a
    recovery from the first fault alone is no recovery of the run when a later one froze
    what was left."""
    times = [e.t for e in events if e.event == contract.FAULT_INJECTED]
    if not times:
        return None
    ends = []
    for t in times:
        taken = serving_time_to_recover(records, t)
        if taken is None:
            return None
        ends.append(t + taken)
    return max(ends) - times[0]


def serving_time_to_recover(records: Sequence[RequestRecord], t_fault: float | None
                            ) -> float | None:
    """Fault injected -> every request that was in flight at the fault streams again.

    A request hit by the fault stalls: its longest wait between tokens (or between being
    sent and its first token) that ends after the fault is the stall, and the token that
    ends it is its recovery. Tokens the dying worker had already sent can still arrive
    just after the fault; taking the end of the longest wait, not the first token after
    the fault, keeps them from passing for recovery. The slowest request counts; None if
    one of them never got another token or never finished (its last wait never ended: a
    token or two from a replacement that died too is no recovery), or if a request sent
    after the fault never finished (the server stopped serving new work), or if no request
    was in flight (then the fault
    hit nothing a client could see, and a budget on it would pass vacuously)."""
    return _serving_stall(records, t_fault)[0] if t_fault is not None else None


def _serving_stall(records: Sequence[RequestRecord], t_fault: float
                   ) -> tuple[float | None, str]:
    """``serving_time_to_recover``, with why it is None: the first request that shows it."""
    worst: float | None = None
    for r in records:
        if r.sent >= t_fault:
            if not r.done:  # sent after the fault, never served whole: it never came back
                return None, f"{r.id}, sent after the fault, was never served whole"
            continue
        if r.done and r.times and r.times[-1] <= t_fault:
            continue  # finished before the fault
        points = (r.sent, *r.times)
        waits = [(b - a, b) for a, b in itertools.pairwise(points) if b > t_fault]
        if not waits:
            return None, f"{r.id}, in flight at the fault, never got another token"
        if not r.done:  # its last wait never ended
            return None, (f"{r.id}, in flight at the fault, never finished "
                          f"({len(r.tokens)} of {r.max_tokens} tokens)")
        _, resumed = max(waits)
        worst = max(worst or 0.0, resumed - t_fault)
    if worst is None:
        return None, ("no request was in flight at the fault: it hit nothing a client "
                      "could see")
    return worst, ""


def serving_unrecovered(events: Sequence[Event]) -> str:
    """Why ``serving_recovery`` is None (the first fault whose requests show it), or ""."""
    records = requests(events)
    faults = [e.t for e in events if e.event == contract.FAULT_INJECTED]
    if not faults:
        return "no fault was injected"
    for i, t in enumerate(faults):
        taken, why = _serving_stall(records, t)
        if taken is None:
            return why if len(faults) == 1 else f"fault {i + 1}: {why}"
    return ""


def streamed_after_faults(events: Sequence[Event]) -> bool:
    """Whether serving went on after the last fault had landed, as the clients saw it: a
    token arrived after it, or every request the load planned had been served whole before
    it (the fault hit nothing). Without either, no count of tokens sent twice describes a
    recovery: the server may simply have stopped. True without a fault."""
    landed = fault_landed(events, last=True)
    if landed is None:
        return True
    records = requests(events)
    if any(t > landed for r in records for t in r.times):
        return True
    whole = all(r.done and (not r.times or r.times[-1] <= landed) for r in records)
    return whole and len(records) >= (planned_requests(events) or 0)


def ended_early(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The requests the server ended itself before ``max_tokens``, with another
    finish_reason than ``length`` (``stop``: an end-of-sequence token or a stop string, or a
    recovery that cut them short). The client cannot tell those apart, so they stay lost;
    no_lost_requests names them and how to make the server generate every token."""
    return [r for r in records if r.done and len(r.tokens) < r.max_tokens
            and r.finish_reason not in (None, "length")]


def planned_requests(events: Sequence[Event]) -> int | None:
    """How many requests the load generator planned to send (``load_started``)."""
    started = next((e for e in events if e.event == contract.LOAD_STARTED), None)
    planned = started.fields.get("requests") if started is not None else None
    return planned if isinstance(planned, int) and not isinstance(planned, bool) else None


def serving(events: Sequence[Event]) -> dict[str, float | int | None]:
    records = requests(events)
    # Requests the load planned but never sent: the run ended under it (the server exited,
    # or the harness stopped it). They were never served, so they are lost, and never got a
    # first token; counting only the requests sent would pass a server that died between
    # two arrivals with everything it had been sent finished.
    unsent = max((planned_requests(events) or 0) - len(records), 0)
    stats = next((e.fields for e in reversed(events) if e.event == contract.SERVING_STATS), {})
    lost = [r for r in records if not r.done or len(r.tokens) < r.max_tokens]
    return {
        "time_to_detect_s": time_to_detect(events),
        "time_to_recover_s": serving_recovery(records, events),
        "requests": len(records) + unsent,
        "unsent_requests": unsent,
        "lost_requests": len(lost) + unsent,
        "lost_tokens": sum(max(r.max_tokens - len(r.tokens), 0) for r in lost),
        "ended_early_requests": len(ended_early(records)),
        "duplicated_tokens": sum(r.duplicates for r in records),
        "unindexed_requests": sum(1 for r in records if r.unindexed),
        "migrated_requests": sum(1 for e in events if e.event == contract.REQUEST_MIGRATED),
        "recomputed_tokens": _number(stats.get("recomputed_tokens")),
        "prefix_hit_rate": _number(stats.get("prefix_hit_rate")),
        **_latencies(records, unsent),
    }


def _number(value: object) -> float | int | None:
    return value if isinstance(value, int | float) else None


def _latencies(records: Sequence[RequestRecord], unsent: int
               ) -> dict[str, float | int | None]:
    """TTFT and TPOT percentiles, and the requests that count as waits over any budget."""
    # Over every request, not only the ones that got a token: a request that never got its
    # first token, or whose tokens stopped before it finished, waited longer than any budget,
    # and counts as such (math.inf). A percentile that lands on one is no value (None), and
    # the latency check says how many requests it was.
    never = sum(1 for r in records if not r.times and r.max_tokens > 0) + unsent
    stalled = sum(1 for r in records if r.times and not r.done)
    ttft = [r.times[0] - r.sent for r in records if r.times] + [math.inf] * never
    tpot = [b - a for r in records for a, b in itertools.pairwise(r.times)] \
        + [math.inf] * stalled
    return {
        "requests_without_first_token": never,
        "requests_stalled": stalled,
        "ttft_p50_s": _finite(percentile(ttft, 50)),
        "ttft_p99_s": _finite(percentile(ttft, 99)),
        "tpot_p50_s": _finite(percentile(tpot, 50)),
        "tpot_p99_s": _finite(percentile(tpot, 99)),
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def is_serving(events: Sequence[Event]) -> bool:
    return any(e.event in (contract.LOAD_STARTED, contract.LOAD_NOT_READY) for e in events)


def load_not_ready(events: Sequence[Event]) -> str | None:
    """Why the load never started (the server never became ready), or None."""
    return next((str(e.fields.get("error")) for e in events if e.event == contract.LOAD_NOT_READY),
                None)


def compute(events: Sequence[Event], world: int | None) -> dict[str, float | int | None]:
    if is_serving(events):
        return serving(events)
    world = full_world(events, world)
    reading = Reading.of(events)
    return {
        "time_to_detect_s": time_to_detect(events),
        "time_to_recover_s": time_to_recover(reading, world),
        "lost_steps": lost_steps(reading),
        "skipped_steps": skipped_steps(reading),
        "forked_steps": forked_steps(reading),
        "steps_committed": steps_committed(events),
        "generations": generations(events),
        "min_step_rate": min_step_rate(events),
    }
