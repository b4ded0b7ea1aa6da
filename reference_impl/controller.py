"""The one place that decides membership: hosts the store, watches members, publishes plans.

It runs as its own small process (forked by slot 0's supervisor before any worker exists), so
neither a training rank's death nor a spare's takes the store or the decisions with it. It
reads four kinds of evidence and turns each into a ``failure_detected`` event with its cause:

- ``dead``: a supervisor saw its worker die (process exit: milliseconds after a SIGKILL);
- heartbeats: a member whose counter stops moving for ``heartbeat_timeout`` is frozen; it
  is fenced (SIGKILL, the slot's supervisor then reports it dead), so it can never
  come back with stale state;
- ``fail``: a member's collective failed. Alone this names no culprit (the dead peer is on the
  other end of the socket), so the controller waits for one of the two signals above and
  regroups the same members if none comes within the heartbeat timeout;
- arrivals: a member that has not reached a generation's start line within the heartbeat
  timeout of its plan (a collective timeout more for a planned switch) and is still inside
  an older generation is wedged there, however it beats: its heartbeat is another thread,
  proof that the process lives, not its training loop. It is fenced like a silent member,
  and left out of the next plan as torchft leaves a replica that misses the quorum; its
  slot comes back as a fresh process.

A plan for generation ``g`` names which (slot, incarnation) plays which logical rank and which
data-parallel replicas are live. ``hot_spare`` replaces each dead member by a warm spare;
``elastic`` drops every replica that lost a member, and adds it back once its slots are alive
again (its killed worker is re-forked by its supervisor and heals from a live peer).
``--replay`` publishes the generations of a recorded membership log instead, at the steps
where they happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftershock.faults import jsonl
from aftershock.harness import probe
from aftershock.reference_impl import _snapshots, _store

#: What the controller writes over a member's heartbeat counter to fence a process it cannot
#: signal (one on another node, in another PID namespace): the member's next beat reads a
#: negative count and it kills itself (``resilient.Worker._heartbeat``).
FENCED = -(2**40)
# How long the controller keeps hosting the store after the end for a slot it never heard
# from (its first process still starting): it then finds the job over and leaves.
LATE_SLOT_S = 60.0

# Heartbeat counters are read every 1/50 of the heartbeat timeout (a silent member is fenced
# at most 2% late), but at least every 0.1 s and at most every 0.02 s: each read is a store
# round trip on cores the training ranks share.
CHECK_FRACTION, CHECK_MIN_S, CHECK_MAX_S = 1 / 50, 0.02, 0.1


@dataclass
class Proc:
    slot: int
    inc: int
    pid: int  # in the PID namespace of ``host``
    host: str = ""  # where it runs (``host_id``): a pid means something only there
    alive: bool = True
    beats: int = -1  # last heartbeat counter seen
    beat_t: float = 0.0  # when it last changed
    rank: int | None = None  # its logical rank in the newest plan; None: not a member
    finished: bool = False  # reported its final parameters: its work is done, whatever follows
    left: bool = False  # out of its generation after the training ended: it will not finish


def host_id() -> str:
    """This process's host and PID namespace: two processes with the same one can signal
    each other by pid. The hostname alone is not enough (a container may share its host's
    name), and the namespace's inode alone neither (every host's first one has the same)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def first_spare(cfg: Any) -> int:
    """The slot of the first spare (``--first-spare``; by default after every rank)."""
    world = cfg.replicas * cfg.shards
    return world if cfg.first_spare < 0 else cfg.first_spare


def rank_slot(cfg: Any, rank: int) -> int:
    """The slot whose first process plays logical ``rank`` at the start: the ranks fill the
    slots in order, around the spares' consecutive ones."""
    spares = cfg.spares if cfg.recovery == "hot_spare" else 0
    return rank if rank < first_spare(cfg) else rank + spares


