"""Run the benchmark: launch every row, SIGKILL one rank mid-run, time it from step events.

One job per row and repetition: the row trains failure-free up to ``kill_at`` steps (its
steps/s come from those steps, after a warm-up), then the bench SIGKILLs global rank 3
(replica 1, shard 1) as soon as that rank reports step ``kill_at``, and stops the job once
every rank has committed a step again (or at a deadline). Rows run one after another inside a
repetition, so the loaded, shared machine slows them alike and the ratios stay comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftershock.harness.oracle import read_membership as oracle_membership
from aftershock.harness.run.records import Event
from aftershock.harness.verdict import metrics
from aftershock.reference_impl import phases as phases_lib
from bench.oracle import expected as expected_digests
from bench.peers import GPU, PEERS, WORLD, Context, Model, Peer
from bench.stats import run_order, verdict
from bench.status import code_identity

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MARKER_ENV = "AFTERSHOCK_BENCH_MARKER"
KILL_RANK = Model().kill_rank  # 3: replica 1, shard 1 (`--gpu`: rank 0, the only one)


@dataclass(frozen=True, slots=True)
class Settings:
    repeat: int
    kill_at: int  # failure-free steps before the kill; the rate window ends here. FULL: 300,
    #              ~4.5 s of rates (at 100, ~1.3 s windows moved row medians by 5 points)
    warmup: int  # steps left out of the rate (process start, first quorum, allocator)
    deadline_s: float  # per job: give up on start, then on recovery, after this long
    after: int  # a faulted job trains this many steps past kill_at, then its params are checked


FULL = Settings(repeat=3, kill_at=300, warmup=20, deadline_s=120.0, after=20)
QUICK = Settings(repeat=1, kill_at=70, warmup=10, deadline_s=90.0, after=15)
SETTLE_S = 0.5  # a job without a fixed end runs this long past full strength, then stops
CPU_TAIL = 5  # the CPU window ends this many steps before kill_at (the job's own end)


# ---------------------------------------------------------------------------------------------
# Processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _marked_pids(marker: str) -> list[int]:
    """Every live process that carries this bench run's marker in its environment."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (/proc/PID/stat, fields 14-15)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmd(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in argv if a)


