"""Helpers the test modules share: the CLI as a user runs it, timelines, quick scenarios."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Two faults that end no process, in one run: a NaN in rank 1's gradient at step 4, then a
#: 1 s hang of its all_reduce at step 7 (tests/test_inproc_faults.py). Rank 1 appearing
#: between two lookups once armed them in the other order (tests/test_injector_order.py).
NAN_THEN_HANG = """\
  - kind: memory.nan
    target: {rank: 1}
    at: {step: 4, phase: backward}
    tensor: "grad:weight"
  - kind: collective.hang
    target: {rank: 1}
    at: {step: 7}
    duration: 1s
"""
RANKS_JOB = ROOT / "tests" / "fixtures" / "ranks_job.py"


def cli(
    *args: str, cache: Path | None = None, cwd: Path | None = None, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """``python -m aftershock ARGS`` in a subprocess; ``cache`` is its fault-free baseline cache."""
    env = dict(os.environ)
    if cache is not None:
        env["AFTERSHOCK_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "aftershock", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """A run's timeline (events.jsonl), optionally only the events named ``kind``."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return [e for e in events if kind is None or e.get("event") == kind]


def quick_scenario(name: str, rest: str, *, ranks: int = 2, duration: float = 1.0) -> str:
    """A scenario on ``ranks_job.py``: torch-free rank processes printing ``rank R step N
    gen 0 t=T`` every 50 ms for ``duration`` seconds. ``rest`` is the YAML after ``system``
    (faults, expect)."""
    return f"""\
name: {name}
system:
  command: [{sys.executable}, {RANKS_JOB}]
  env: {{JOB_RANKS: "{ranks}", JOB_DURATION: "{duration}"}}
  probes:
    - event: step
      pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) gen (?P<generation>\\d+) t=(?P<time>\\S+)'
{rest}"""


def on_two_ranks(text: str) -> str:
    """A shipped 2 replicas x 2 shards scenario's text, on a 2-rank data-parallel world: for
    deliberately broken variants whose bug does not depend on the layout (half the start-up)."""
    two = text.replace("world: {replicas: 2, shards: 2}", "world: {replicas: 2, shards: 1}")
    assert two != text, "the scenario has no 2 x 2 world to shrink"
    return two


@dataclass(frozen=True, slots=True)
class Bounded:
    """A CLI run under hard limits, with what the kernel measured for that one process."""

    returncode: int
    stdout: str
    stderr: str
    cpu_s: float
    max_rss_mb: float
    timed_out: bool


# Forks the command and reports its own resource usage. It runs as a small process of its
# own: a child forked from pytest would start with a copy of pytest's page tables, and the
# kernel's peak RSS of a process survives exec, so the command's peak would include whatever
# memory the test process had grown to.
_MEASURE = """
import json, os, resource, sys
cpu_s, size, report = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (size, size))
    os.execv(sys.argv[4], sys.argv[4:])
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as out:
    json.dump({"returncode": os.waitstatus_to_exitcode(status),
               "cpu_s": usage.ru_utime + usage.ru_stime,
               "max_rss_mb": usage.ru_maxrss / 1024}, out)
"""


def bounded_cli(*args: str, cpu_s: int = 5, wall_s: float = 30.0,
                address_space_mb: int = 2048) -> Bounded:
    """``python -m aftershock ARGS`` with its CPU seconds (RLIMIT_CPU) and address space capped.

    The CPU limit is what "within N seconds" means here: wall time on a loaded 2-core machine
    says more about other tests than about this process; a hang (a process blocked without
    using CPU) is caught by ``wall_s`` instead. The address-space cap only keeps a runaway
    from hurting the machine; tests assert on ``max_rss_mb``, the command's own peak, which
    ``wait4`` reports to the small process that forked it (``_MEASURE``).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "usage.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEASURE, str(cpu_s), str(address_space_mb * 1024 * 1024),
             str(report), sys.executable, "-m", "aftershock", *args],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the command too: it shares the session
            proc.wait()
        usage = json.loads(report.read_text()) if report.exists() else {}
        out.seek(0)
        err.seek(0)
        return Bounded(
            returncode=usage.get("returncode", proc.returncode),
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            cpu_s=usage.get("cpu_s", 0.0),
            max_rss_mb=usage.get("max_rss_mb", 0.0),
            timed_out=timed_out,
        )


def reaper_of(pid: int) -> int | None:
    """The pid of the reaper (``python -m aftershock.faults.heal --watch PID``) watching harness
    ``pid``."""
    from aftershock.faults import all_pids

    for other in all_pids():
        try:
            argv = Path(f"/proc/{other}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"aftershock.faults.heal" in argv and str(pid).encode() in argv:
            return other
    return None


def marked(mark: str) -> list[int]:
    """Every live process whose environment holds ``mark`` ("NAME=value"): a test's job
    launched through torchrun, whose workers sit in sessions of their own."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def killed(proc: subprocess.Popen[bytes]) -> bool:
    """``proc`` was sent SIGKILL: it exited, or the signal is pending. (Its death follows
    the signal by a scheduling delay; reading the pending set makes the answer exact.)"""
    if proc.poll() is not None:
        return True
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{proc.pid}/status").read_text().splitlines())
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return status["State"].strip().startswith("Z") or bool(pending & 1 << signal.SIGKILL - 1)


