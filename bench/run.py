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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers import PEERS, WORLD, Context, Model, Peer
from harness import metrics
from harness.records import Event

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MARKER_ENV = "AFTERSHOCK_BENCH_MARKER"
KILL_RANK = 3  # replica 1, shard 1: not rank 0, which hosts torchrun's store


@dataclass(frozen=True, slots=True)
class Settings:
    repeat: int
    kill_at: int  # failure-free steps before the kill; the rate window ends here
    warmup: int  # steps left out of the rate (process start, first quorum, allocator)
    deadline_s: float  # per job: give up on start, then on recovery, after this long
    settle_s: float  # keep the job running this long after full strength, then stop it


FULL = Settings(repeat=3, kill_at=100, warmup=20, deadline_s=120.0, settle_s=0.5)
QUICK = Settings(repeat=1, kill_at=70, warmup=10, deadline_s=90.0, settle_s=0.3)


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


def kill_marked(marker: str) -> None:
    for pid in _marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def accepted_strategies() -> dict[str, str | None]:
    """Which reference-trainer strategies exist: None if accepted, else argparse's complaint."""
    found: dict[str, str | None] = {}
    for name in ("hot_spare", "elastic"):
        done = subprocess.run(
            [sys.executable, "-m", "reference_impl.trainer", f"--recovery={name}", "--help"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
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


def run_job(peer: Peer, settings: Settings, model: Model, marker: str, keep: Path | None
            ) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"aftershock-bench-{peer.name}-"))
    events_path = workdir / "events.jsonl"
    steps = 1_000_000 if peer.fault else settings.kill_at
    ctx = Context(model=model, steps=steps, workdir=workdir, lighthouse_port=_free_port())
    base_env = {
        **os.environ,
        MARKER_ENV: marker,
        "AFTERSHOCK_EVENTS": str(events_path),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        # A restart attempt would otherwise be wasted on stale Gloo addresses (DESIGN.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    procs: list[subprocess.Popen[bytes]] = []
    tail = EventTail(events_path)
    t_kill: float | None = None
    outcome = "completed"
    t0 = time.monotonic()
    try:
        for cmd in peer.commands(ctx):
            log = (workdir / f"{cmd.name}.log").open("wb")
            procs.append(subprocess.Popen(
                cmd.argv, cwd=REPO, env={**base_env, **cmd.env}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            ))
            log.close()
            if cmd.name == "lighthouse":
                time.sleep(0.2)  # let it bind before the replica groups dial it
        names = [c.name for c in peer.commands(ctx)]
        workers = [p for p, n in zip(procs, names, strict=True) if n != "lighthouse"]
        while True:
            time.sleep(0.005)
            tail.poll()
            if t_kill is None and peer.fault:
                pid = _kill_target(tail.events, settings.kill_at)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
                    _append_event(events_path, {"t": t_kill, "event": "fault_injected",
                                                "source": "bench", "rank": KILL_RANK,
                                                "pid": pid, "kind": "process.kill"})
            elif t_kill is not None:
                recovered = metrics.time_to_recover(tail.events, WORLD)
                done_at = None if recovered is None else t_kill + recovered + settings.settle_s
                if done_at is not None and time.monotonic() > done_at:
                    outcome = "recovered"
                    break
            if all(p.poll() is not None for p in workers):
                outcome = "exited" if t_kill is not None else "completed"
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
    result = analyse(tail.events, settings, t_kill)
    result.update(outcome=outcome, wall_s=round(time.monotonic() - t0, 2))
    if keep is not None:
        dest = keep / peer.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in [*workdir.glob("*.log"), events_path]:
            (dest / f.name).write_bytes(f.read_bytes())
    subprocess.run(["rm", "-rf", str(workdir)], check=False)
    return result


def _kill_target(events: list[Event], kill_at: int) -> int | None:
    """pid of the newest non-spare process that says it is KILL_RANK, once it reached kill_at."""
    reached = any(
        e.event == "step" and e.rank == KILL_RANK and e.fields.get("step", 0) >= kill_at
        for e in events
    )
    if not reached:
        return None
    hellos = [e for e in events if e.event == "hello" and e.rank == KILL_RANK
              and e.fields.get("role") != "spare"]
    return int(hellos[-1].fields["pid"]) if hellos else None


# ---------------------------------------------------------------------------------------------
# Metrics (from the job's timeline; definitions in docs/metrics.md and docs/benchmarks.md)


def analyse(events: list[Event], settings: Settings, t_kill: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"steps_per_s": _rate(events, settings, t_kill)}
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
        full_s=metrics.time_to_recover(events, WORLD),
        lost_steps=max(redone.values(), default=0),
        restarts=metrics.generations(events),
    )
    return out