# Threads told apart by the name the kernel has for them (/proc/PID/task/TID/comm): Gloo's
# transport (one epoll loop per device: reads and writes every collective's bytes) and its
# work threads (run each collective's algorithm); a process's first thread is "main" (the
# training loop), any other is "other threads" (the trainer's heartbeat, snapshot sender
# and plan watcher, the TCPStore client's, the interpreter's).
THREAD_KINDS = {"gloo_tcp_loop": "gloo transport", "pt_gloo_runloop": "gloo work"}
THREAD_ORDER = ("main", "gloo transport", "gloo work", "other threads")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the live threads of ``pid``, by kind (``THREAD_ORDER``)."""
    found: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # ended between the listing and the read
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[-1].split()
        kind = "main" if int(tid) == pid else THREAD_KINDS.get(comm, "other threads")
        found[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return dict(found)


def cpu_sample(marker: str) -> dict[int, tuple[float, str, dict[str, float]]]:
    """pid -> (CPU seconds so far, command line, the same by kind of thread) for every
    process of the job."""
    found = {}
    for pid in _marked_pids(marker):
        cpu = _cpu_seconds(pid)
        if cpu is not None:
            found[pid] = (cpu, _cmd(pid), thread_cpu(pid))
    return found


def kill_marked(marker: str) -> None:
    for pid in _marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def accepted_strategies() -> dict[str, str | None]:
    """Which reference-trainer strategies exist: None if accepted, else argparse's complaint."""
    found: dict[str, str | None] = {}
    for name in ("hot_spare", "elastic"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "aftershock.reference_impl.trainer",
                f"--recovery={name}",
                "--help",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        lines = done.stderr.strip().splitlines()
        found[name] = None if done.returncode == 0 else (lines[-1] if lines else "rejected")
    return found


class EventTail:
    """Reads the job's events file as it grows; keeps whole lines only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.events: list[Event] = []

    def poll(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        new = []
        for line in lines:
            try:
                new.append(Event.from_json(json.loads(line)))
            except (ValueError, KeyError):
                continue
        self.events.extend(new)
        return new


def _append_event(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def run_job(
    peer: Peer,
    settings: Settings,
    model: Model,
    marker: str,
    keep: Path | None,
    oracle_cache: dict[str, dict[int, str]] | None = None,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"aftershock-bench-{peer.name}-"))
    events_path = workdir / "events.jsonl"
    # A faulted job trains a fixed number of steps past the kill and ends by itself, so its
    # final parameters can be held to the oracle's (a fast recovery that is wrong fails).
    steps = settings.kill_at + settings.after if peer.fault else settings.kill_at
    if peer.fault and not peer.fixed_end:
        steps = 1_000_000  # stopped by the bench once back at full strength (Peer.fixed_end)
    ctx = Context(model=model, steps=steps, workdir=workdir, lighthouse_port=_free_port())
    base_env = {
        **os.environ,
        MARKER_ENV: marker,
        "AFTERSHOCK_EVENTS": str(events_path),
        "AFTERSHOCK_OUTPUT_DIR": str(workdir / "out"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        # A restart attempt would otherwise be wasted on stale Gloo addresses (DESIGN.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # The loops that time their phases (reference_impl/phases.py) do it over the CPU
        # window: rank 0's steps warmup + 1 to kill_at - CPU_TAIL.
        phases_lib.ENV: f"{settings.warmup}:{settings.kill_at - CPU_TAIL}",
    }
    procs: list[subprocess.Popen[bytes]] = []
    tail = EventTail(events_path)
    kill_watch = KillWatch(settings.kill_at, model.kill_rank)
    t_kill: float | None = None
    outcome = "completed"
    # CPU of every process of the job at rank 0's step `warmup` and `kill_at - CPU_TAIL`:
    # what a failure-free step costs, by process, whatever else loads the machine.
    cpu: dict[int, dict[int, tuple[float, str, dict[str, float]]]] = {}
    cpu_marks = (settings.warmup, settings.kill_at - CPU_TAIL)
    t0 = time.monotonic()
    try:
        for cmd in peer.commands(ctx):
            log = (workdir / f"{cmd.name}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    cmd.argv,
                    cwd=REPO,
                    env={**base_env, **cmd.env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
            if cmd.name == "lighthouse":
                time.sleep(0.2)  # let it bind before the replica groups dial it
        names = [c.name for c in peer.commands(ctx)]
        workers = [p for p, n in zip(procs, names, strict=True) if n != "lighthouse"]
        while True:
            time.sleep(0.005)
            new = tail.poll()
            for mark in cpu_marks:
                if mark not in cpu and any(
                    e.event == "step" and e.rank == 0 and e.fields.get("step") == mark for e in new
                ):
                    cpu[mark] = cpu_sample(marker)
            if t_kill is None and peer.fault:
                pid = kill_watch.feed(new)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
                    _append_event(
                        events_path,
                        {
                            "t": t_kill,
                            "event": "fault_injected",
                            "source": "bench",
                            "rank": model.kill_rank,
                            "pid": pid,
                            "kind": "process.kill",
                        },
                    )
            elif t_kill is not None and not peer.fixed_end:
                recovered = full_strength(tail.events, t_kill, peer, world=model.world)
                if recovered is not None and time.monotonic() > t_kill + recovered + SETTLE_S:
                    outcome = "recovered"
                    break
            if all(p.poll() is not None for p in workers):
                codes = [p.returncode for p in workers]
                outcome = "completed" if not any(codes) else f"exited {codes}"
                break
            # The deadline counts from the start, then again from the kill: a loaded machine
            # may spend a minute just starting the job.
            if time.monotonic() - (t0 if t_kill is None else t_kill) > settings.deadline_s:
                outcome = "deadline"
                break
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        kill_marked(marker)
        for p in procs:
            p.wait()
    time.sleep(0.05)
    tail.poll()
    result = analyse(tail.events, settings, t_kill, peer, world=model.world)
    result.update(outcome=outcome, wall_s=round(time.monotonic() - t0, 2))
    result.update(cpu_profile(tail.events, cpu, cpu_marks))
    result["phases"] = phase_profile(tail.events, cpu_marks, world=model.world)
    # Every row that trains to a fixed step, faulted or not: a fast recovery that is wrong,
    # or a cheap failure-free run that skipped work (or a baseline that trained something
    # else), must not look good.
    if peer.fixed_end:
        result.update(check_params(peer, tail.events, workdir / "out", model, steps, oracle_cache))
    if keep is not None:
        dest = keep / peer.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in [*workdir.glob("*.log"), events_path, *workdir.glob("out/*.jsonl")]:
            (dest / f.name).write_bytes(f.read_bytes())
    subprocess.run(["rm", "-rf", str(workdir)], check=False)
    return result


class KillWatch:
    """When to kill, and whom: the newest non-spare process that says it is ``rank``, once
    that rank reported step ``kill_at``. Fed each poll's new events only, so a poll costs the
    same at step 300 as at step 1 (the bench polls every 5 ms on the job's own cores, and only
    for the faulted rows: a rescan of every event so far charged them alone a CPU cost that
    grew with the job)."""

    def __init__(self, kill_at: int, rank: int = KILL_RANK) -> None:
        self.kill_at = kill_at
        self.rank = rank
        self.reached = False
        self.pid: int | None = None  # the newest non-spare process of `rank` said so far

    def feed(self, new: list[Event]) -> int | None:
        for e in new:
            if e.rank != self.rank:
                continue
            if e.event == "hello" and e.fields.get("role") != "spare":
                self.pid = int(e.fields["pid"])
            elif e.event == "step" and e.fields.get("step", 0) >= self.kill_at:
                self.reached = True
        return self.pid if self.reached else None


# ---------------------------------------------------------------------------------------------
# CPU by process, and correctness


def _roles(events: list[Event]) -> dict[int, str]:
    """pid -> what the process is, from what it said on the timeline."""
    roles: dict[int, str] = {}
    for e in events:
        pid = e.fields.get("pid")
        if not isinstance(pid, int):
            continue
        # What it was first: a spare promoted after the kill was a spare in the window.
        if e.event == "hello":
            roles.setdefault(pid, "spare" if e.fields.get("role") == "spare" else "rank")
        elif e.event == "membership" and e.source == "controller":
            roles.setdefault(pid, "controller")
    return roles


def cpu_profile(
    events: list[Event],
    cpu: dict[int, dict[int, tuple[float, str, dict[str, float]]]],
    marks: tuple[int, int],
) -> dict[str, Any]:
    """CPU milliseconds per step between the two marks, in all, by kind of process, and the
    ranks' by kind of thread (all ranks together).

    Only processes alive at both marks count (a failure-free window: nobody dies in it).
    Ranks, spares and the controller name themselves in their events; the rest is told
    apart by its command line (torchrun's agent, torchft's lighthouse) or is a supervisor
    (hot_spare/elastic: the torchrun worker that forks the rank and outlives it). A thread
    that ended inside the window leaves its CPU in the process's total only."""
    first, last = (cpu.get(m) for m in marks)
    if not first or not last:
        return {"cpu_ms_per_step": None, "cpu_by_role": None, "cpu_rank_threads": None}
    roles = _roles(events)
    steps = marks[1] - marks[0]
    by_role: dict[str, float] = defaultdict(float)
    by_thread: dict[str, float] = defaultdict(float)
    for pid, (end, cmd, threads) in last.items():
        if pid not in first:
            continue
        if roles.get(pid) == "rank":
            before = first[pid][2]
            for kind, seconds in threads.items():
                if kind in before:
                    by_thread[kind] += max(0.0, seconds - before[kind]) * 1e3 / steps
        role = roles.get(pid)
        if role is None:
            if "torch.distributed.run" in cmd:
                role = "torchrun agent"
            elif "lighthouse" in cmd:
                role = "lighthouse"
            elif "aftershock.reference_impl.trainer" in cmd:
                role = "supervisor"
            else:
                role = "other"
        by_role[role] += (end - first[pid][0]) * 1e3 / steps
    total = sum(by_role.values())
    return {
        "cpu_ms_per_step": total,
        "cpu_by_role": {k: round(v, 3) for k, v in sorted(by_role.items())},
        "cpu_rank_threads": {k: round(v, 3) for k, v in sorted(by_thread.items())},
    }


PHASE_ORDER = (
    "batch",
    "forward",
    "zero_grad",
    "backward",
    "average",
    "vote",
    "optimizer",
    "straggler figures",
    "fingerprints",
    "snapshot",
    "checkpoint",
    "rest",
)


def _in_phase_order(names: Any) -> list[str]:
    """The phase names in the loop's order (PHASE_ORDER), any other after them by name."""
    return sorted(
        set(names),
        key=lambda n: (PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER), n),
    )


