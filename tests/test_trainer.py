"""End-to-end tests of the reference trainer under torchrun: real processes, real Gloo groups.

Each run starts 4 torch processes on a small machine (several seconds), so the fault-free
golden run is shared by a module fixture and faults are injected from the test itself:
SIGKILL and SIGSTOP of the process whose environment says RANK=1, found through a marker
variable (AFTERSHOCK_RUN_ID) in /proc/*/environ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
WORLD = 4
STEPS = 60
EVERY = 10
TIMEOUT_S = 3  # --collective-timeout of the fault runs


@dataclass(frozen=True, slots=True)
class Run:
    root: Path
    run_id: str
    returncode: int
    wall_s: float

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.root / "events.jsonl", kind)

    def digests(self) -> dict[int, str]:
        return {e["rank"]: e["digest"] for e in self.events("params")}

    def log(self) -> str:
        return (self.root / "torchrun.log").read_text(errors="replace")[-4000:]


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return [e for e in events if kind is None or e["event"] == kind]


def marked_pids(run_id: str, rank: int | None = None) -> list[int]:
    """Pids whose environment carries this run's marker (and RANK=rank, when given)."""
    want = f"AFTERSHOCK_RUN_ID={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env and (rank is None or f"RANK={rank}".encode() in env):
            pids.append(int(entry.name))
    return pids


def reap(run_id: str) -> None:
    """Leave nothing behind: thaw and kill every process of the run."""
    for pid in marked_pids(run_id):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