def on_threads(size: int, body: Callable[[int], Any], join_s: float = 60.0) -> list[Any]:
    """``body(rank)`` for each of ``size`` ranks, each on a thread of its own (ranks of one
    group in one process: Gloo's calls and sockets release the GIL); what each returned, or
    the exception it raised. Fails if a rank has not returned after ``join_s``."""
    out: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return out


#: A torch-free job that survives one kill at a time and gives up on a second during a
#: recovery (tests/fixtures/explore_job.py): what the explore tests search.
EXPLORE_JOB = ROOT / "tests" / "fixtures" / "explore_job.py"


def explore_job_scenario(name: str, *, duration: float, timeout: str = "30s",
                         max_step: int = 3, max_faults: int = 2, explore: bool = True,
                         one_kill: bool = False) -> str:
    """A scenario of EXPLORE_JOB running ``duration`` seconds, whose `explore:` space kills
    ranks at steps 1 to ``max_step`` or on a failure (1 to ``max_faults`` kills);
    ``one_kill``: with a hand-written kill of rank 1 at step 5 too."""
    faults = """\
faults:
  - kind: process.kill
    target: {rank: 1}
    at: {step: 5}
""" if one_kill else ""
    block = f"""\
explore:
  faults: {{min: 1, max: {max_faults}}}
  kinds: [process.kill]
  targets: [rank]
  at:
    step: {{min: 1, max: {max_step}}}
    events: [failure_detected]
""" if explore else ""
    return f"""\
name: {name}
system:
  command: [{sys.executable}, {EXPLORE_JOB}]
  world: 2
  timeout: {timeout}
  env: {{JOB_DURATION: "{duration}", JOB_RECOVERY: "0.5"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
    - {{pattern: 'failure_detected rank (?P<rank>\\d+)', event: failure_detected}}
    - {{pattern: 'recovery_done rank (?P<rank>\\d+)', event: recovery_done}}
{faults}expect:
  completes: true
{block}"""


def check_team_found_as_alone(team: dict[str, Any], alone: dict[str, Any], *, said: str,
                              written: Path, seed: int) -> tuple[dict[str, Any], dict[str, Any],
                                                                  set[str], set[str]]:
    """What a team of two searchers (``aftershock explore --workers 2``, here or on Slurm)
    must share with a lone explore of the same seed: the same confirmed, shrunk schedule,
    written to ``written`` and printed; the seeds; the failure shrunk by one searcher only.
    Returns the searcher that shrank, the other, the schedules the other replayed and those
    that failed for the first."""
    from aftershock.harness.search.team import searcher_seeds

    assert [f["status"] for f in team["findings"]] == ["confirmed"]
    assert team["findings"][0]["schedule"] == alone["findings"][0]["schedule"]
    assert Path(team["findings"][0]["file"]) == written
    assert "FAILING SCHEDULE: " + alone["findings"][0]["schedule"] in said
    searchers = team["searchers"]
    assert [s["seed"] for s in searchers] == searcher_seeds(seed, 2)
    (shrank,) = [s for s in searchers if s["shrank"]]
    (other,) = [s for s in searchers if not s["shrank"]]
    attempts = team["attempts"]
    assert not [a for a in attempts if a["searcher"] == other["index"]
                and a["stage"] in ("shrink", "minimize")]
    assert [a for a in attempts if a["searcher"] == shrank["index"] and a["stage"] == "shrink"]
    replayed = {a["schedule"] for a in attempts
                if a["searcher"] == other["index"] and a["stage"] == "replay"}
    failed_first = {a["schedule"] for a in attempts
                    if a["searcher"] == shrank["index"] and a["verdict"] == "fail"}
    return shrank, other, replayed, failed_first