def phase_profile(
    events: list[Event], marks: tuple[int, int], *, world: int = WORLD
) -> dict[str, Any] | None:
    """Where a failure-free step goes, from the ranks' ``phases`` events (their training
    loops' lap timers over the CPU window, reference_impl/phases.py): per phase, rank 0's
    wall time and all ranks' main-thread CPU, in ms per step.

    None, not measured, unless every rank of the world reported the same window once: a
    phase table missing a rank would understate the CPU, and one from another window would
    not be this row's failure-free step."""
    reports: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.event != phases_lib.EVENT or e.rank is None:
            continue
        if (e.fields.get("first"), e.fields.get("last")) != marks or e.rank in reports:
            return None
        reports[e.rank] = e.fields
    if sorted(reports) != list(range(world)):
        return None
    steps = marks[1] - marks[0]
    table: dict[str, dict[str, float]] = {}
    for name in _in_phase_order(n for r in reports.values() for n in r["phases"]):
        wall = reports[0]["phases"].get(name, {}).get("wall_ns", 0)
        cpu = sum(r["phases"].get(name, {}).get("cpu_ns", 0) for r in reports.values())
        table[name] = {
            "wall_ms": round(wall / 1e6 / steps, 4),
            "cpu_ms": round(cpu / 1e6 / steps, 4),
        }
    return table


def _final_digests(events: list[Event]) -> dict[int, str]:
    """rank -> the digest of its final parameters (the last ``params`` event it sent)."""
    found: dict[int, str] = {}
    for e in events:
        if e.event == "params" and e.rank is not None and isinstance(e.fields.get("digest"), str):
            found[e.rank] = e.fields["digest"]
    return found


