"""Helpers the test modules share: the CLI as a user runs it, timelines, quick scenarios."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANKS_JOB = ROOT / "tests" / "fixtures" / "ranks_job.py"


def cli(
    *args: str, cache: Path | None = None, cwd: Path | None = None, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGS`` in a subprocess; ``cache`` is its fault-free baseline cache."""
    env = dict(os.environ)
    if cache is not None:
        env["AFTERSHOCK_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
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


def bounded_cli(*args: str, cpu_s: int = 5, wall_s: float = 30.0,
                address_space_mb: int = 2048) -> Bounded:
    """``python -m harness ARGS`` with its CPU seconds (RLIMIT_CPU) and address space capped.

    The CPU limit is what "within N seconds" means here: wall time on a loaded 2-core machine
    says more about other tests than about this process; a hang (a process blocked without
    using CPU) is caught by ``wall_s`` instead. The address-space cap only keeps a runaway
    from hurting the machine; tests assert on ``max_rss_mb``, the peak that ``wait4``
    reports for this child alone (RUSAGE_CHILDREN would mix in every earlier child).
    """

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        size = address_space_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "harness", *args], stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, preexec_fn=limit)
        deadline = time.monotonic() + wall_s
        timed_out = False
        while True:
            # wait4 ourselves, not Popen.wait: it gives this child's own resource usage.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline and not timed_out:
                timed_out = True
                proc.kill()
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Bounded(
            returncode=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            cpu_s=usage.ru_utime + usage.ru_stime,
            max_rss_mb=usage.ru_maxrss / 1024,
            timed_out=timed_out,
        )


def reaper_of(pid: int) -> int | None:
    """The pid of the reaper (``python -m faults.heal --watch PID``) watching harness ``pid``."""
    from faults import all_pids

    for other in all_pids():
        try:
            argv = Path(f"/proc/{other}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"faults.heal" in argv and str(pid).encode() in argv:
            return other
    return None


def killed(proc: subprocess.Popen[bytes]) -> bool:
    """``proc`` was sent SIGKILL: it exited, or the signal is pending. (Its death follows
    the signal by a scheduling delay; reading the pending set makes the answer exact.)"""
    if proc.poll() is not None:
        return True
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{proc.pid}/status").read_text().splitlines())
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return status["State"].strip().startswith("Z") or bool(pending & 1 << signal.SIGKILL - 1)
