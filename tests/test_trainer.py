"""The reference trainer's checkpoint files, without processes: verification and pruning.

The trainer's end-to-end behaviour under torchrun (the golden trajectory and its shape,
a SIGKILLed rank resuming from the newest checkpoint, a frozen rank caught by the collective
timeout, corrupt, truncated, unverifiable and torn checkpoints skipped) is what the shipped
scenarios in scenarios/training/ and scenarios/faults/ assert, each run once in
tests/test_shipped_scenarios.py together with the timeline evidence these tests used to
collect from runs of their own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")


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