def check_params(
    peer: Peer,
    events: list[Event],
    out: Path,
    model: Model,
    steps: int,
    cache: dict[str, dict[int, str]] | None,
) -> dict[str, Any]:
    """``params_match``: every rank's final digest equals the oracle's for the membership
    the job trained with (True/False), or None with the reason when not observed."""
    got = _final_digests(events)
    if not got:
        return {"params_match": None, "params_note": "not observed: no final params reported"}
    if peer.name == "elastic":
        try:
            schedule = [
                [g.first_step, list(g.replicas)]
                for g in oracle_membership(out / "membership.jsonl")
            ]
        except (OSError, ValueError) as exc:
            return {"params_match": None, "params_note": f"not observed: {exc}"}
    else:
        schedule = [[1, list(range(model.replicas))]]
    shape = {
        "replicas": model.replicas,
        "shards": model.shards,
        "d_model": model.d_model,
        "hidden": model.hidden,
        "blocks": model.blocks,
        "batch_size": model.batch_size,
    }
    try:
        want = expected_digests(
            shape, 0, steps, schedule, cache, device="cuda" if model.backend == "nccl" else "cpu"
        )
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"params_match": None, "params_note": f"not observed: oracle failed ({exc})"}
    missing = sorted(set(want) - set(got))
    if missing:
        return {
            "params_match": None,
            "params_note": f"not observed: ranks {missing} reported no final params",
        }
    wrong = sorted(r for r in want if got[r] != want[r])
    if wrong:
        shown = ", ".join(f"rank {r}: {got[r][:12]} != {want[r][:12]}" for r in wrong)
        return {
            "params_match": False,
            "params_note": f"ranks {wrong} differ from the oracle ({shown})",
        }
    return {
        "params_match": True,
        "params_note": f"{len(want)} ranks equal the oracle (schedule {schedule})",
    }


# ---------------------------------------------------------------------------------------------
# Metrics (from the job's timeline; definitions in docs/metrics.md and docs/benchmarks.md)


def full_strength(
    events: list[Event], t_kill: float, peer: Peer | None = None, *, world: int = WORLD
) -> float | None:
    """Kill -> the first step every rank committed after the detection.

    Ours and torchrun's: ``time_to_recover`` (docs/metrics.md), which also needs those
    commits to come from one world (one generation). torchft's two replica groups are two
    torchruns, each with its own restart count, so its ranks never name one generation: for
    its rows, the first step number that all ``world`` ranks committed after the detection, at
    the time the last of them did."""
    if peer is None or peer.fixed_end:
        return metrics.time_to_recover(events, world)
    t_from = t_kill + (metrics.time_to_detect(events) or 0.0)
    ranks: dict[int, set[int]] = defaultdict(set)
    last: dict[int, float] = {}
    for e in events:
        step = e.fields.get("step")
        if e.event != "step" or e.t <= t_from or e.rank is None or not isinstance(step, int):
            continue
        ranks[step].add(e.rank)
        last[step] = max(last.get(step, e.t), e.t)
        if len(ranks[step]) == world:
            return last[step] - t_kill
    return None


def analyse(
    events: list[Event],
    settings: Settings,
    t_kill: float | None,
    peer: Peer | None = None,
    *,
    world: int = WORLD,
) -> dict[str, Any]:
    out: dict[str, Any] = {"steps_per_s": _rate(events, settings, t_kill, world)}
    if t_kill is None:
        return out
    after = [e for e in events if e.t >= t_kill]
    detect = metrics.time_to_detect(events)
    t_from = t_kill + (detect or 0.0)
    resumed = next((e.t for e in after if e.event == "step" and e.t > t_from), None)
    redone: dict[int, int] = defaultdict(int)
    best: dict[int, int] = {}
    for e in events:  # a step committed again, or an attempt thrown away, is a lost step
        rank = e.rank if e.rank is not None else 0
        step = e.fields.get("step")
        if not isinstance(step, int):
            continue
        if e.event == "step":
            if rank in best and step <= best[rank]:
                redone[rank] += 1
            best[rank] = max(best.get(rank, step), step)
        elif e.event == "step_discarded" and e.t >= t_kill:
            redone[rank] += 1
    out.update(
        detect_s=detect,
        resume_s=None if resumed is None else resumed - t_kill,
        full_s=full_strength(events, t_kill, peer, world=world),
        lost_steps=max(redone.values(), default=0),
        restarts=metrics.generations(events),
    )
    return out


def _rate(
    events: list[Event], settings: Settings, t_kill: float | None, world: int = WORLD
) -> float | None:
    """Failure-free steps/s of rank 0 over (warmup, kill_at], at full strength only."""
    times = [
        e.t
        for e in events
        if e.event == "step"
        and e.rank == 0
        and (t_kill is None or e.t < t_kill)
        and settings.warmup < e.fields.get("step", 0) <= settings.kill_at
        and e.fields.get("world", world) >= world
    ]
    if len(times) < 2:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


# ---------------------------------------------------------------------------------------------
# Summary


METRICS = (
    "steps_per_s",
    "overhead",
    "cpu_ms_per_step",
    "cpu_overhead",
    "detect_s",
    "resume_s",
    "full_s",
    "lost_steps",
)


