"""The training bench holds its failure-free rows to the oracle too (real torchrun jobs)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from bench.peers import PEERS, Command, Context, Model, Peer
from bench.run import QUICK, _marked_pids, run_job

SHORT = dataclasses.replace(QUICK, kill_at=12, warmup=4, deadline_s=120.0)


def _run(peer: Peer) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    result = run_job(peer, SHORT, Model(), marker, None, {})
    assert _marked_pids(marker) == []  # nothing of the job survives it
    return result


def _ddp() -> Peer:
    return next(p for p in PEERS if p.name == "ddp")


def _row(name: str) -> Peer:
    return next(p for p in PEERS if p.name == name)


def test_a_failure_free_row_ends_with_the_oracles_parameters() -> None:
    result = _run(_ddp())
    assert result["outcome"] == "completed", result
    assert result["params_match"] is True, result["params_note"]
    # Its loop timed its phases over the CPU window, every rank (reference_impl/phases.py).
    phases = result["phases"]
    assert phases is not None, "no phase table from the DDP loop"
    assert set(phases) == {"batch", "forward", "zero_grad", "backward", "optimizer", "rest"}
    assert phases["backward"]["wall_ms"] > 0
    assert phases["forward"]["cpu_ms"] > 0


def test_the_reference_loop_times_its_average_and_its_vote() -> None:
    result = _run(_row("trainer_no_ckpt"))
    assert result["outcome"] == "completed", result
    assert result["params_match"] is True, result["params_note"]
    phases = result["phases"]
    assert phases is not None, "no phase table from the reference trainer's loop"
    assert {"average", "vote", "backward", "optimizer"} <= set(phases), phases
    assert all(v["wall_ms"] >= 0 and v["cpu_ms"] >= 0 for v in phases.values())


def test_a_failure_free_row_that_trains_differently_is_caught() -> None:
    """A deliberately broken baseline: plain DDP with another learning rate. It is as fast
    as DDP, and its parameters are not the oracle's."""
    ddp = _ddp()

    def broken(ctx: Context) -> list[Command]:
        return [Command([*c.argv, "--lr=0.002"], c.env, c.name) for c in ddp.commands(ctx)]

    peer = dataclasses.replace(ddp, name="ddp_other_lr", commands=broken)
    result = _run(peer)
    assert result["outcome"] == "completed", result
    assert result["params_match"] is False, result.get("params_note")
    assert "differ from the oracle" in result["params_note"]


def test_the_one_rank_rows_of_the_gpu_bench_run_and_recover_as_one_rank() -> None:
    """`python -m bench --gpu` trains one rank (1 replica x 1 shard). Its rows, here with Gloo
    on the CPU (the same layout; the GPU run swaps in NCCL and CUDA): the faulted rows lose
    their only rank, torchrun restarts it, and every row ends with the oracle's parameters
    for one replica."""
    one = dataclasses.replace(Model(), replicas=1, shards=1)
    assert one.kill_rank == 0
    rows = [p for p in PEERS if p.one_rank]
    assert {p.name for p in rows} == {"ddp", "trainer_no_ckpt", "restart", "torchrun_ddp"}
    for peer in rows:
        marker = uuid.uuid4().hex
        result = run_job(peer, SHORT, one, marker, None, {})
        assert _marked_pids(marker) == []
        assert result["outcome"] == "completed", (peer.name, result)
        assert result["params_match"] is True, (peer.name, result["params_note"])
        assert result["steps_per_s"], (peer.name, result)
        if peer.fault:
            assert result["restarts"] >= 1, (peer.name, result)
            assert result["full_s"] is not None, (peer.name, result)
        else:
            assert result["phases"] is not None, (peer.name, result)