@contextlib.contextmanager
def launch(root: Path, *args: str, steps: int = STEPS, sleep: float = 0.0) -> Iterator[Any]:
    """Start torchrun on the trainer; yield (process, run_id); always clean up."""
    root.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    env = {
        **os.environ,
        "AFTERSHOCK_EVENTS": str(root / "events.jsonl"),
        "AFTERSHOCK_OUTPUT_DIR": str(root / "output"),
        "AFTERSHOCK_RUN_ID": run_id,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "--max-restarts=3",
        "-m", "reference_impl.trainer",
        "--replicas", "2", "--shards", "2", "--steps", str(steps), "--seed", "0",
        "--checkpoint-every", str(EVERY), "--checkpoint-dir", str(root / "checkpoints"),
        "--collective-timeout", str(TIMEOUT_S), "--step-sleep", str(sleep),
        *args,
    ]  # fmt: skip
    with (root / "torchrun.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc, run_id
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reap(run_id)


def run_to_end(root: Path, *args: str, steps: int = STEPS) -> Run:
    start = time.monotonic()
    with launch(root, *args, steps=steps) as (proc, run_id):
        returncode = proc.wait(timeout=200)
    return Run(root, run_id, returncode, time.monotonic() - start)


def wait_for_step(root: Path, step: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(e["step"] >= step for e in read_events(root / "events.jsonl", "step")):
            return
        assert proc.poll() is None, "trainer exited before the fault could be injected"
        time.sleep(0.01)
    pytest.fail(f"step {step} never appeared")


def assert_complete(run: Run, golden: Run) -> None:
    assert run.returncode == 0, run.log()
    finals = run.events("params")
    assert sorted(e["rank"] for e in finals) == list(range(WORLD)), run.log()
    assert run.digests() == golden.digests()


# --- fast: the checkpoint files themselves, no processes --------------------------------------


def _fake_save(root: Path, step: int, *, commit: bool = True) -> Path:
    from reference_impl import checkpoint

    path = checkpoint.step_dir(root, step)
    path.mkdir(parents=True)
    payload = f"state of step {step}".encode()
    checkpoint.write_atomic(path / "rank_0.pt", payload)
    sidecar = {"seed": 0, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    checkpoint.write_atomic(path / "rank_0.json", json.dumps(sidecar).encode())
    if commit:
        checkpoint.write_atomic(path / checkpoint.COMMIT, b"{}")
    return path


@pytest.mark.timeout(30)
def test_verify_accepts_intact_and_names_what_is_wrong(tmp_path: Path) -> None:
    from reference_impl.checkpoint import verify

    path = _fake_save(tmp_path, 10)
    assert verify(path, 0, {"seed": 0}) == (b"state of step 10", "")
    assert verify(path, 0, {"seed": 1})[1].startswith("config mismatch: seed=0")
    assert verify(path, 1, {"seed": 0})[1].startswith("unreadable: FileNotFoundError")
    (path / "rank_0.pt").write_bytes(b"state of step 11")
    assert verify(path, 0, {"seed": 0}) == (None, "sha256 mismatch")
    (path / "rank_0.pt").write_bytes(b"state of step")
    assert verify(path, 0, {"seed": 0})[1].startswith("size mismatch")
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(30)
def test_prune_keeps_newest_committed_and_drops_stale_timelines(tmp_path: Path) -> None:
    from reference_impl.checkpoint import committed_steps, prune

    for step in (10, 20, 30, 40):
        _fake_save(tmp_path, step)
    _fake_save(tmp_path, 25, commit=False)  # a crashed save
    _fake_save(tmp_path, 50)  # from a timeline abandoned after resuming at 40
    prune(tmp_path, keep=3, current=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000020",
        "step_000030",
        "step_000040",
    ]
    assert [step for step, _ in committed_steps(tmp_path)] == [40, 30, 20]


# --- slow: real torchrun worlds ----------------------------------------------------------------


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The fault-free trajectory everything else must reproduce bit for bit."""
    return run_to_end(tmp_path_factory.mktemp("golden"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fault_free_run_is_complete_and_deterministic(golden: Run, tmp_path: Path) -> None:
    assert golden.returncode == 0, golden.log()
    assert len(golden.events("hello")) == WORLD
    steps: dict[int, list[int]] = {}
    for e in golden.events("step"):
        steps.setdefault(e["rank"], []).append(e["step"])
    assert steps == {rank: list(range(1, STEPS + 1)) for rank in range(WORLD)}
    assert not golden.events("failure_detected")
    # Shards of one replica differ, replicas of one shard are identical (pure data parallel).
    digests = golden.digests()
    assert len(digests) == WORLD
    assert digests[0] == digests[2]
    assert digests[1] == digests[3]
    assert digests[0] != digests[1]
    saved = [e["step"] for e in golden.events("checkpoint_saved")]
    assert saved == list(range(EVERY, STEPS + 1, EVERY))
    # Only the newest 3 committed checkpoints are kept.
    kept = sorted(p.name for p in golden.checkpoints.iterdir())
    assert kept == [f"step_{s:06d}" for s in (STEPS - 2 * EVERY, STEPS - EVERY, STEPS)]
    assert all((golden.root / "output" / "final" / f"rank_{r}.pt").exists() for r in range(4))

    again = run_to_end(tmp_path)
    assert_complete(again, golden)
    print(f"fault-free run: {golden.wall_s:.1f}s and {again.wall_s:.1f}s wall")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_rank_restarts_from_checkpoint_and_matches(golden: Run, tmp_path: Path) -> None:
    with launch(tmp_path, sleep=0.02) as (proc, run_id):
        wait_for_step(tmp_path, 25, proc)
        (victim,) = marked_pids(run_id, rank=1)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        returncode = proc.wait(timeout=200)
    run = Run(tmp_path, run_id, returncode, 0.0)
    assert_complete(run, golden)

    detected = run.events("failure_detected")
    assert detected, run.log()
    loaded = run.events("checkpoint_loaded")
    assert {e["step"] for e in loaded} == {20}
    assert sorted(e["rank"] for e in loaded) == list(range(WORLD))
    # Time to recover: the kill until every rank of the new generation committed a step.
    resumed = [e["t"] for e in run.events("step") if e["t"] > killed_at and e["step"] == 21]
    assert len(resumed) == WORLD
    print(f"kill -> detect {detected[0]['t'] - killed_at:.2f}s, -> resumed step "
          f"{max(resumed) - killed_at:.2f}s")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_corrupt_checkpoint_is_skipped(golden: Run, tmp_path: Path) -> None:
    shutil.copytree(golden.checkpoints, tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / f"step_{STEPS:06d}" / "rank_2.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    # A save that crashed before COMMIT: torn file, no marker. It must be ignored.
    torn = tmp_path / "checkpoints" / f"step_{STEPS + EVERY:06d}"
    torn.mkdir()
    (torn / "rank_0.pt").write_bytes(b"torn")

    # Resuming must skip the corrupt step and retrain from the one before it, ending at the
    # same step (and so the same bits) as the golden run.
    run = run_to_end(tmp_path)
    assert_complete(run, golden)
    skipped = run.events("checkpoint_skipped")
    assert [(e["rank"], e["step"], e["reason"]) for e in skipped] == [(2, STEPS, "sha256 mismatch")]
    assert {e["step"] for e in run.events("checkpoint_loaded")} == {STEPS - EVERY}
    retrained = [e["step"] for e in run.events("step") if e["rank"] == 0]
    assert retrained == list(range(STEPS - EVERY + 1, STEPS + 1))
    # The retrained step was committed afresh, the torn folder was pruned.
    assert (tmp_path / "checkpoints" / f"step_{STEPS:06d}" / "COMMIT").exists()
    assert not torn.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_frozen_rank_is_detected_and_world_restarts(golden: Run, tmp_path: Path) -> None:
    start = time.monotonic()
    with launch(tmp_path, sleep=0.02) as (proc, run_id):
        stopped: list[int] = []
        try:
            wait_for_step(tmp_path, 25, proc)
            stopped = marked_pids(run_id, rank=1)
            frozen_at = time.monotonic()
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            returncode = proc.wait(timeout=200)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    run = Run(tmp_path, run_id, returncode, time.monotonic() - start)
    assert_complete(run, golden)

    detected = run.events("failure_detected")
    assert detected, run.log()
    first = min(e["t"] for e in detected) - frozen_at
    assert first < TIMEOUT_S + 3, f"detection took {first:.1f}s"
    assert any(e["cause"] == "collective_timeout" for e in detected), detected
    generations = {e["generation"] for e in run.events("hello")}
    assert generations == {0, 1}
    print(f"freeze -> detect {first:.2f}s, run {run.wall_s:.1f}s")