def _stats(values: list[float | None]) -> dict[str, Any] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "n": len(got),
        "values": got,
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    # Overheads are paired per repetition: the row's time (CPU) per step over plain DDP's in
    # the same repetition, minus 1; then the median over repetitions.
    base = runs.get("ddp", [])
    for _name, reps in runs.items():
        for i, rep in enumerate(reps):
            ddp = base[i] if i < len(base) else {}
            rate, ddp_rate = rep.get("steps_per_s"), ddp.get("steps_per_s")
            rep["overhead"] = ddp_rate / rate - 1 if ddp_rate and rate else None
            cpu, ddp_cpu = rep.get("cpu_ms_per_step"), ddp.get("cpu_ms_per_step")
            rep["cpu_overhead"] = cpu / ddp_cpu - 1 if cpu and ddp_cpu else None
    summary: dict[str, dict[str, Any]] = {}
    for name, reps in runs.items():
        entry: dict[str, Any] = {m: _stats([r.get(m) for r in reps]) for m in METRICS}
        checked = [r.get("params_match") for r in reps if "params_match" in r]
        entry["params"] = (
            None
            if not checked
            else {
                "match": sum(1 for c in checked if c is True),
                "differ": sum(1 for c in checked if c is False),
                "not_observed": sum(1 for c in checked if c is None),
                "n": len(checked),
            }
        )
        for key in ("cpu_by_role", "cpu_rank_threads"):
            kinds = sorted({k for r in reps for k in (r.get(key) or {})})
            entry[key] = {
                kind: _stats([(r.get(key) or {}).get(kind) for r in reps]) for kind in kinds
            }
        timed = [r["phases"] for r in reps if r.get("phases")]
        names = _in_phase_order(n for t in timed for n in t)
        entry["phases"] = {
            n: {
                part: _stats([t.get(n, {}).get(part, 0.0) for t in timed])
                for part in ("wall_ms", "cpu_ms")
            }
            for n in names
        }
        summary[name] = entry
    return summary


def _median(summary: dict[str, dict[str, Any]], name: str, metric: str) -> float | None:
    entry = summary.get(name, {}).get(metric)
    return None if entry is None else entry["median"]


def _correct(summary: dict[str, dict[str, Any]], name: str) -> bool | None:
    """Every repetition of the row ended with the oracle's parameters (None: not observed)."""
    params = summary.get(name, {}).get("params")
    if not params:
        return None
    if params["differ"]:
        return False
    return True if params["match"] == params["n"] else None


def targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets ("Performance"), each from medians of this run. A recovery or
    overhead target counts as met only when every repetition of its row also ended with the
    oracle's parameters (a fast recovery to wrong parameters is not a fast recovery, a cheap
    run that skipped work is not cheap), and an overhead only against a DDP baseline whose
    every repetition did too."""

    def check(
        target: str,
        metric: str,
        limit: float | None,
        row: str,
        *,
        recovery: bool = False,
        baseline: str | None = None,
        over_only: bool = False,
    ) -> dict[str, Any]:
        entry = summary.get(row, {}).get(metric)
        value = None if entry is None else entry["median"]
        met: bool | None = None
        note = f"{row} missing" if value is None else "a peer row missing"  # no limit
        if entry is not None and limit is not None:
            # The median of a few noisy repetitions proves nothing by itself: met or not
            # met only when the median's interval is on one side of the limit.
            scale, unit, digits = (100.0, "%", 1) if "overhead" in metric else (1.0, "", 2)
            met, why = verdict(
                entry.get("values") or [entry["median"]],
                limit,
                scale=scale,
                unit=unit,
                digits=digits,
            )
            note = why or note
            if met and over_only:  # CPU counts work, not waits: it can only show "over"
                met, note = (
                    None,
                    (
                        "not resolved in CPU: under the limit, but CPU does not "
                        "count waits; the throughput line decides"
                    ),
                )
        correct = _correct(summary, row) if recovery or baseline else True
        if correct is False:
            met, note = False, "wrong parameters"
        elif met and correct is None:
            met, note = None, "parameters not observed"
        elif met and baseline is not None and (base := _correct(summary, baseline)) is not True:
            met, note = (
                None,
                (
                    f"not measured: {baseline}'s parameters "
                    + ("differ from the oracle" if base is False else "not observed")
                ),
            )
        return {"target": target, "value": value, "limit": limit, "met": met, "note": note}

    def m(name: str, metric: str) -> float | None:
        return _median(summary, name, metric)

    def times(a: float | None, k: float) -> float | None:
        return None if a is None else a * k

    hs, el, tn = "hot_spare", "elastic", "trainer_no_ckpt"
    return [
        check(
            "hot_spare failure-free overhead ≤ 10% vs plain DDP",
            "overhead",
            0.10,
            hs,
            baseline="ddp",
        ),
        check(
            "elastic failure-free overhead ≤ 10% vs plain DDP", "overhead", 0.10, el, baseline="ddp"
        ),
        check(
            "trainer loop alone (trainer_no_ckpt) ≤ 3% vs plain DDP",
            "overhead",
            0.03,
            tn,
            baseline="ddp",
        ),
        # The same limits in CPU per step, paired per repetition: a cost the wall clock does
        # not resolve here may still show over the limit in CPU (never under it: waiting
        # for the slowest rank costs steps and no CPU).
        check(
            "hot_spare failure-free CPU ≤ 10% over plain DDP (shows only over)",
            "cpu_overhead",
            0.10,
            hs,
            baseline="ddp",
            over_only=True,
        ),
        check(
            "elastic failure-free CPU ≤ 10% over plain DDP (shows only over)",
            "cpu_overhead",
            0.10,
            el,
            baseline="ddp",
            over_only=True,
        ),
        check(
            "trainer loop alone (trainer_no_ckpt) CPU ≤ 3% over plain DDP (shows only over)",
            "cpu_overhead",
            0.03,
            tn,
            baseline="ddp",
            over_only=True,
        ),
        check("hot_spare kill → full strength ≤ 0.3 s", "full_s", 0.3, hs, recovery=True),
        check("hot_spare kill → survivors commit ≤ 0.15 s", "resume_s", 0.15, hs, recovery=True),
        check("hot_spare lost steps = 0", "lost_steps", 0, hs, recovery=True),
        check("elastic lost steps ≤ 1", "lost_steps", 1, el, recovery=True),
        # Against a peer's median: its own spread is in its row.
        check(
            "hot_spare kill → survivors commit ≤ torchft 1 s",
            "resume_s",
            m("torchft_1s", "resume_s"),
            hs,
            recovery=True,
        ),
        check(
            "hot_spare kill → full strength ≤ 1/2 torchrun restart",
            "full_s",
            times(m("torchrun_ddp", "full_s"), 0.5),
            hs,
            recovery=True,
        ),
    ]


def ratios(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our strategies' median times over each peer's (below 1: ours is faster)."""
    rows = []
    for ours in ("restart", "hot_spare", "elastic"):
        for peer in ("torchrun_ddp", "torchft", "torchft_1s"):
            row: dict[str, Any] = {"ours": ours, "peer": peer}
            for metric in ("resume_s", "full_s", "overhead"):
                a, b = _median(summary, ours, metric), _median(summary, peer, metric)
                row[metric] = a / b if a is not None and b else None
            rows.append(row)
    return rows


