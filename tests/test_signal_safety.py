"""Signal handlers that a second signal can interrupt anywhere.

A restarted router once hung on SIGTERM until SIGKILL: its handler called
``threading.Event.set()``, the launcher's forwarded SIGTERM arrived while that ``set()``
held the Event's lock, and the second handler's ``set()`` waited for that lock for ever
(faulthandler's stacks, 1 run in 36). Which bytecode a signal lands on is chance, so each
case here makes it certain: a trace function raises SIGTERM again at every line the first
handler (or the code it interrupts) runs, so a nested handler runs at each of those points.
Each case runs in its own process, which a deadlock would hold until the timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import ROOT

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import os, signal, sys, threading
sys.path.insert(0, {root!r})
os.environ["AFTERSHOCK_EVENTS"] = {events!r}

{setup}

inside = 0
def handler(signum, frame):
    global inside
    inside += 1
    try:
        target(signum, frame)
    finally:
        inside -= 1

def tracer(frame, event, arg):
    # A SIGTERM arrives at every line the outer call runs; the nested one runs undisturbed.
    if inside == 1 and event == "line":
        signal.raise_signal(signal.SIGTERM)
    return tracer

signal.signal(signal.SIGTERM, handler)
inside = 1
sys.settrace(tracer)
first()
sys.settrace(None)
inside = 0
print("returned", check())
"""

CASES = {
    # The server's handler, interrupted by itself.
    "stop_request": """
from aftershock.reference_impl.serving._lifetime import StopRequest
quiet = []
stop = StopRequest()
stop.also(lambda: quiet.append(1))
target = stop.on_signal
first = lambda: stop.on_signal(signal.SIGTERM, None)
check = lambda: (stop.requested, len(quiet) > 1)
""",
    # The server's handler while the main thread waits for it.
    "stop_request_wait": """
from aftershock.reference_impl.serving._lifetime import StopRequest
stop = StopRequest()
target = stop.on_signal
first = lambda: stop.wait(0.2)
check = lambda: stop.requested
""",
    # The launcher's handler (no router running).
    "launcher": """
from aftershock.reference_impl.serving.server import Launcher
launcher = Launcher(None, [], None, None)
target = launcher.on_signal
first = lambda: launcher.on_signal(signal.SIGTERM, None)
check = lambda: launcher.stop.requested
""",
    # The trainer's and the bench DDP's handlers report the failure through the probe,
    # interrupting the probe's own writes.
    "probe": """
from aftershock.harness import probe
target = lambda signum, frame: probe.detected(cause="terminated: SIGTERM")
first = lambda: probe.emit("step", step=1)
check = lambda: sum(1 for _ in open(os.environ["AFTERSHOCK_EVENTS"]))
""",
    # What the server's handler did before: the broken pattern, which must hang here, or
    # this test could not catch it.
    "event_set": """
stop = threading.Event()
target = lambda signum, frame: stop.set()
first = lambda: stop.set()
check = lambda: stop.is_set()
""",
}


def run_case(tmp_path: Path, case: str) -> subprocess.CompletedProcess[str] | None:
    script = SCRIPT.format(root=str(ROOT), events=str(tmp_path / "events.jsonl"),
                           setup=textwrap.dedent(CASES[case]))
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=15, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("case", ["stop_request", "stop_request_wait", "launcher", "probe"])
def test_a_handler_interrupted_by_another_signal_at_any_line_returns(tmp_path: Path,
                                                                     case: str) -> None:
    done = run_case(tmp_path, case)
    assert done is not None, f"{case}: deadlocked (a nested handler waited for a lock)"
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("returned"), done.stdout
    if case == "stop_request":
        assert last == "returned (True, True)"
    elif case == "probe":
        assert int(last.split()[1]) > 2  # the step and several nested reports, whole lines


def test_the_old_event_set_handler_deadlocks_here(tmp_path: Path) -> None:
    assert run_case(tmp_path, "event_set") is None
