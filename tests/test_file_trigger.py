"""`at: {file: ..., when: ...}` end to end: a job that knows nothing about Aftershock is hit
the moment its own file operation happens (inotify), not at the next poll of the timeline."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli, read_events

from aftershock import faults
from aftershock.faults import FaultUnavailable
from aftershock.faults._fanotify import Gate
from aftershock.faults._fanotify import available as fanotify_available
from aftershock.harness.run import runner, triggers
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.run.triggers import FileTriggers
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario

JOB = ROOT / "tests" / "fixtures" / "files_job.py"

pytestmark = pytest.mark.timeout(120)


def run(tmp_path: Path, faults: str, steps: int = 20) -> tuple[Path, dict[str, bool]]:
    text = f"""\
name: file-trigger
system:
  command: [{sys.executable}, {JOB}]
  cwd: ${{run_dir}}  # the folder `at: {{file}}` is relative to
  env: {{JOB_OUT: "${{run_dir}}/out", JOB_STEPS: "{steps}"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
{faults}
expect:
  completes: false
"""
    loaded = LoadedScenario(parse_scenario(text), tmp_path / "s.yaml", text)
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    return tmp_path / "run", {c.name: c.passed for c in result.checks}


def began(run_dir: Path) -> dict[int, float]:
    """step -> when the job says it began the step's file operations (its monotonic clock,
    the harness's too)."""
    text = (run_dir / "logs" / "launcher.stdout.log").read_text()
    return {int(s): float(t) for s, t in re.findall(r"step (\d+) at ([\d.]+)", text)}


def test_a_kill_lands_within_milliseconds_of_the_file(tmp_path: Path) -> None:
    run_dir, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/step_*/data', when: created, count: 3}
""")
    assert checks["faults_injected"]
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file"] == "out/step_3/data"
    times = began(run_dir)
    # The kill follows the job's third rename, before the job begins its fourth step (200 ms
    # later): the harness waits on the inotify descriptor, not for its next tick.
    assert max(times) == 3
    assert times[3] < hit["t"] < times[3] + 0.2


def test_closed_counts_files_closed_after_writing(tmp_path: Path) -> None:
    """In a folder that is watched when the file is closed (see faults/_inotify.py for
    folders made a moment before)."""
    run_dir, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/latest', when: closed, count: 3}
""")
    assert checks["faults_injected"]
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file"] == "out/latest"
    assert max(began(run_dir)) == 3  # killed right after its third rewrite


def test_a_file_that_never_appears_fails_the_run(tmp_path: Path) -> None:
    _, checks = run(tmp_path, """\
faults:
  - kind: process.kill
    target: {rank: 0}
    at: {file: 'out/step_*/COMMIT'}
""", steps=3)
    assert checks["faults_injected"] is False


SAVER = ROOT / "tests" / "fixtures" / "save_over_job.py"


def save_over(tmp_path: Path, when: str, *, chunks: int, pause: float, mode: str = "wb",
              atomic: bool = False) -> tuple[Path, dict[str, tuple[bool, str]]]:
    """Kill the saver on its second save, which overwrites the first one's file."""
    text = f"""\
name: save-over
system:
  command: [{sys.executable}, {SAVER}]
  cwd: ${{run_dir}}  # the folder `at: {{file}}` is relative to
  env: {{JOB_OUT: "${{run_dir}}/out", JOB_CHUNKS: "{chunks}", JOB_CHUNK_SLEEP: "{pause}",
        JOB_OPEN: "{mode}", JOB_ATOMIC: "{int(atomic)}"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) save ends', event: step}}
faults:
  - kind: process.kill
    target: {{rank: 0}}
    at: {{file: out/snapshot.pt, when: {when}, count: 2}}
expect:
  completes: false
  faults_landed: in_window
"""
    loaded = LoadedScenario(parse_scenario(text), tmp_path / "s.yaml", text)
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    return tmp_path / "run", {c.name: (c.passed, c.message) for c in result.checks}


@pytest.mark.parametrize("when", ["modified", "opened"])
def test_a_kill_lands_inside_a_slow_save_over_an_existing_file(tmp_path: Path,
                                                               when: str) -> None:
    """torch.save onto the file it resumes from: the open truncates it, and the kill that
    follows leaves it torn."""
    run_dir, checks = save_over(tmp_path, when, chunks=8, pause=0.05)
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file"] == "out/snapshot.pt"
    assert hit["file_open"] is True
    assert hit["file_writers"] == [hit["pid"]]  # the rank killed was the one writing
    assert hit["file_size"] < 8 * 1024  # the second save had only begun
    snapshot = (run_dir / "out" / "snapshot.pt").read_bytes()
    assert len(snapshot) < 8 * 1024  # left torn: the first save's bytes are gone too
    assert set(snapshot) <= {2}  # what there is, is the second save's
    assert checks["faults_injected"][0]
    assert checks["faults_landed"] == (True, checks["faults_landed"][1])
    assert "still open for writing" in checks["faults_landed"][1]


def test_a_kill_after_the_save_fails_faults_landed(tmp_path: Path) -> None:
    """A save of one write and a close, published by a rename: its name appears once the
    save is over, so the kill always comes after it, and the run says so instead of passing
    as if the save had been hit."""
    run_dir, checks = save_over(tmp_path, "created", chunks=1, pause=0, atomic=True)
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file_open"] is False
    assert hit["file_size"] == 1024  # the save was whole when the fault came
    assert (run_dir / "out" / "snapshot.pt").read_bytes() == bytes([2]) * 1024
    assert checks["faults_injected"][0]  # it was sent...
    passed, message = checks["faults_landed"]  # ...but after the save
    assert not passed
    assert "missed its window" in message
    assert "out/snapshot.pt was 1024 bytes, open for writing by no process" in message


def test_a_fast_save_over_a_file_is_judged_by_what_the_file_was(tmp_path: Path) -> None:
    """One write and a close take microseconds: whether the kill beats the close depends on
    the scheduler (on a loaded machine the harness, woken by the truncation, can run first).
    Either way the verdict follows the record, and the record follows the file."""
    run_dir, checks = save_over(tmp_path, "modified", chunks=1, pause=0)
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    snapshot = (run_dir / "out" / "snapshot.pt").read_bytes()
    passed, message = checks["faults_landed"]
    assert passed is hit["file_open"]
    if hit["file_open"]:
        # Hit between the truncating open and the close: what the save wrote, if anything.
        assert len(snapshot) <= 1024
        assert set(snapshot) <= {2}
    else:
        assert snapshot == bytes([2]) * 1024
        assert hit["file_size"] == 1024
        assert "missed its window" in message


@pytest.mark.parametrize("slow_look", [False, True], ids=["quick", "slow-look"])
def test_an_open_for_writing_is_told_by_who_holds_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_look: bool) -> None:
    """A save that rewrites its file in place changes nothing on open: only a process of the
    run seen holding it for writing says the open was a save's, before its first write.
    slow-look: the harness takes 2 s between its look at the file and the kill, as a loaded
    machine once made it (CI at stop 57): the save finished in between, and the record still
    said the kill came while the file was open. The kill's target is stopped for the look."""
    if slow_look:
        look = faults.file_writers

        def slow(*args: Any, **kwargs: Any) -> Any:
            found = look(*args, **kwargs)
            time.sleep(2.0)  # longer than what is left of the save (8 writes, 0.2 s apart)
            return found

        monkeypatch.setattr(faults, "file_writers", slow)
    run_dir, checks = save_over(tmp_path, "opened", chunks=8, pause=0.2, mode="r+b")
    (hit,) = read_events(run_dir / "events.jsonl", "fault_injected")
    assert hit["file_open"] is True
    assert hit["file_writers"] == [hit["pid"]]
    assert hit["file_looked_stopped"] is True
    snapshot = (run_dir / "out" / "snapshot.pt").read_bytes()
    assert len(snapshot) == 8 * 1024
    assert snapshot.count(2) < 8 * 1024  # the first save's bytes remain: torn
    assert checks["faults_landed"][0]


