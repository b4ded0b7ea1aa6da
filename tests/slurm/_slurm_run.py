"""A harness run as a child process for the Slurm tests, that keeps its evidence when a test
fails: pytest removes the run folder, and a hang says nothing by itself."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Where a failed Slurm test keeps what it saw: pytest removes its temporary folders.
EVIDENCE = ROOT / ".aftershock" / "test-evidence"


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


def _said(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    return (done.stdout + done.stderr).strip()


@dataclass
class Harness:
    """``aftershock run`` of one scenario as a child process, its output in a file, with
    Python's stack dump on SIGABRT (``PYTHONFAULTHANDLER``): a harness that hangs can be made
    to say where."""

    proc: subprocess.Popen[bytes]
    root: Path  # its --run-dir: the run's folder is root/<scenario name>
    output: Path

    @classmethod
    def start(cls, scenario: Path, root: Path, env: dict[str, str]) -> Harness:
        output = root.parent / f"{root.name}.harness.log"
        with output.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "aftershock", "run", str(scenario), "--run-dir",
                 str(root), "--plain"], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                env={**env, "PYTHONFAULTHANDLER": "1"})
        return cls(proc, root, output)

    def events(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in self.root.glob("*/events.jsonl"):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found

    def submitted(self, timeout: float) -> dict[str, Any]:
        """The run's ``slurm_submitted`` event (its job id and name), once written."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events():
                if event.get("event") == "slurm_submitted":
                    return event
            assert self.proc.poll() is None, self.evidence("the harness ended before it "
                                                           "submitted a job")
            assert time.monotonic() < deadline, self.evidence(f"no job submitted within "
                                                              f"{timeout:g}s")
            time.sleep(0.2)

    def output_text(self) -> str:
        return self.output.read_text(errors="replace")

    def evidence(self, why: str) -> str:
        """Keep what this run left (its folder, the harness's output, the queue, where a
        harness still running waits) where pytest does not remove it; the gist as text."""
        if self.proc.poll() is None:
            children = _said(["ps", "-o", "pid,etime,args", "--ppid", str(self.proc.pid)])
            self.proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        else:
            children = f"(the harness had ended: exit {self.proc.returncode})"
        kept = EVIDENCE / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.root.parent.name}"
        with contextlib.suppress(OSError):
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.root, kept / "run", symlinks=True, dirs_exist_ok=True)
            shutil.copy(self.output, kept / "harness.log")
        events = "\n".join(json.dumps(e) for e in self.events()[-25:])
        queue = _said(["squeue", "--format=%i %j %T %r %N"])
        return (f"{why}; evidence kept in {kept}\n--- the harness's children ---\n{children}\n"
                f"--- the harness's output (last lines) ---\n{_tail(self.output, 60)}\n"
                f"--- events.jsonl (last lines) ---\n{events}\n--- squeue ---\n{queue}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