def is_spare_slot(cfg: Any, slot: int) -> bool:
    """Whether ``slot``'s first process starts as a spare (hot_spare)."""
    if cfg.recovery != "hot_spare":
        return False
    return first_spare(cfg) <= slot < first_spare(cfg) + cfg.spares


def read_membership(path: str | Path) -> list[dict[str, Any]]:
    """A recorded membership log → the generations that committed steps, in order.

    A generation superseded before it committed anything (the next one starts at the same
    step) and one that repeats its predecessor's replicas change nothing and are dropped.
    """
    entries: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        while entries and entries[-1]["first_step"] >= entry["first_step"]:
            entries.pop()
        if entries and entries[-1]["replicas"] == entry["replicas"]:
            continue
        entries.append({"first_step": entry["first_step"], "replicas": entry["replicas"]})
    return entries


class Controller:
    def __init__(self, cfg: Any, store: Any, slots: int) -> None:
        self.cfg = cfg
        self.store = store
        self.slots = slots
        self.world = cfg.replicas * cfg.shards
        self.elastic = cfg.recovery == "elastic"
        self.hb_timeout = cfg.heartbeat_timeout or cfg.collective_timeout
        self.check_s = min(CHECK_MAX_S, max(CHECK_MIN_S, self.hb_timeout * CHECK_FRACTION))
        self.procs: dict[int, Proc] = {}  # slot -> its newest incarnation
        self.successors: set[int] = set()  # slots whose death was reported, not yet ready
        self.host = host_id()
        self.plan: dict[str, Any] | None = None
        self.gen = -1
        self.fail_t: float | None = None  # first unexplained collective failure in this gen
        self.published_t = 0.0  # when this gen's plan was published
        self.join_by: float | None = None  # every member of this gen at its start line by then
        # Generation -> (when it was superseded, by when its members must be out of it: the
        # start line deadline of the generation after it; ``check_rejoins``). And every
        # generation's plan.
        self.superseded: dict[int, tuple[float, float]] = {}
        self.plans: dict[int, dict[str, Any]] = {}
        # Shards whose final parameters some member reported ("done").
        self.finished_shards: set[int] = set()
        # The training is over once a member says it completed the last step ("last", sent
        # before its final parameters, or "done"): it completed the last step's vote, so
        # every member of its generation holds (or can roll forward to) the final state, and
        # no later death calls for a new generation.
        self.over = False
        self.resumed = -1  # newest generation whose resume step was logged
        self.hb_keys: set[str] = set()  # heartbeat counters known to exist
        self.reports_read = 0  # reports handled: the reader waits on ev/{reports_read}
        self.hole: tuple[int, float] | None = None  # an index taken and unwritten, since
        self.replay = read_membership(cfg.replay) if cfg.replay else None
        out = Path(cfg.out) if cfg.out else None
        name = "membership.replay.jsonl" if cfg.replay else "membership.jsonl"
        self.log_path = out / name if out else None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("")

    # -- evidence -------------------------------------------------------------------------

    def handle(self, ev: dict[str, Any]) -> None:
        self.reports_read += 1
        kind = ev["type"]
        if kind == "hole":  # filled by check_holes: its writer died before writing it
            return
        if kind == "ready":
            self.procs[ev["slot"]] = Proc(ev["slot"], ev["inc"], ev["pid"],
                                          ev.get("host", self.host), beat_t=time.monotonic())
            self.successors.discard(ev["slot"])
            self.maybe_plan()
        elif kind == "dead":
            # Whoever reports a death is the slot's next incarnation: alive until it says
            # ready (then it is the slot's process) or has seen the end (``linger``).
            self.successors.add(ev["slot"])
            proc = self.procs.get(ev["slot"])
            # A later incarnation's death is ours too: a supervisor forks or wakes
            # incarnation k + 1 only once k died. Seen when a woken standby is killed before
            # it reports: the fresh fork after it reports the standby's incarnation, the
            # one we know never reported (its status is then unknown).
            if proc is None or proc.inc > ev["inc"] or not proc.alive:
                return
            proc.alive = False
            if proc.finished:  # killed on its way out: its work was done and reported
                return
            rank = self.rank_of(proc)
            status = ev.get("status") if proc.inc == ev["inc"] else None
            probe.detected(cause="process_exit", rank=rank, slot=proc.slot, source="controller",
                           status=status, generation=self.gen,
                           **({"after_last_step": True} if self.over else {}))
            if rank is not None:
                self.replan(f"rank {rank} (slot {proc.slot}) exited")
            else:
                self.maybe_plan()
        elif kind == "fail":
            proc = self.procs.get(ev["slot"])
            if self.over and proc is not None and proc.inc == ev.get("inc"):
                proc.left = True
            if ev.get("gen") == self.gen and self.fail_t is None:
                self.fail_t = time.monotonic()
        elif kind == "leave" and self.replay is not None:
            if ev["gen"] == self.gen and self.gen + 1 < len(self.replay):
                self.publish(self.replay_plan(self.gen + 1), "replay")
        elif kind == "last":
            self.over = True
        elif kind == "done":
            proc = self.procs.get(ev["slot"])
            if proc is not None and proc.inc == ev.get("inc"):
                proc.finished = True
            self.finished_shards.add(ev["rank"] % self.cfg.shards)
            self.over = True
        elif kind == "resumed":
            self.log_resume(ev["gen"], ev["step"])

    def check_holes(self, taken: int, now: float) -> None:
        """Fill the report index the reader waits on if it was taken (``taken``: the
        reports' counter) and stayed unwritten for ``HOLE_S``: its writer was killed between
        taking it and writing it (``_store.report``). Left alone, the reader would wait on
        it for ever and no later report, a death or the last ``done``, would be read: the
        job trained to its end and never ended (explore/hot_spare in `make
        test-scenarios`). The fill writes only a missing key, and a reporter that was only
        slow then reports again under a new index."""
        index = self.reports_read
        if taken <= index:
            self.hole = None
        elif self.hole is None or self.hole[0] != index:
            self.hole = (index, now)
        elif now - self.hole[1] >= HOLE_S:
            self.store.compare_set(f"ev/{index}", "", _store.HOLE)
            self.hole = None

    def rank_of(self, proc: Proc) -> int | None:
        if self.plan is None:
            return None
        for rank, (slot, inc) in self.plan["members"].items():
            if (slot, inc) == (proc.slot, proc.inc):
                return int(rank)
        return None

    def members(self) -> list[Proc]:
        if self.plan is None:
            return []
        procs = (self.procs.get(slot) for slot, _ in self.plan["members"].values())
        incs = {(slot, inc) for slot, inc in self.plan["members"].values()}
        return [p for p in procs if p is not None and (p.slot, p.inc) in incs]

    def check_heartbeats(self) -> None:
        now = time.monotonic()
        # A member that finished stops beating: it is leaving, not frozen.
        watched = [proc for proc in self.members() if proc.alive and not proc.finished]
        # One round trip for every counter (each is created by its member's first beat;
        # add(key, 0) makes sure it exists before the read).
        # The reports' counter rides along (check_holes).
        keys = [f"hb/{proc.slot}/{proc.inc}" for proc in watched] + ["ev/n"]
        for key in keys:
            if key not in self.hb_keys:
                self.store.add(key, 0)
                self.hb_keys.add(key)
        *counters, taken = self.store.multi_get(keys)
        self.check_holes(int(taken), now)
        for proc, raw in zip(watched, counters, strict=True):
            beats = int(raw)
            if beats != proc.beats:
                proc.beats, proc.beat_t = beats, now
            elif now - proc.beat_t > self.hb_timeout:
                rank = self.rank_of(proc)
                probe.detected(cause="heartbeat_timeout", rank=rank, slot=proc.slot,
                               source="controller", silent_s=round(now - proc.beat_t, 3))
                self.fence(proc)
                self.replan(f"rank {rank} (slot {proc.slot}) silent")
        if self.fail_t is not None and now - self.fail_t > self.hb_timeout:
            # Collectives fail but every member is alive and beating: regroup the same ones.
            self.fail_t = None
            probe.detected(cause="collective_failure_unexplained", source="controller",
                           generation=self.gen)
            self.replan("collective failure with all members alive")

    def check_arrivals(self) -> None:
        """Fence the members still inside an older generation once the current one's start
        line is due.

        One that still beats is stuck in its training loop: a collective that never returns
        (a wedged communicator). A healthy member blocked in a collective of the previous
        generation leaves it within a collective timeout of the call's start, which is why
        the deadline is never shorter than that (``publish`` sets it). A late member that
        has left its generation is on its way (tearing its groups down can take seconds):
        the heartbeat judges it, and this check again later.
        """
        now = time.monotonic()
        if self.join_by is None or now < self.join_by or self.plan is None or self.over:
            return
        self.join_by = None
        members = self.plan["members"]
        if self.plan.get("waiting") or self.store.add(f"arrive/{self.gen}", 0) >= len(members):
            return
        late = []
        for proc in self.members():
            gen, inside = self.whereabouts(proc)
            if not proc.alive or gen >= self.gen:
                continue
            if inside:
                late.append(proc)
            else:  # on its way: its heartbeat judges it meanwhile
                self.join_by = now + self.hb_timeout
        for proc in late:
            probe.detected(cause="join_timeout", rank=self.rank_of(proc), slot=proc.slot,
                           pid=proc.pid, source="controller", generation=self.gen,
                           waited_s=round(now - self.published_t, 3))
            self.fence(proc)
        if late:
            who = ", ".join(f"rank {self.rank_of(p)} (slot {p.slot})" for p in late)
            self.replan(f"{who} never joined generation {self.gen}")

    def whereabouts(self, proc: Proc) -> tuple[int, bool]:
        """(the newest generation whose start line ``proc``'s loop reached, whether it is
        still inside it); (-1, False) for a process that never reached one."""
        key = f"loop/{proc.slot}/{proc.inc}"
        if not _store.has(self.store, key):
            return -1, False
        gen, where = self.store.get(key).decode().split()
        return int(gen), where == "in"

    def fence(self, proc: Proc) -> None:
        """SIGKILL a member, so that it can never wake up and act on stale state. Its
        supervisor sees the death and reports it (and re-forks the slot). A member on another
        node (another PID namespace: its pid names some other process here) is fenced
        through its heartbeat counter instead: if it ever beats again it kills itself; a
        node that died takes its supervisor along, so no report comes, and none is needed."""
        if proc.host == self.host:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        else:
            self.store.set(f"hb/{proc.slot}/{proc.inc}", str(FENCED))
        proc.alive = False

    # -- decisions ------------------------------------------------------------------------

    def replica_slots(self, replica: int) -> list[int]:
        return [rank_slot(self.cfg, replica * self.cfg.shards + s)
                for s in range(self.cfg.shards)]

    def live(self, slot: int) -> bool:
        proc = self.procs.get(slot)
        return proc is not None and proc.alive

    def replay_plan(self, index: int) -> dict[str, Any]:
        assert self.replay is not None
        return self.elastic_plan(self.replay[index]["replicas"])

    def elastic_plan(self, replicas: list[int]) -> dict[str, Any]:
        members = {}
        for replica in replicas:
            for slot in self.replica_slots(replica):
                members[str(slot)] = (slot, self.procs[slot].inc)
        return {"replicas": sorted(replicas), "members": members, "spares": []}

    def maybe_plan(self) -> None:
        """Publish the first plan once the initial members are up; later, add capacity."""
        if self.over:  # a re-forked process arriving after the last step has nothing to join
            return
        if self.plan is None:
            if all(self.live(rank_slot(self.cfg, rank)) for rank in range(self.world)):
                if self.replay is not None:
                    self.publish(self.replay_plan(0), "start (replay)")
                elif self.elastic:
                    self.publish(self.elastic_plan(list(range(self.cfg.replicas))), "start")
                else:
                    self.publish(self.spare_plan({}), "start")
            return
        if self.plan.get("waiting"):
            self.replan("capacity came back")
        elif self.elastic and self.replay is None and self.resumed == self.gen:
            back, _ = self.returning()
            if back:
                plan = self.elastic_plan(sorted(self.plan["replicas"] + back))
                # Planned: members switch at a step boundary agreed through the vote.
                self.publish({**plan, "planned": True}, f"replicas {back} rejoin")

    def returning(self) -> tuple[list[int], list[tuple[Proc, int]]]:
        """Elastic: (the dropped replicas that may come back now, the live processes that
        keep another one out, each with the older generation it is still inside).

        A replica comes back once every one of its slots is alive and out of any older
        generation. One of its processes can still be inside the generation it was dropped
        from: a member wedged in a long computation when its peer died, alive and beating,
        which leaves once its loop returns (``_leave``). Asked back meanwhile, it would keep
        the survivors waiting at the new start line, trained on by nobody, until it comes
        out (3 s in scenarios/training/kill_rank_peer_hung_elastic.yaml); left out, the
        survivors train on without it."""
        assert self.plan is not None
        back, stuck = [], []
        for replica in range(self.cfg.replicas):
            slots = self.replica_slots(replica)
            if replica in self.plan["replicas"] or not all(self.live(s) for s in slots):
                continue
            inside = []
            for slot in slots:
                gen, still = self.whereabouts(self.procs[slot])
                if still and gen < self.gen:
                    inside.append((self.procs[slot], gen))
            if inside:
                stuck.extend(inside)
            else:
                back.append(replica)
        return back, stuck

    def check_rejoins(self) -> None:
        """Elastic, every check: ask back a replica whose members have now left their old
        generation (``returning``), and fence a process kept out of the plan that is still
        inside its old generation past the time a healthy member needs to leave it (the
        start line deadline of the generation that superseded it): it is wedged there, as
        ``check_arrivals`` judges a member, and its slot comes back as a fresh process."""
        if not self.elastic or self.replay is not None or self.plan is None or self.over \
                or self.plan.get("waiting"):
            return
        back, stuck = self.returning()
        now = time.monotonic()
        for proc, gen in stuck:
            since, due = self.superseded.get(gen, (now, now + 1.0))
            if now < due:
                continue
            old = self.plans.get(gen, {}).get("members", {})
            rank = next((int(r) for r, (slot, inc) in old.items()
                         if (slot, inc) == (proc.slot, proc.inc)), None)
            probe.detected(cause="leave_timeout", rank=rank, slot=proc.slot, pid=proc.pid,
                           source="controller", generation=gen,
                           waited_s=round(now - since, 3))
            self.fence(proc)
        if back:
            self.maybe_plan()

    def spare_plan(self, members: dict[str, Any]) -> dict[str, Any]:
        """hot_spare: keep live members, give every vacant logical rank the lowest spare."""
        taken = {slot for slot, _ in members.values()}
        spares = sorted(
            s for s, p in self.procs.items()
            if p.alive and s not in taken
            and (self.plan is not None or is_spare_slot(self.cfg, s))
        )
        new = dict(members)
        for rank in range(self.world):
            if str(rank) in new:
                continue
            if self.plan is None:
                slot = rank_slot(self.cfg, rank)
            elif spares:
                slot = spares.pop(0)
            else:
                return {"waiting": True}
            new[str(rank)] = (slot, self.procs[slot].inc)
        return {"replicas": list(range(self.cfg.replicas)), "members": new, "spares": spares}

    def replan(self, why: str) -> None:
        assert self.plan is not None
        self.fail_t = None
        if self.over:
            # The last step is committed: a new generation would wait for members that
            # finished and left. The job ends once every shard's final parameters are
            # reported (``outcome``).
            return
        if self.replay is not None:
            raise SystemExit(f"replay: unexpected failure ({why}); a replay must be fault-free")
        alive = {
            rank: (slot, inc) for rank, (slot, inc) in self.plan.get("members", {}).items()
            if self.live(slot) and self.procs[slot].inc == inc
        }
        if self.elastic:
            replicas = [
                r for r in range(self.cfg.replicas)
                if all(str(s) in alive or (self.plan.get("waiting") and self.live(s))
                       for s in self.replica_slots(r))
            ]
            if not replicas:
                self.plan = {**self.plan, "waiting": True, "members": alive}
                return
            plan = self.elastic_plan(replicas)
        else:
            plan = self.spare_plan(alive)
            if plan.get("waiting"):
                self.plan = {**self.plan, "waiting": True, "members": alive}
                return
        self.publish(plan, why)

    def publish(self, plan: dict[str, Any], why: str) -> None:
        self.gen += 1
        plan = {**plan, "gen": self.gen, "world": self.world, "why": why}
        self.plan = plan
        for proc in self.procs.values():
            proc.rank = None
        for rank, (slot, inc) in plan["members"].items():
            if slot in self.procs and self.procs[slot].inc == inc:
                self.procs[slot].rank = int(rank)
        self.store.set(f"plan/{self.gen}", json.dumps(plan))
        self.store.set("latest", str(self.gen))
        if self.gen > 0:  # wake whoever still waits at the previous generation's start line
            self.store.set(f"arrived/{self.gen - 1}", "superseded")
        now = time.monotonic()
        for proc in self.members():
            proc.beat_t = now  # a new member gets a full timeout to show its first beat
        # In a planned switch the members first finish their step in the previous generation,
        # where a collective may hold them for up to its timeout; then the heartbeat timeout
        # starts. A replay's switches are planned too.
        timeout = self.cfg.collective_timeout
        wait = self.hb_timeout + timeout if plan.get("planned") or self.replay is not None \
            else max(self.hb_timeout, timeout)
        self.published_t, self.join_by = now, now + wait
        self.plans[self.gen] = plan
        if self.gen > 0:
            self.superseded[self.gen - 1] = (now, now + wait)
        # The snapshot interval goes with it: how many steps a restore from snapshots may
        # lose is judged against what the job ran with (harness checks, `lost_steps`).
        probe.emit("membership", generation=self.gen, replicas=plan["replicas"],
                   members={r: s for r, (s, _) in plan["members"].items()}, why=why,
                   snapshot_every=self.cfg.snapshot_every, source="controller", rank=None)

    def log_resume(self, gen: int, step: int) -> None:
        """Generation ``gen`` synced and resumes after ``step`` (its first member says so)."""
        if self.plan is None or gen != self.gen or self.resumed == self.gen:
            return
        self.resumed = self.gen
        if self.log_path:
            line = {"gen": self.gen, "first_step": step + 1, "replicas": self.plan["replicas"]}
            jsonl.append(self.log_path, jsonl.encode(line))
        self.maybe_plan()

    # -- loop -------------------------------------------------------------------------------

    def run(self, events: queue.Queue[dict[str, Any]]) -> int:
        next_check = 0.0
        while True:
            # Reports arrive through ``events`` the moment they are written (a thread blocks
            # on the next one); between them, wake every check_s for the heartbeats.
            with contextlib.suppress(queue.Empty):
                self.handle(events.get(timeout=max(0.0, next_check - time.monotonic())))
                while True:
                    self.handle(events.get_nowait())
            now = time.monotonic()
            if now >= next_check:
                self.check_heartbeats()
                self.check_arrivals()
                self.check_rejoins()
                next_check = now + self.check_s
            code = self.outcome()
            if code is not None:
                break
        self.store.set("job/end", str(code))
        # Wakes every member still waiting at the start line of a generation that was
        # published just before the training ended (its finished members never come).
        self.store.set(f"arrived/{self.gen}", "superseded")
        # Wakes every process blocked waiting for the next plan (Worker.wait_for_plan).
        self.store.set(f"plan/{self.gen + 1}", json.dumps({"end": True}))
        self.linger(events)
        return code

    def linger(self, events: queue.Queue[dict[str, Any]]) -> None:
        """After the end: keep hosting the store until everyone still alive has seen the end,
        and until every slot has shown up once.

        A slot whose first process starts after a short job ended (seconds of torch import
        on a busy host) would otherwise find no store, and TCPStore waits out its connect
        timeout (120 s, then retries): the job would hang. Everyone alive includes a dead
        member's successor, which reported the death (``successors``) and is on its way to
        the end: without the store its next call fails, its supervisor exits 1, and
        torchrun restarts the whole finished job."""
        now = time.monotonic()
        deadline, late_deadline = now + 10.0, now + LATE_SLOT_S
        while True:
            with contextlib.suppress(queue.Empty):
                while True:
                    ev = events.get_nowait()
                    if ev["type"] == "ready" and ev["slot"] not in self.procs:
                        # Only counted: nothing is planned after the end.
                        self.procs[ev["slot"]] = Proc(ev["slot"], ev["inc"], ev["pid"],
                                                      ev.get("host", self.host))
            now = time.monotonic()
            unseen = self.slots - len(self.procs)
            alive = sum(1 for p in self.procs.values() if p.alive) + len(self.successors)
            seen_end = now > deadline or self.store.add("exited", 0) >= alive
            if seen_end and (unseen <= 0 or now > late_deadline):
                break
            time.sleep(0.01)

    def outcome(self) -> int | None:
        """The job's exit code once it is over, else None. Over: every shard's final
        parameters reported (0), or some shard's can no longer be: every member that could
        report them died or left its generation after the last step (1: the final state of
        that shard is lost with them; hot_spare and elastic write no checkpoints, so the
        launcher's restart computes it again)."""
        if not self.over:
            return None
        shards = set(range(self.cfg.shards))
        if self.finished_shards == shards:
            return 0
        coming = {proc.rank % self.cfg.shards for proc in self.procs.values()
                  if proc.rank is not None and proc.alive and not proc.finished
                  and not proc.left}
        lost = shards - self.finished_shards - coming
        if not lost:
            return None
        print(f"controller: the final parameters of shard(s) {sorted(lost)} were lost: every "
              "member holding them died or failed after the last step", file=sys.stderr)
        return 1


#: How long a taken report index may stay unwritten before the controller fills it.
HOLE_S = 0.5


def _read_reports(host: str, port: int, out: queue.Queue[dict[str, Any]]) -> None:
    """Hand every report (``ev/{i}``, in order) to the controller as soon as it is written:
    a blocking wait on the next key, where polling ``ev/n`` every 2 ms cost ~500 store round
    trips a second on the cores the training ranks share."""
    store = _store.waiter(host, port)
    seen = 0
    while True:
        key = f"ev/{seen}"
        store.wait([key])
        out.put(_store.get_json(store, key))
        seen += 1


def run(cfg: Any, host: str, port: int, slots: int, host_store: bool) -> int:
    """Entry point of the controller process."""
    store = _store.connect(host, port, host_it=host_store)
    # Before the first plan, so every member finds it (it keeps the snapshots in this process).
    snapshots = _snapshots.Server(host)
    store.set("snapshots", snapshots.address)
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(target=_read_reports, args=(host, port, events), daemon=True,
                     name="reports").start()
    return Controller(cfg, store, slots).run(events)