def test_validate_takes_the_new_triggers_and_names_the_allowed_ones(tmp_path: Path) -> None:
    scenario = """\
name: save-over
system: {{reference: trainer}}
faults:
  - kind: process.kill
    target: {{rank: 0}}
    at: {{file: 'step_*/rank_0.pt', when: {when}}}
expect: {{completes: false, faults_landed: in_window}}
"""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(scenario.format(when="modified"))
    bad.write_text(scenario.format(when="written"))
    proc = cli("validate", str(good))
    assert proc.returncode == 0, proc.stderr
    proc = cli("validate", str(bad))
    assert proc.returncode == 2
    assert (f"{bad}:6:42: faults.0.at.when: Input should be 'created', 'opened', 'modified', "
            "'closed' or 'deleted'") in proc.stderr


QUICK = ROOT / "tests" / "fixtures" / "quick_save_job.py"


class SlowTriggers(FileTriggers):
    """A harness that reads its watches 0.5 s late, as on a starved machine (load 20 on two
    cores): the job's save and commit are over by then."""

    def poll(self) -> list[tuple[int, FaultUnavailable]]:
        time.sleep(0.5)
        return super().poll()


def no_gate(root: Path, matches: object) -> Gate:
    raise FaultUnavailable("fanotify_init: Operation not permitted (permission events need "
                           "CAP_SYS_ADMIN: run as root)")


