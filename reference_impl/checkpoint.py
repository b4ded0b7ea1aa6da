"""Atomic, checksummed, per-rank checkpoints with an all-ranks commit marker.

Layout on disk::

    <root>/step_000040/rank_0.pt     torch.save payload of rank 0's state
    <root>/step_000040/rank_0.json   {"size": ..., "sha256": ..., "step": ..., "rank": ..., ...}
    ...
    <root>/step_000040/COMMIT        written by rank 0 only after every rank has saved

Every file is written to a temporary name in the same folder, fsynced, renamed over its final
name and the folder fsynced, so a crash leaves either the old file or the new one, never a
torn one. The commit fsyncs the root too, after the marker, so that the step folder's own
entry survives a power loss (tested on a filesystem that loses everything not fsynced:
scenarios/faults/storage_lose_unsynced.yaml). The sidecar is written after the payload, so a
payload without a matching sidecar is never trusted. A step folder without COMMIT is a save
that some rank did not finish and is ignored. A step is loaded only when every rank has
verified its own file (sizes and sha256), agreed through an all_reduce(MIN), so no rank ever
resumes from a state its peers lack.

Assumes the root is visible to every rank at the same path (one host, or a shared file
system); with node-local disks rank 0 could not see the other ranks' files to prune them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aftershock.harness import probe

COMMIT = "COMMIT"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or all of the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename is durable only once the folder's entry is on disk.
    _fsync_dir(path.parent)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """All ``step_NNNNNN`` folders under ``root``, newest first."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            name = entry.name
            if entry.is_dir() and name.startswith("step_") and name[5:].isdigit():
                found.append((int(name[5:]), entry))
    return sorted(found, reverse=True)


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """Step folders that carry a COMMIT marker, newest first."""
    return [(step, path) for step, path in _step_dirs(root) if (path / COMMIT).is_file()]


def flag_device(group: Any) -> torch.device:
    """Where a small agreement flag must live to be reduced over ``group``: the CPU where the
    group has CPU collectives (Gloo), else the current GPU. NCCL has none: a CPU flag fails
    there with "No backend type associated with device type cpu" (the first GPU run's
    `restart` jobs, docs/gpu.md). torch's own rule for its object collectives decides."""
    return torch.device(dist.distributed_c10d._get_object_coll_device(group))


def save(
    root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], group: Any
) -> Path | None:
    """Save this rank's ``state`` for ``step`` and commit the step once all ranks have.

    Collective over ``group`` (the whole world): every rank must call it at the same step.
    Returns the step folder, or None when some rank could not write its files (a full disk,
    an I/O error): then nothing is committed, the partial files are removed, and every rank
    returns None, because they agree on the outcome through an all_reduce before the commit
    (rank 0 alone returns None when it cannot write the marker itself: the step is then not
    committed for anyone). A failed save costs a checkpoint, never the run.
    """
    rank = dist.get_rank(group)
    path = step_dir(root, step)
    error: OSError | None = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            # A resumed run re-saves steps it already saved before the failure. Drop the old
            # marker first so the folder is never "committed" while it mixes old and new
            # files.
            marker = path / COMMIT
            if marker.exists():
                marker.unlink()
                _fsync_dir(path)
        except OSError as exc:
            error = exc
    dist.barrier(group=group)

    if error is None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        sidecar = {
            **meta,
            "step": step,
            "rank": rank,
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        try:
            write_atomic(path / f"rank_{rank}.pt", payload)
            write_atomic(path / f"rank_{rank}.json", json.dumps(sidecar, sort_keys=True).encode())
        except OSError as exc:
            error = exc
    if error is not None:
        code = errno.errorcode.get(error.errno or 0, type(error).__name__)
        probe.emit("checkpoint_failed", step=step, error=f"{code}: {error.strerror or error}")
        probe.detected(cause=f"checkpoint_failed: {code}", step=step)
    else:
        probe.emit("checkpoint_written", step=step, path=str(path / f"rank_{rank}.pt"))

    # Commit only when every rank's file is durable: the MIN over all ranks' success flags is
    # also the barrier that orders every write before the commit.
    ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32,
                      device=flag_device(group))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() == 0:
        if rank == 0:  # every rank is past its writes: nobody adds files behind the rmtree
            shutil.rmtree(path, ignore_errors=True)
        return None
    # Every rank's shard is durable and the step is not committed: a crash from here until
    # COMMIT is on disk leaves a complete but uncommitted folder, which start-up must skip.
    probe.fault_point("save", step)
    if rank == 0:
        try:
            write_atomic(path / COMMIT, json.dumps({"step": step}).encode())
            # The step folder's own name in the root is durable only once the root is fsynced:
            # without it a power loss takes the whole committed step (mkdir is not durable).
            _fsync_dir(path.parent)
        except OSError as exc:
            # The files are whole but uncommitted: start-up ignores the folder, prune drops it.
            code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            probe.emit("checkpoint_failed", step=step, error=f"{code}: {exc.strerror or exc}")
            probe.detected(cause=f"checkpoint_failed: {code}", step=step)
            return None
    return path