def _rate(events: list[Event], settings: Settings, t_kill: float | None) -> float | None:
    """Failure-free steps/s of rank 0 over (warmup, kill_at], at full strength only."""
    times = [
        e.t for e in events
        if e.event == "step" and e.rank == 0 and (t_kill is None or e.t < t_kill)
        and settings.warmup < e.fields.get("step", 0) <= settings.kill_at
        and e.fields.get("world", WORLD) >= WORLD
    ]
    if len(times) < 2:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


# ---------------------------------------------------------------------------------------------
# Summary


METRICS = ("steps_per_s", "overhead", "detect_s", "resume_s", "full_s", "lost_steps")


def _stats(values: list[float | None]) -> dict[str, Any] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    # Overhead is paired per repetition: the row's time per step over plain DDP's, minus 1.
    base = runs.get("ddp", [])
    for _name, reps in runs.items():
        for i, rep in enumerate(reps):
            ddp_rate = base[i].get("steps_per_s") if i < len(base) else None
            rate = rep.get("steps_per_s")
            rep["overhead"] = ddp_rate / rate - 1 if ddp_rate and rate else None
    return {name: {m: _stats([r.get(m) for r in reps]) for m in METRICS}
            for name, reps in runs.items()}


def _median(summary: dict[str, dict[str, Any]], name: str, metric: str) -> float | None:
    entry = summary.get(name, {}).get(metric)
    return None if entry is None else entry["median"]


