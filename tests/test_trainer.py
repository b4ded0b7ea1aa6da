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
    from aftershock.reference_impl import checkpoint

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
    from aftershock.reference_impl.checkpoint import verify

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
    from aftershock.reference_impl.checkpoint import committed_steps, prune

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


# --- fast: who holds the state a recovering hot_spare/elastic generation resumes from --------


def _held(gen: int, steps: int, pending: int = -1) -> object:
    from aftershock.reference_impl.resilient import Held

    return Held(gen, steps, pending)


@pytest.mark.timeout(30)
def test_the_start_resumes_from_the_seeded_init_and_fresh_spares_never_do_later() -> None:
    from aftershock.reference_impl.resilient import ready_at

    fresh = {r: _held(-1, 0) for r in range(4)}
    assert ready_at(fresh, fresh_is_step_0=True) == (0, {0, 1, 2, 3})
    # Every holder of the state died at once and two spares took over: they hold nothing,
    # so the caller goes to the snapshots (it used to start over from step 0 in silence).
    assert ready_at({0: _held(-1, 0), 1: _held(-1, 0)}, fresh_is_step_0=False) == (0, set())
    survivors = {0: _held(-1, 0), 1: _held(3, 25), 2: _held(-1, 0), 3: _held(3, 25)}
    assert ready_at(survivors, fresh_is_step_0=False) == (25, {1, 3})


@pytest.mark.timeout(30)
def test_a_dropped_replica_never_counts_whatever_its_step() -> None:
    from aftershock.reference_impl.resilient import ready_at

    # Replica 0 was dropped at step 25 (lineage 0); replica 1 trained on alone to 27.
    rejoin = {0: _held(0, 25), 1: _held(-1, 0), 2: _held(1, 27), 3: _held(1, 27)}
    assert ready_at(rejoin, fresh_is_step_0=False) == (27, {2, 3})
    # Replica 1 rolled back below replica 0's step (a fingerprint mismatch): still its state.
    rolled = {0: _held(0, 25), 2: _held(2, 20)}
    assert ready_at(rolled, fresh_is_step_0=False) == (20, {2})


@pytest.mark.timeout(30)
def test_a_member_that_lost_the_vote_rolls_forward_in_its_generation_only() -> None:
    from aftershock.reference_impl.resilient import ready_at

    # Generation 4 committed step 30 on rank 0; ranks 1 and 2 averaged it, rank 1's vote
    # failed (still at 29, lineage 3: its last commit was in generation 3).
    held = {0: _held(4, 30), 1: _held(3, 29, pending=4), 2: _held(3, 29)}
    assert ready_at(held, fresh_is_step_0=False) == (30, {0, 1})
    # Gradients averaged in an older generation are not the ones the winners applied.
    held = {0: _held(4, 30), 1: _held(3, 29, pending=3)}
    assert ready_at(held, fresh_is_step_0=False) == (30, {0})