def prune(root: Path, keep: int, current: int) -> None:
    """After committing ``current``: keep it and the newest ``keep - 1`` committed steps
    before it, and delete everything else.

    Folders newer than ``current`` belong to a timeline this run abandoned when it resumed
    from an older checkpoint (they were torn, corrupt, or never committed); uncommitted older
    ones are crashed saves. Called by rank 0 right after a commit: the other ranks cannot
    write another step before rank 0 joins the next save's first barrier, so nothing here
    races with them.
    """
    committed = [step for step, _ in committed_steps(root) if step <= current]
    keep_steps = set(committed[:keep]) | {current}
    for step, path in _step_dirs(root):
        if step not in keep_steps:
            shutil.rmtree(path, ignore_errors=True)


def verify(path: Path, rank: int, meta: dict[str, Any]) -> tuple[bytes | None, str]:
    """Read and check this rank's file in ``path``: (payload, "") or (None, reason)."""
    try:
        sidecar = json.loads((path / f"rank_{rank}.json").read_text())
        payload = (path / f"rank_{rank}.pt").read_bytes()
    except (OSError, ValueError) as exc:
        return None, f"unreadable: {type(exc).__name__}: {exc}"
    for key, value in meta.items():
        if sidecar.get(key) != value:
            return None, f"config mismatch: {key}={sidecar.get(key)!r}, this run has {value!r}"
    if len(payload) != sidecar.get("size"):
        return None, f"size mismatch: {len(payload)} bytes, expected {sidecar.get('size')}"
    if hashlib.sha256(payload).hexdigest() != sidecar.get("sha256"):
        return None, "sha256 mismatch"
    return payload, ""


def load_latest(
    root: Path, meta: dict[str, Any], group: Any
) -> tuple[int, Path, dict[str, Any]] | None:
    """Load the newest committed step that every rank can verify, or None to start fresh.

    Collective over ``group`` (the whole world). ``meta`` must match what the sidecars
    recorded at save time (seed, world shape, model shape), so a checkpoint of another
    configuration is skipped rather than loaded.
    """
    rank = dist.get_rank(group)
    # Rank 0's listing decides the candidates, so every rank walks the same list even if a
    # folder appears or vanishes while they look.
    listing: list[Any] = [[step for step, _ in committed_steps(root)] if rank == 0 else None]
    dist.broadcast_object_list(listing, src=dist.get_global_rank(group, 0), group=group)
    for step in listing[0]:
        path = step_dir(root, step)
        payload, reason = verify(path, rank, meta)
        # This rank knows the step it would restore; the ranks have not agreed on it yet.
        probe.fault_point("restore", step)
        ok = torch.tensor([1 if payload is not None else 0], dtype=torch.int32,
                          device=flag_device(group))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if payload is None:
            probe.checkpoint_skipped(str(path / f"rank_{rank}.pt"), reason, step=step)
        if ok.item() == 0:
            continue
        assert payload is not None  # the MIN over all ranks includes this one
        state = torch.load(io.BytesIO(payload), weights_only=True)
        return step, path, state
    return None