def targets(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 3's targets, each a ratio of two medians from this run."""

    def check(target: str, value: float | None, limit: float | None, why: str) -> dict[str, Any]:
        met = None if value is None or limit is None else value <= limit
        return {"target": target, "value": value, "limit": limit, "met": met, "missing": why}

    def m(name: str, metric: str) -> float | None:
        return _median(summary, name, metric)

    def times(a: float | None, k: float) -> float | None:
        return None if a is None else a * k

    hs, el = "hot_spare", "elastic"
    return [
        check("hot_spare failure-free overhead ≤ 3% vs plain DDP", m(hs, "overhead"), 0.03, hs),
        check("hot_spare kill → survivors commit ≤ 1/3 torchft default", m(hs, "resume_s"),
              times(m("torchft", "resume_s"), 1 / 3), hs),
        check("hot_spare kill → survivors commit ≤ torchft 1 s", m(hs, "resume_s"),
              m("torchft_1s", "resume_s"), hs),
        check("hot_spare kill → full strength ≤ 1/2 torchrun restart", m(hs, "full_s"),
              times(m("torchrun_ddp", "full_s"), 0.5), hs),
        check("hot_spare lost steps = 0", m(hs, "lost_steps"), 0, hs),
        check("elastic failure-free overhead ≤ 1/2 torchft's", m(el, "overhead"),
              times(m("torchft", "overhead"), 0.5), el),
        check("elastic lost steps ≤ 1", m(el, "lost_steps"), 1, el),
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


def markdown(record: dict[str, Any]) -> str:
    summary, peers = record["summary"], {p["name"]: p for p in record["peers"]}
    lines = [
        f"Command: `{record['command']}`  ",
        f"Machine: {record['machine']['description']}  ",
        f"Model: {record['model']['description']}  ",
        f"Repetitions: {record['settings']['repeat']} of {record['settings']['planned']}"
        f"{'' if record['complete'] else ' (interrupted)'}; median (min–max). "
        f"Kill: SIGKILL of rank {KILL_RANK} when it reports step {record['settings']['kill_at']}.",
        "",
        "| row | what | steps/s | overhead vs DDP | detect s | survivors commit s "
        "| full strength s | lost steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, stats in summary.items():
        lines.append(
            f"| `{name}` | {peers[name]['what']} | {_fmt(stats['steps_per_s'], digits=1)} "
            f"| {_fmt(stats['overhead'], '%', 1, pct=True)} | {_fmt(stats['detect_s'])} "
            f"| {_fmt(stats['resume_s'])} | {_fmt(stats['full_s'])} "
            f"| {_fmt(stats['lost_steps'], digits=0)} |"
        )
    for name, why in record["skipped"].items():
        lines.append(f"| `{name}` | skipped: {why} | | | | | | |")
    lines += ["", "| target | value | limit | met |", "| --- | ---: | ---: | --- |"]
    for t in record["targets"]:
        met = {True: "yes", False: "**no**", None: f"not measured ({t['missing']} missing)"}
        pct = "overhead" in t["target"]
        scale = 100.0 if pct else 1.0
        unit = "%" if pct else ""
        value = None if t["value"] is None else t["value"] * scale
        limit = None if t["limit"] is None else t["limit"] * scale
        lines.append(f"| {t['target']} | {_num(value)}{unit} | {_num(limit)}{unit} "
                     f"| {met[t['met']]} |")
    lines += ["", "Ratios, ours / peer (median over median; < 1 means ours is lower):", "",
              "| ours | peer | survivors commit | full strength | overhead |",
              "| --- | --- | ---: | ---: | ---: |"]
    for r in record["ratios"]:
        if r["resume_s"] is None and r["full_s"] is None and r["overhead"] is None:
            continue
        lines.append(f"| `{r['ours']}` | `{r['peer']}` | {_num(r['resume_s'])} "
                     f"| {_num(r['full_s'])} | {_num(r['overhead'])} |")
    return "\n".join(lines) + "\n"


def _machine() -> dict[str, Any]:
    import torch  # only for its version; the bench itself does not need it

    try:
        from importlib.metadata import version

        torchft = version("torchft")
    except Exception:
        torchft = "not installed"
    load = os.getloadavg()
    desc = (f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, torchft {torchft}, "
            f"load average at start {load[0]:.1f}")
    return {"description": desc, "cores": os.cpu_count(), "torch": torch.__version__,
            "torchft": torchft, "loadavg_start": load}


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 repetition, fewer steps")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only these rows (repeatable, or comma-separated); "
                        f"rows: {', '.join(p.name for p in PEERS)}")
    parser.add_argument("--repeat", type=int, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for JSON + Markdown")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy each job's events and logs here (last repetition wins)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.repeat:
        settings = dataclasses.replace(settings, repeat=args.repeat)
    only = {n for item in args.only for n in item.split(",") if n}
    unknown = only - {p.name for p in PEERS}
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}; rows: {[p.name for p in PEERS]}")
    model = Model()
    strategies = accepted_strategies()
    skipped: dict[str, str] = {}
    chosen: list[Peer] = []
    for peer in PEERS:
        if (only and peer.name not in only) or (not only and not peer.default):
            continue
        if peer.requires and strategies.get(peer.requires):
            skipped[peer.name] = f"the reference trainer rejects it ({strategies[peer.requires]})"
        elif peer.name.startswith("torchft") and not Path(sys.executable).with_name(
                "torchft_lighthouse").exists():
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
    machine = _machine()
    runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in chosen}
    started = time.monotonic()
    command = "python -m bench" + (" --quick" if args.quick else "") + "".join(
        f" --only {n}" for n in sorted(only)) + (f" --repeat {args.repeat}" if args.repeat else "")
    stem = "quick" if args.quick else "partial" if only or args.repeat else "results"
    args.out.mkdir(parents=True, exist_ok=True)

    def write(done: int) -> str:
        """Write the record so far: an interrupted run still leaves its finished repetitions."""
        summary = summarise(runs)
        record = {
            "command": command,
            "complete": done == settings.repeat,
            "machine": {**machine, "loadavg_end": os.getloadavg()},
            "model": {"d_model": model.d_model, "hidden": model.hidden, "blocks": model.blocks,
                      "batch_size": model.batch_size, "parameters": model.parameters(),
                      "description": f"reference ParallelMLP d_model={model.d_model} "
                      f"hidden={model.hidden} blocks={model.blocks} ({model.parameters():,} "
                      f"parameters), batch {model.batch_size} per replica, "
                      "2 replicas × 2 shards, Gloo on CPU"},
            "settings": {"repeat": done, "planned": settings.repeat, "kill_at": settings.kill_at,
                         "warmup": settings.warmup, "kill_rank": KILL_RANK},
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
            for peer in chosen:
                result = run_job(peer, settings, model, marker, args.keep_logs)
                runs[peer.name].append(result)
                shown = {k: (round(v, 3) if isinstance(v, float) else v)
                         for k, v in result.items()}
                print(f"[{rep + 1}/{settings.repeat}] {peer.name}: {shown}", flush=True)
            table = write(rep + 1)
    finally:
        kill_marked(marker)
    print(table)
    print(f"wrote {args.out / stem}.json and .md in {time.monotonic() - started:.0f} s")
    return 0

