"""The hot_spare/elastic controller on hand-written timelines: a real in-memory store (torch's
HashStore, the same API as the TCPStore it hosts in a run), real processes to fence, and the
clock in the test's hands. The members' side of the protocol (reference_impl/_store.py) is
played by the test."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _helpers import killed

from aftershock.reference_impl import controller
from aftershock.reference_impl.trainer import TrainConfig

T = 3.0  # collective timeout; the heartbeat timeout defaults to it
TICK = 0.02  # the controller's own check interval


class Job:
    """A controller and the processes it governs. Every live process beats (a member wedged
    in a collective too: its heartbeat is another thread); nothing else happens unless the
    test says so."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, recovery: str,
                 replicas: int, spares: int = 0, shards: int = 1) -> None:
        self.now = 1000.0
        clock = types.SimpleNamespace(monotonic=lambda: self.now, sleep=lambda s: None)
        monkeypatch.setattr(controller, "time", clock)
        self.events_path = tmp_path / "events.jsonl"
        monkeypatch.setenv("AFTERSHOCK_EVENTS", str(self.events_path))
        cfg = TrainConfig(replicas=replicas, shards=shards, recovery=recovery, spares=spares,
                          collective_timeout=T)
        self.store = dist.HashStore()
        slots = replicas * shards + spares
        self.ctl = controller.Controller(cfg, self.store, slots)
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.silent: set[tuple[int, int]] = set()  # processes whose heartbeat stopped
        for slot in range(slots):
            self.start(slot, 1)

    def start(self, slot: int, inc: int) -> None:
        proc = subprocess.Popen(["sleep", "120"])
        self.procs[(slot, inc)] = proc
        self.ctl.handle({"type": "ready", "slot": slot, "inc": inc, "pid": proc.pid})

    def refork(self, slot: int, inc: int) -> None:
        """What the slot's supervisor does once its worker died: a new incarnation reports
        its predecessor's death, then itself ready."""
        self.ctl.handle({"type": "dead", "slot": slot, "inc": inc, "status": -9})
        self.start(slot, inc + 1)

    def member(self, rank: int) -> tuple[int, int]:
        assert self.ctl.plan is not None
        slot, inc = self.ctl.plan["members"][str(rank)]
        return slot, inc

    def arrive(self, rank: int) -> None:
        """``rank`` of the newest plan reaches its start line (Worker.join)."""
        gen = self.ctl.gen
        slot, inc = self.member(rank)
        self.store.set(f"loop/{slot}/{inc}", f"{gen} in")
        self.store.add(f"arrive/{gen}", 1)

    def leave(self, slot: int, inc: int, gen: int) -> None:
        """That process's loop leaves generation ``gen`` (Worker.run, before the teardown)."""
        self.store.set(f"loop/{slot}/{inc}", f"{gen} out")

    def done(self, rank: int) -> None:
        """``rank`` of the newest plan committed the last step and reported its final
        parameters (Worker.finish); from then on it beats no more (it is leaving)."""
        slot, inc = self.member(rank)
        self.ctl.handle({"type": "done", "rank": rank, "slot": slot, "inc": inc})
        self.silent.add((slot, inc))

    def tick(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            for (slot, inc), proc in self.procs.items():
                if proc.poll() is None and (slot, inc) not in self.silent:
                    self.store.add(f"hb/{slot}/{inc}", 1)
            self.now = min(self.now + TICK, end)
            # As Controller.run does every 20 ms.
            self.ctl.check_heartbeats()
            self.ctl.check_arrivals()
            self.ctl.check_rejoins()

    def fenced(self) -> list[tuple[int, int]]:
        return [key for key, proc in self.procs.items() if killed(proc)]

    def detected(self, cause: str | None = None) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        events = [json.loads(line) for line in self.events_path.read_text().splitlines()]
        return [e for e in events if e["event"] == "failure_detected"
                and cause in (None, e["cause"])]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def job_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(**kwargs: Any) -> Job:
        jobs.append(Job(tmp_path, monkeypatch, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def wedge_rank_1(job: Job) -> None:
    """Rank 1 wedges inside a collective of generation 0 and keeps beating; rank 0's
    collective times out, it leaves the generation and says why; after the heartbeat
    timeout without a death or a silence to explain it, the controller regroups the same
    members."""
    job.leave(0, 1, 0)
    job.ctl.handle({"type": "fail", "slot": 0, "inc": 1, "gen": 0, "cause": "collective_timeout"})
    job.tick(T + 2 * TICK)
    assert job.ctl.gen == 1
    assert job.ctl.plan is not None
    assert job.ctl.plan["why"] == "collective failure with all members alive"
    assert (job.member(0), job.member(1)) == ((0, 1), (1, 1))


def test_a_member_that_never_reaches_the_start_line_is_fenced_and_its_rank_goes_to_a_spare(
    job_factory: Any,
) -> None:
    job = job_factory(recovery="hot_spare", replicas=2, spares=1)
    assert job.ctl.gen == 0
    # A slow arrival within the heartbeat timeout is no failure.
    job.arrive(0)
    job.tick(0.9 * T)
    job.arrive(1)
    job.tick(3 * T)
    assert (job.ctl.gen, job.fenced(), job.detected()) == (0, [], [])

    wedge_rank_1(job)
    job.arrive(0)
    job.tick(T - 5 * TICK)
    assert (job.ctl.gen, job.fenced()) == (1, [])
    job.tick(10 * TICK)
    # Fenced as a silent member is: SIGKILL, so it never comes back with stale state.
    assert job.fenced() == [(1, 1)]
    assert job.procs[(1, 1)].wait(timeout=10) == -signal.SIGKILL
    assert [e["cause"] for e in job.detected()] == ["collective_failure_unexplained",
                                                    "join_timeout"]
    (found,) = job.detected("join_timeout")
    assert (found["rank"], found["slot"], found["pid"], found["generation"]) == (
        1, 1, job.procs[(1, 1)].pid, 1)
    assert T <= found["waited_s"] < T + 2 * TICK
    # The spare takes rank 1 at once; rank 0 stays.
    assert job.ctl.gen == 2
    assert (job.member(0), job.member(1)) == ((0, 1), (2, 1))
    # The new generation's members arrive: nothing more is fenced, the old slot comes back
    # as a spare.
    job.arrive(0)
    job.arrive(1)
    job.refork(1, 1)
    job.tick(3 * T)
    assert (job.ctl.gen, job.fenced(), len(job.detected())) == (2, [(1, 1)], 2)
    assert job.ctl.plan is not None
    assert job.ctl.plan["spares"] == []  # published before slot 1 was back


def test_elastic_drops_the_replica_of_a_member_that_never_joins_and_takes_it_back_healed(
    job_factory: Any,
) -> None:
    job = job_factory(recovery="elastic", replicas=2)
    job.arrive(0)
    job.arrive(1)
    job.tick(T)
    wedge_rank_1(job)
    job.arrive(0)
    job.tick(T + 2 * TICK)
    assert job.fenced() == [(1, 1)]
    assert [e["rank"] for e in job.detected("join_timeout")] == [1]
    assert job.ctl.gen == 2
    assert job.ctl.plan is not None
    assert job.ctl.plan["replicas"] == [0]
    job.arrive(0)
    # Slot 1 comes back; replica 1 rejoins at a step boundary once generation 2 resumed.
    job.refork(1, 1)
    job.ctl.handle({"type": "resumed", "gen": 2, "step": 24})  # its first member's report
    job.tick(TICK)
    assert job.ctl.plan["replicas"] == [0, 1]
    assert job.ctl.plan.get("planned") is True
    assert job.ctl.gen == 3


def drop_replica_1_with_rank_2_wedged(job: Job) -> None:
    """2 x 2: rank 2 wedges inside generation 0 (alive, beating) and rank 3, its peer, is
    killed; the controller drops replica 1 at once, ranks 0 and 1 resume without it, and
    slot 3's re-forked process is ready: replica 1's slots are all alive again."""
    for rank in range(4):
        job.arrive(rank)
    job.tick(T)
    job.procs[(3, 1)].kill()
    job.procs[(3, 1)].wait()
    job.refork(3, 1)
    assert job.ctl.gen == 1
    assert job.ctl.plan is not None
    assert job.ctl.plan["replicas"] == [0]
    job.leave(0, 1, 0)
    job.leave(1, 1, 0)
    job.arrive(0)
    job.arrive(1)
    job.ctl.handle({"type": "resumed", "gen": 1, "step": 24})


def test_elastic_asks_a_replica_back_only_once_its_members_left_their_old_generation(
    job_factory: Any,
) -> None:
    """A replica asked back while one of its members is still stuck in an older generation
    makes the survivors stop at the new start line and wait for it (3 s in
    scenarios/training/kill_rank_peer_hung_elastic.yaml). They train on without it until it
    is out; then it rejoins at a step boundary."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    drop_replica_1_with_rank_2_wedged(job)
    job.tick(T / 2)
    assert (job.ctl.gen, job.fenced(), job.detected("leave_timeout")) == (1, [(3, 1)], [])
    job.leave(2, 1, 0)  # released: out of generation 0, on its way to the next plan
    job.tick(2 * TICK)
    assert job.ctl.gen == 2
    assert job.ctl.plan is not None
    assert job.ctl.plan["replicas"] == [0, 1]
    assert job.ctl.plan.get("planned") is True
    assert (job.member(2), job.member(3)) == ((2, 1), (3, 2))
    assert job.fenced() == [(3, 1)]


def test_elastic_fences_a_left_out_member_that_never_leaves_its_old_generation(
    job_factory: Any,
) -> None:
    """A member left out of the plan but still inside its old generation past the time a
    healthy member needs to leave it (the heartbeat timeout, never less than the collective
    timeout) is wedged there: fenced like one that never reaches a start line, and its
    replica comes back with the slot's fresh process."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    drop_replica_1_with_rank_2_wedged(job)
    job.tick(T - 5 * TICK)
    assert (job.ctl.gen, job.fenced()) == (1, [(3, 1)])
    job.tick(10 * TICK)
    assert job.fenced() == [(2, 1), (3, 1)]
    (found,) = job.detected("leave_timeout")
    # Its rank is the one it held in the generation it is stuck in.
    assert (found["rank"], found["slot"], found["pid"], found["generation"]) == (
        2, 2, job.procs[(2, 1)].pid, 0)
    assert T <= found["waited_s"] < T + 2 * TICK
    assert job.ctl.gen == 1
    job.refork(2, 1)
    job.tick(TICK)
    assert job.ctl.gen == 2
    assert job.ctl.plan is not None
    assert job.ctl.plan["replicas"] == [0, 1]
    assert (job.member(2), job.member(3)) == ((2, 2), (3, 2))


def test_a_planned_switch_gives_members_a_collective_timeout_more_to_arrive(
    job_factory: Any,
) -> None:
    """In a planned switch the members of the previous generation finish their step there
    first, where a collective may block them for up to the collective timeout before they
    fail over: only then does the heartbeat timeout start."""
    job = job_factory(recovery="elastic", replicas=2)
    job.arrive(0)
    job.arrive(1)
    job.tick(T)
    # Replica 1 drops out (a death), rejoins healed: a planned generation.
    job.procs[(1, 1)].kill()
    job.procs[(1, 1)].wait()
    job.refork(1, 1)
    assert (job.ctl.gen, job.ctl.plan is not None and job.ctl.plan["replicas"]) == (1, [0])
    job.arrive(0)
    job.ctl.handle({"type": "resumed", "gen": 1, "step": 10})  # its first member's report
    job.tick(TICK)
    assert job.ctl.gen == 2
    job.arrive(1)  # the returning member waits at the start line; rank 0 is still training
    job.tick(T + T - 5 * TICK)
    assert (job.ctl.gen, job.fenced()) == (2, [(1, 1)])
    job.tick(10 * TICK)
    assert job.fenced() == [(0, 1), (1, 1)]
    assert [e["rank"] for e in job.detected("join_timeout")] == [0]


def test_a_late_member_on_its_way_between_generations_is_not_fenced(job_factory: Any) -> None:
    """A frozen member is fenced for silence; its peers' collectives time out about then, and
    tearing down their broken groups can take seconds on a loaded host (Gloo destroys them
    holding the GIL). Late at the new start line but out of their old generation, they are
    on their way: the arrival check leaves them to their heartbeat."""
    job = job_factory(recovery="hot_spare", replicas=2, spares=1)
    job.arrive(0)
    job.arrive(1)
    job.tick(T)
    # Rank 1 freezes: it stops beating ...
    job.silent.add((1, 1))
    job.tick(T + 2 * TICK)
    assert [e["cause"] for e in job.detected()] == ["heartbeat_timeout"]
    assert (job.ctl.gen, job.member(1)) == (1, (2, 1))
    # ... rank 0 leaves generation 0 and is still tearing it down long after the deadline.
    job.leave(0, 1, 0)
    job.arrive(1)
    job.tick(2 * T)
    assert (job.ctl.gen, job.fenced()) == (1, [(1, 1)])
    job.arrive(0)
    job.tick(2 * T)
    assert (job.ctl.gen, job.fenced(), len(job.detected())) == (1, [(1, 1)], 1)


# --- after the last step (scenarios/explore/found/kill_before_params_elastic.yaml) ----------


@pytest.mark.parametrize("recovery", ["elastic", "hot_spare"])
def test_a_member_killed_after_another_finished_starts_no_generation(
    job_factory: Any, recovery: str,
) -> None:
    """Rank 1 reported its final parameters and left; rank 0, which committed the same last
    step, dies before reporting its own. The death is detected, but a new generation would
    wait for rank 1, which is gone (elastic hung there until the harness's deadline): the
    job ends, as replica 1 holds the one shard's final parameters."""
    job = job_factory(recovery=recovery, replicas=2, spares=1 if recovery == "hot_spare" else 0)
    job.arrive(0)
    job.arrive(1)
    assert job.ctl.outcome() is None
    job.done(1)
    job.refork(0, 1)
    assert [e["cause"] for e in job.detected()] == ["process_exit"]
    # rank 1 beats no more and never arrives anywhere: it finished, it is not fenced.
    job.tick(3 * T)
    assert (job.ctl.gen, job.fenced()) == (0, [])
    assert job.ctl.outcome() == 0


def test_a_member_killed_after_it_finished_is_no_failure(job_factory: Any) -> None:
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job.arrive(rank)
    job.done(0)
    job.refork(0, 1)  # killed on its way out, after its done
    job.tick(T)
    assert (job.ctl.gen, job.detected(), job.ctl.outcome()) == (0, [], None)
    job.done(1)
    assert job.ctl.outcome() == 0


def test_the_job_waits_for_a_shard_only_as_long_as_someone_can_report_it(
    job_factory: Any,
) -> None:
    """2 replicas x 2 shards: rank 1 reported shard 1; shard 0's holders are ranks 0 and 2.
    Rank 0 dies: rank 2 can still report shard 0, so the job waits for it. Rank 2's last
    collective then fails (its peer died in the vote): nobody can report shard 0 any more,
    its final state is lost with rank 0, and the job fails rather than end without it."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job.arrive(rank)
    job.done(1)
    job.refork(0, 1)
    assert (job.ctl.gen, job.ctl.outcome()) == (0, None)
    job.leave(2, 1, 0)
    job.ctl.handle({"type": "fail", "slot": 2, "inc": 1, "gen": 0, "cause": "collective_error"})
    job.tick(2 * T)
    assert job.ctl.gen == 0
    assert job.ctl.outcome() == 1


def test_the_last_holder_of_a_shard_reporting_ends_the_job(job_factory: Any) -> None:
    job = job_factory(recovery="hot_spare", replicas=2, shards=2, spares=2)
    for rank in range(4):
        job.arrive(rank)
    job.done(1)
    job.refork(0, 1)
    job.refork(3, 1)
    # A re-forked worker arriving after the last step is given nothing to join.
    assert (job.ctl.gen, job.ctl.outcome()) == (0, None)
    job.done(2)
    assert job.ctl.outcome() == 0


def test_a_death_before_any_member_finished_still_starts_a_generation(job_factory: Any) -> None:
    job = job_factory(recovery="elastic", replicas=2)
    job.arrive(0)
    job.arrive(1)
    job.refork(0, 1)
    assert job.ctl.gen == 1
    assert job.ctl.plan is not None
    assert job.ctl.plan["replicas"] == [1]
    assert job.ctl.outcome() is None


def test_a_member_past_the_last_step_ends_the_training_before_its_parameters(
    job_factory: Any,
) -> None:
    """Rank 0 completes the last step, says so (``last``, Worker.finish), and is killed
    before it reports its final parameters; its standby reports the death at once, before
    any member's ``done``. The training is over all the same: no generation may start (its
    members would wait for ranks on their way out; once the standby reported deaths within
    ~15 ms, the death came first in a clean-clone run of
    scenarios/explore/found/kill_before_params_elastic.yaml, 2026-12-05), and the job ends
    once every shard's parameters are in."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job.arrive(rank)
    job.ctl.handle({"type": "last", "rank": 0, "slot": 0, "inc": 1})
    job.refork(0, 1)  # killed at the finish fault point; its standby reports it
    job.tick(2 * T)
    assert job.ctl.gen == 0
    assert [e["after_last_step"] for e in job.detected("process_exit")] == [True]
    assert job.ctl.outcome() is None  # shards 0 and 1 still have members to report them
    job.done(2)
    job.done(1)
    assert job.ctl.outcome() == 0


def test_a_death_reported_for_a_later_incarnation_is_the_death_of_the_known_one(
    job_factory: Any,
) -> None:
    """Slot 1's worker (incarnation 1) dies; its standby (incarnation 2) is woken but killed
    before it reports; the fresh fork after it reports incarnation 2 dead. Incarnation 1
    is then dead too (a supervisor forks or wakes incarnation k + 1 only once k died): the
    controller must take it as the death of rank 1 at once, not wait for the collective
    failures to go unexplained (tests/test_standby.py, the standby killed after its wake)."""
    job = job_factory(recovery="hot_spare", replicas=2, spares=1)
    job.arrive(0)
    job.arrive(1)
    job.ctl.handle({"type": "dead", "slot": 1, "inc": 2, "status": -9})
    deaths = job.detected("process_exit")
    assert [(e["rank"], e["slot"]) for e in deaths] == [(1, 1)]
    assert deaths[0]["status"] is None  # incarnation 1's own status was never reported
    assert job.ctl.gen == 1
    assert job.ctl.plan is not None
    assert job.member(1) == (2, 1)  # the spare
    # A death of an incarnation older than the one known changes nothing.
    job.start(1, 3)
    job.ctl.handle({"type": "dead", "slot": 1, "inc": 2, "status": -9})
    assert (len(job.detected("process_exit")), job.ctl.gen) == (1, 1)


def _linger(job: Job, monkeypatch: pytest.MonkeyPatch, *, successor_exits_at: float | None
            ) -> float:
    """Run the controller's wait after the end (``Controller.linger``) on the test's clock;
    the successor of a dead member, if any, sees the end and leaves ``successor_exits_at``
    seconds in, as Worker.run does (``exited``). Returns how long the store was kept."""
    start = job.now

    def sleep(seconds: float) -> None:
        before = job.now - start
        job.now += seconds
        if successor_exits_at is not None and before < successor_exits_at <= job.now - start:
            job.store.add("exited", 1)

    monkeypatch.setattr(controller.time, "sleep", sleep)
    job.ctl.linger(queue.Queue())
    return job.now - start


def test_the_store_outlives_the_end_until_a_dead_members_successor_has_seen_it(
    job_factory: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 dies at its last step, before its final parameters; the others report theirs
    and leave. Rank 0's successor reported the death, so it is on its way to the store
    (Worker.run: wait for a plan, see the end, leave). The controller must host the store
    until it has seen the end: gone, the successor's next store call fails, its supervisor
    exits 1, and torchrun restarts the whole finished job (scenarios/explore/found/
    kill_before_params_elastic.yaml did, once the successor reported within ~15 ms)."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job.arrive(rank)
    for rank in (1, 2, 3):
        job.done(rank)
    job.ctl.handle({"type": "dead", "slot": 0, "inc": 1, "status": -9})  # its successor
    assert job.ctl.outcome() == 0
    job.store.add("exited", 3)  # the three that finished saw the end and left
    kept = _linger(job, monkeypatch, successor_exits_at=0.5)
    assert 0.5 <= kept < 1.0
    # The successor's ready comes in before the end: it counts as the slot's process.
    job2 = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job2.arrive(rank)
    for rank in (1, 2, 3):
        job2.done(rank)
    job2.refork(0, 1)
    job2.store.add("exited", 3)
    kept = _linger(job2, monkeypatch, successor_exits_at=0.3)
    assert 0.3 <= kept < 1.0


def test_without_a_successor_the_store_goes_once_everyone_alive_saw_the_end(
    job_factory: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that reported its final parameters and was killed on its way out told its
    supervisor it had left: no successor, no report. The others' exits are enough."""
    job = job_factory(recovery="elastic", replicas=2, shards=2)
    for rank in range(4):
        job.arrive(rank)
    for rank in range(4):
        job.done(rank)
    job.store.add("exited", 4)
    assert _linger(job, monkeypatch, successor_exits_at=None) < 0.1



class _Stopped(Exception):
    """Ends the report reader of the test below (raised by its queue once closed)."""


class _ClosableQueue(queue.Queue):  # type: ignore[type-arg]
    closed = False

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if self.closed:
            raise _Stopped
        super().put(item, block, timeout)


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dist.Store, Any]]:
    """A real TCPStore hosted here, as the controller hosts it, and the controller's report
    reader on its own connection, in a thread. The thread ends before the store does: a
    hosted store destroyed under a blocked reader aborts the interpreter (``terminate
    called without an active exception``, exit status 134)."""
    from aftershock.reference_impl import _store

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = _store.connect("127.0.0.1", port, host_it=True)
    out = _ClosableQueue()

    def read() -> None:
        with contextlib.suppress(_Stopped):
            controller._read_reports("127.0.0.1", port, out)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    yield store, out
    out.closed = True
    # Whatever index the reader waits on, it is written now: it reads it and stops.
    for index in range(store.add("ev/n", 1)):
        if not store.check([f"ev/{index}"]):
            store.set(f"ev/{index}", _store.HOLE)
    thread.join(timeout=10)
    assert not thread.is_alive(), "the report reader did not stop"
    del store


def test_a_reporter_killed_between_its_index_and_its_report_does_not_silence_the_rest(
    job_factory: Any, reader: tuple[dist.Store, Any],
) -> None:
    """Found in `make test-scenarios` (explore/hot_spare): a rank SIGKILLed inside
    ``_store.report``, after it took index n and before it wrote ``ev/n``, left the
    controller's reader waiting on ``ev/n`` for ever. Every later report (deaths, ``done``)
    went unread; the job trained to its end and never ended. The controller fills such a
    hole once it has stayed empty for ``HOLE_S`` while a later index was taken, and a
    reporter that was only slow finds its index filled and reports again under a new one:
    nothing is lost, and the reader never waits on a dead writer."""
    from aftershock.reference_impl import _store

    store, out = reader
    job = job_factory(recovery="hot_spare", replicas=2, spares=1)
    job.ctl.store = store  # the controller's own connection to the job's store
    job.ctl.reports_read = 0  # the Job's own "ready"s did not come through the store

    def handle_all() -> list[dict[str, Any]]:
        got = []
        while not out.empty():
            got.append(out.get())
            job.ctl.handle(got[-1])
        return got

    _store.report(store, type="resumed", gen=0, step=0)
    first = out.get(timeout=5)
    job.ctl.handle(first)
    assert first["type"] == "resumed"
    hole = store.add("ev/n", 1) - 1  # what the killed reporter did, and no more
    _store.report(store, type="fail", slot=1, inc=1, gen=0)
    job.ctl.check_heartbeats()
    assert handle_all() == []  # the reader waits on the hole
    job.now += controller.HOLE_S / 2
    job.ctl.check_heartbeats()
    assert handle_all() == []  # not yet: a reporter may only be slow
    job.now += controller.HOLE_S
    job.ctl.check_heartbeats()
    deadline = time.monotonic() + 10
    got: list[dict[str, Any]] = []
    while len(got) < 2 and time.monotonic() < deadline:
        got += handle_all()
        time.sleep(0.01)
    assert [e["type"] for e in got] == ["hole", "fail"], got
    assert _store.get_json(store, f"ev/{hole}") == {"type": "hole"}

    # A slow reporter whose index was filled meanwhile: its write does not replace the
    # filler (the reader has passed it), and its report goes under a new index.
    slow = store.add("ev/n", 1) - 1
    job.now += 2 * controller.HOLE_S
    job.ctl.check_heartbeats()
    job.now += 2 * controller.HOLE_S
    job.ctl.check_heartbeats()
    assert _store.get_json(store, f"ev/{slow}") == {"type": "hole"}
    assert not _store.claim(store, slow, json.dumps({"type": "done"}))
    assert _store.get_json(store, f"ev/{slow}") == {"type": "hole"}
    _store.report(store, type="done", rank=0, slot=0, inc=1)
    deadline = time.monotonic() + 10
    got = []
    while not any(e["type"] == "done" for e in got) and time.monotonic() < deadline:
        got += handle_all()
        time.sleep(0.01)
    assert [e["type"] for e in got] == ["hole", "done"], got
    assert job.ctl.outcome() == 0  # the job ends: its one shard's parameters were reported