def quick_save(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, tuple[bool, str]]]:
    """Kill the quick saver when its third save's file is created; expect it inside."""
    text = f"""\
name: quick-save
system:
  command: [{sys.executable}, {QUICK}]
  cwd: ${{run_dir}}
  env: {{JOB_OUT: "${{run_dir}}/out"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) committed', event: step}}
faults:
  - kind: process.kill
    target: {{rank: 0}}
    at: {{file: 'out/step_*.data', when: created, count: 3}}
expect:
  completes: false
  faults_landed: in_window
"""
    loaded = LoadedScenario(parse_scenario(text), tmp_path / "s.yaml", text)
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    (hit,) = read_events(tmp_path / "run" / "events.jsonl", "fault_injected")
    return tmp_path / "run", hit, {c.name: (c.passed, c.message) for c in result.checks}


needs_fanotify = pytest.mark.skipif(
    fanotify_available() is not None, reason=f"no fanotify here: {fanotify_available()}")


def test_a_slow_harness_on_inotify_alone_misses_the_save_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without permission events (no CAP_SYS_ADMIN) a late harness kills after the commit:
    the run says the fault missed its window and why the job was not held."""
    monkeypatch.setattr(runner, "FileTriggers", SlowTriggers)
    monkeypatch.setattr(triggers, "Gate", no_gate)
    run_dir, hit, checks = quick_save(tmp_path)
    assert hit["file"] == "out/step_3.data"
    assert hit["file_held"] is False
    assert "CAP_SYS_ADMIN" in hit["file_held_why"]
    assert (run_dir / "out" / "step_3.commit").exists()  # the save was over
    passed, message = checks["faults_landed"]
    assert not passed
    assert "missed its window" in message
    assert "the job was not held" in message


@needs_fanotify
def test_a_slow_harness_holds_the_job_in_its_open_until_the_fault_is_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same late harness with permission events: the job's open of its third save's
    file waits in the kernel until the kill, so the save never commits."""
    monkeypatch.setattr(runner, "FileTriggers", SlowTriggers)
    run_dir, hit, checks = quick_save(tmp_path)
    assert hit["file"] == "out/step_3.data"
    assert hit["file_held"] is True
    assert hit["held_open"] == "out/step_3.data"
    assert hit["held_pid"] == hit["pid"]
    assert hit["file_size"] == 0  # killed inside the open: not a byte written
    assert (run_dir / "out" / "step_2.commit").exists()
    assert not (run_dir / "out" / "step_3.commit").exists()
    assert checks["faults_landed"][0], checks["faults_landed"][1]
    assert "held in its open of out/step_3.data" in checks["faults_landed"][1]


HOLDER = """\
import sys, time
from pathlib import Path
from aftershock.faults._fanotify import Gate
gate = Gate(Path(sys.argv[1]), lambda rel: rel.endswith(".data"))
gate.mark(".")
print("marked", flush=True)
while gate.held() is None:
    gate.settle(gate.take(), lambda match, path, pid: True)
    time.sleep(0.01)
print("holding", flush=True)
time.sleep(60)
"""


@needs_fanotify
@pytest.mark.parametrize("end", ["killed", "closed"])
def test_a_held_job_goes_on_when_the_harness_dies_or_closes(tmp_path: Path, end: str) -> None:
    """A job is never left blocked: the kernel allows a held open when the holder is killed
    outright (SIGKILL: no code of ours runs), and Gate.close allows it too."""
    script = HOLDER if end == "killed" else HOLDER.replace("time.sleep(60)", "gate.close()")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "marked\n"
        job = subprocess.Popen([sys.executable, "-c",
                                f"open({str(tmp_path / 'x.data')!r}, 'wb'); print('opened')"],
                               stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "holding\n"
        assert job.poll() is None  # blocked in its open
        if end == "killed":
            holder.kill()
        assert job.communicate(timeout=30)[0] == "opened\n"
    finally:
        holder.kill()
        holder.communicate()