def _fmt(entry: dict[str, Any] | None, unit: str = "", digits: int = 2, pct: bool = False) -> str:
    if entry is None:
        return "–"
    k = 100.0 if pct else 1.0
    med, lo, hi = entry["median"] * k, entry["min"] * k, entry["max"] * k
    text = f"{med:.{digits}f}{unit}"
    return text if entry["n"] == 1 else f"{text} ({lo:.{digits}f}–{hi:.{digits}f})"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _params_cell(params: dict[str, int] | None) -> str:
    if params is None:
        return "–"
    text = f"{params['match']}/{params['n']}"
    if params["differ"]:
        text += f", **{params['differ']} differ**"
    if params["not_observed"]:
        text += f", {params['not_observed']} not observed"
    return text


ROLE_ORDER = ("rank", "spare", "controller", "supervisor", "torchrun agent", "lighthouse", "other")


def _split_rows(
    summary: dict[str, dict[str, Any]],
    key: str,
    order: tuple[str, ...],
    digits: int,
    total: Callable[[dict[str, Any]], Any],
) -> list[str]:
    """One table row per bench row: the medians of ``summary[row][key]`` in ``order``, then
    the median of what ``total`` picks."""
    rows = []
    for name, stats in summary.items():
        split = stats.get(key) or {}
        if not split:
            continue
        cells = [_num(split[k]["median"], digits) if split.get(k) else "–" for k in order]
        last = total(stats)
        rows.append(
            f"| `{name}` | "
            + " | ".join(cells)
            + f" | {_num(last['median'] if last else None, 1)} |"
        )
    return rows


def phase_table(summary: dict[str, dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """Where a failure-free step goes, phase by phase, for the rows whose loops time their
    phases (reference_impl/phases.py): one column per row, "rank 0's wall / all ranks' CPU"."""
    rows = [name for name, stats in summary.items() if stats.get("phases")]
    if not rows:
        return []
    names = _in_phase_order(n for r in rows for n in summary[r]["phases"])
    lines = [
        "",
        "Where a failure-free step goes, by phase of the training loop (ms per step, "
        "median over repetitions: rank 0's wall time / all ranks' main-thread CPU; steps "
        f"{settings['warmup'] + 1}–{settings['kill_at'] - CPU_TAIL}, timed inside the "
        "ranks by reference_impl/phases.py; – where a loop has no such phase; "
        "`backward` is DDP's bucketed all-reduces too, `rest` the step's event and "
        "what else the loop does):",
        "",
        "| phase | " + " | ".join(f"`{r}`" for r in rows) + " |",
        "| --- |" + " ---: |" * len(rows),
    ]
    for name in names:
        cells = []
        for r in rows:
            got = summary[r]["phases"].get(name)
            cells.append(
                "–"
                if got is None
                else f"{_num(got['wall_ms']['median'])} / {_num(got['cpu_ms']['median'])}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = []
    for r in rows:
        split = summary[r]["phases"]
        totals.append(
            f"{_num(sum(v['wall_ms']['median'] for v in split.values()))} / "
            f"{_num(sum(v['cpu_ms']['median'] for v in split.values()))}"
        )
    lines.append("| all phases | " + " | ".join(totals) + " |")
    return lines


def target_line(t: dict[str, Any]) -> str:
    """One row of the targets table: the median, the limit, and met, not met, not
    resolved (the repetitions cannot tell) or not measured."""
    if t["met"] is None and str(t["note"]).startswith("not resolved"):
        met = t["note"]
    else:
        # "In this run": one run's interval does not cover what changes between runs of
        # the same code (bench/results/history-2026-12.md, "Run J"); a target's status reads
        # all of them.
        met = {True: "yes, in this run", False: "**no**", None: f"not measured ({t['note']})"}[
            t["met"]
        ]
    if t["met"] is False and t["note"] == "wrong parameters":
        met += " (wrong parameters)"
    elif t["met"] is not None and str(t["note"]).startswith("the median's"):
        met += f" ({t['note']})"  # what resolved it
    pct = "overhead" in t["target"] or "%" in t["target"]
    scale = 100.0 if pct else 1.0
    unit = "%" if pct else ""
    value = None if t["value"] is None else t["value"] * scale
    limit = None if t["limit"] is None else t["limit"] * scale
    return f"| {t['target']} | {_num(value)}{unit} | {_num(limit)}{unit} | {met} |"


def markdown(record: dict[str, Any]) -> str:
    summary, peers = record["summary"], {p["name"]: p for p in record["peers"]}
    load = record["machine"].get("loadavg_end")
    lines = [
        f"Command: `{record['command']}`  ",
        f"Machine: {record['machine']['description']}"
        + ("" if load is None else f", at the end {load[0]:.1f}")
        + "  ",
        f"Model: {record['model']['description']}  ",
        f"Repetitions: {record['settings']['repeat']} of {record['settings']['planned']}"
        f"{'' if record['complete'] else ' (interrupted)'}; median (min–max). "
        f"Kill: SIGKILL of rank {record['settings']['kill_rank']} when it reports step "
        f"{record['settings']['kill_at']};"
        f" faulted jobs train to step {record['settings']['kill_at'] + record['settings']['after']}"
        " and their final parameters are checked against the oracle.",
        "",
        "| row | what | steps/s | overhead vs DDP | CPU ms/step | CPU vs DDP | detect s "
        "| survivors commit s | full strength s | lost steps | params = oracle |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, stats in summary.items():
        lines.append(
            f"| `{name}` | {peers[name]['what']} | {_fmt(stats['steps_per_s'], digits=1)} "
            f"| {_fmt(stats['overhead'], '%', 1, pct=True)} "
            f"| {_fmt(stats['cpu_ms_per_step'], digits=1)} "
            f"| {_fmt(stats['cpu_overhead'], '%', 1, pct=True)} | {_fmt(stats['detect_s'])} "
            f"| {_fmt(stats['resume_s'])} | {_fmt(stats['full_s'])} "
            f"| {_fmt(stats['lost_steps'], digits=0)} | {_params_cell(stats.get('params'))} |"
        )
    for name, why in record["skipped"].items():
        lines.append(f"| `{name}` | skipped: {why} | | | | | | | | | |")
    lines += [
        "",
        "Where the CPU goes, failure-free (ms per step, median over repetitions, all "
        "processes of the job between rank 0's steps "
        f"{record['settings']['warmup']} and "
        f"{record['settings']['kill_at'] - CPU_TAIL}):",
        "",
        "| row | " + " | ".join(ROLE_ORDER) + " | total |",
        "| --- |" + " ---: |" * (len(ROLE_ORDER) + 1),
    ]
    lines += _split_rows(
        summary, "cpu_by_role", ROLE_ORDER, 1, lambda stats: stats.get("cpu_ms_per_step")
    )
    lines += [
        "",
        "The ranks' CPU by thread (ms per step, all ranks together, the same window; "
        "`main`: the training loop; `gloo transport`: Gloo's epoll loops, which move "
        "every collective's bytes; `gloo work`: the threads that run each collective; "
        "`other threads`: heartbeats, snapshot sender, plan watcher, the store "
        "client's):",
        "",
        "| row | " + " | ".join(THREAD_ORDER) + " | ranks |",
        "| --- |" + " ---: |" * (len(THREAD_ORDER) + 1),
    ]
    lines += _split_rows(
        summary,
        "cpu_rank_threads",
        THREAD_ORDER,
        2,
        lambda stats: (stats.get("cpu_by_role") or {}).get("rank"),
    )
    lines += phase_table(summary, record["settings"])
    lines += ["", "| target | value | limit | met |", "| --- | ---: | ---: | --- |"]
    lines += [target_line(t) for t in record["targets"]]
    lines += [
        "",
        "Ratios, ours / peer (median over median; < 1 means ours is lower):",
        "",
        "| ours | peer | survivors commit | full strength | overhead |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in record["ratios"]:
        if r["resume_s"] is None and r["full_s"] is None and r["overhead"] is None:
            continue
        lines.append(
            f"| `{r['ours']}` | `{r['peer']}` | {_num(r['resume_s'])} "
            f"| {_num(r['full_s'])} | {_num(r['overhead'])} |"
        )
    return "\n".join(lines) + "\n"


def _machine(gpu: bool = False) -> dict[str, Any]:
    import torch  # only for its version (and the GPU's name); the bench itself does not need it

    try:
        from importlib.metadata import version

        torchft = version("torchft")
    except Exception:
        torchft = "not installed"
    load = os.getloadavg()
    desc = (
        f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchft {torchft}, "
        f"load average at start {load[0]:.1f}"
    )
    found = {
        "description": desc,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torchft": torchft,
        "loadavg_start": load,
    }
    if gpu:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        found["gpu"] = (
            f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}"
        )
        found["description"] = f"{desc}; {found['gpu']}"
    return found


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 repetition, fewer steps")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only these rows (repeatable, or comma-separated); "
        f"rows: {', '.join(p.name for p in PEERS)}",
    )
    parser.add_argument("--repeat", type=int, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for JSON + Markdown")
    parser.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="copy each job's events and logs here: DIR/repN/ROW",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="one rank with NCCL on one GPU (1 replica x 1 shard): the rows "
        "one rank can run; writes gpu.json",
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.repeat:
        settings = dataclasses.replace(settings, repeat=args.repeat)
    only = {n for item in args.only for n in item.split(",") if n}
    unknown = only - {p.name for p in PEERS}
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}; rows: {[p.name for p in PEERS]}")
    model = GPU if args.gpu else Model()
    if args.gpu and _cuda_devices() < model.world:
        parser.error(
            "--gpu needs a CUDA device, and torch sees none here (torch.cuda."
            "is_available() is False): run it on a GPU machine, or leave --gpu out "
            "for the CPU rows"
        )
    strategies = accepted_strategies()
    skipped: dict[str, str] = {}
    chosen: list[Peer] = []
    for peer in PEERS:
        if (only and peer.name not in only) or (not only and not peer.default):
            continue
        if args.gpu and not peer.one_rank:
            if only:
                skipped[peer.name] = (
                    "needs a second rank, and NCCL refuses two ranks on "
                    "one GPU: run it on a machine with a GPU per rank"
                )
            continue
        if peer.requires and strategies.get(peer.requires):
            skipped[peer.name] = f"the reference trainer rejects it ({strategies[peer.requires]})"
        elif (
            peer.name.startswith("torchft")
            and not Path(sys.executable).with_name("torchft_lighthouse").exists()
        ):
            skipped[peer.name] = "torchft is not installed (pip install torchft==0.2.0)"
        else:
            chosen.append(peer)
    for name, why in skipped.items():
        print(f"skip {name}: {why}", flush=True)
    marker = uuid.uuid4().hex
    # SIGTERM (and SIGINT, which a shell ignores in background jobs) must still run the
    # `finally` that kills every marked process, so turn both into SystemExit.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda num, frame: sys.exit(128 + num))
    machine = _machine(args.gpu)
    code = code_identity()  # what the runs measure: `python -m bench.status` compares by it
    runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in chosen}
    oracle_cache: dict[str, dict[int, str]] = {}  # the same schedule needs one computation
    started = time.monotonic()
    command = (
        "python -m bench"
        + (" --gpu" if args.gpu else "")
        + (" --quick" if args.quick else "")
        + "".join(f" --only {n}" for n in sorted(only))
        + (f" --repeat {args.repeat}" if args.repeat else "")
    )
    stem = "quick" if args.quick else "partial" if only or args.repeat else "results"
    if args.gpu:  # never over the CPU rows' records
        stem = "gpu-quick" if args.quick else "gpu"
    args.out.mkdir(parents=True, exist_ok=True)

    def write(done: int) -> str:
        """Write the record so far: an interrupted run still leaves its finished repetitions."""
        summary = summarise(runs)
        record = {
            "command": command,
            "complete": done == settings.repeat,
            "machine": {**machine, "loadavg_end": os.getloadavg()},
            "code": code,
            "model": {
                "d_model": model.d_model,
                "hidden": model.hidden,
                "blocks": model.blocks,
                "batch_size": model.batch_size,
                "parameters": model.parameters(),
                "replicas": model.replicas,
                "shards": model.shards,
                "backend": model.backend,
                "description": model.describe(),
            },
            "settings": {
                "repeat": done,
                "planned": settings.repeat,
                "kill_at": settings.kill_at,
                "warmup": settings.warmup,
                "after": settings.after,
                "kill_rank": model.kill_rank,
            },
            "peers": [{"name": p.name, "group": p.group, "what": p.what} for p in chosen],
            "skipped": skipped,
            "runs": runs,
            "summary": summary,
            "targets": targets(summary),
            "ratios": ratios(summary),
            "duration_s": round(time.monotonic() - started, 1),
        }
        (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        table = markdown(record)
        (args.out / f"{stem}.md").write_text(table)
        return table

    try:
        for rep in range(settings.repeat):
            for peer in run_order(chosen, rep):
                # Every job's logs: an outlier is often in one repetition only.
                keep = args.keep_logs / f"rep{rep + 1}" if args.keep_logs else None
                result = run_job(peer, settings, model, marker, keep, oracle_cache)
                runs[peer.name].append(result)
                shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}
                print(f"[{rep + 1}/{settings.repeat}] {peer.name}: {shown}", flush=True)
            table = write(rep + 1)
    finally:
        kill_marked(marker)
    print(table)
    print(f"wrote {args.out / stem}.json and .md in {time.monotonic() - started:.0f} s")
    return 0
