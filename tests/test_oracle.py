"""The independent oracle (aftershock.harness.oracle): a restatement of the reference trainer's
math.

Its pieces are checked bitwise against the reference model here (init, data, one replica's
gradients); the whole, against real runs: the shipped elastic scenario's faulted run
(params_match: replay, tests/test_shipped_scenarios.py) and the shipped fault-free twins'
golden digests (test_oracle_reproduces_the_golden_fault_free_runs below).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _helpers import ROOT

from aftershock.harness import oracle
from aftershock.harness.oracle import Generation, trainer_math
from aftershock.harness.run.runner import NullObserver, replay_digests
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario, TrainerSystem
from aftershock.reference_impl import model as reference_model
from aftershock.reference_impl.trainer import TrainConfig

pytestmark = pytest.mark.timeout(120)


def trainer(world: str = "{replicas: 2, shards: 2}", backend: str = "gloo") -> TrainerSystem:
    spec = parse_scenario(f"name: t\nsystem: {{reference: trainer, world: {world}, "
                          f"backend: {backend}, recovery: elastic, steps: 6}}\n")
    assert isinstance(spec.system, TrainerSystem)
    return spec.system


def test_the_oracle_imports_nothing_from_the_code_it_judges() -> None:
    for path in (ROOT / "harness" / "oracle").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] == "reference_impl"], path


def test_the_restated_hyperparameters_are_the_trainers() -> None:
    cfg = TrainConfig()
    restated = (trainer_math.D_MODEL, trainer_math.HIDDEN, trainer_math.BLOCKS,
                trainer_math.D_OUT, trainer_math.BATCH_SIZE, trainer_math.LR)
    actual = (cfg.d_model, cfg.hidden, cfg.blocks, cfg.model_config().d_out, cfg.batch_size,
              cfg.lr)
    assert restated == actual


@pytest.mark.parametrize(("step", "replica"), [(0, 0), (0, 1), (41, 1), (7, 3)])
def test_the_restated_data_is_the_trainers(step: int, replica: int) -> None:
    shape = trainer_math.Shape(replicas=4, shards=2)
    x, y = trainer_math.batch(shape, 5, step, replica)
    rx, ry = reference_model.synthetic_batch(TrainConfig().model_config(), 5, step, replica,
                                             TrainConfig().batch_size)
    assert torch.equal(x, rx)
    assert torch.equal(y, ry)


class _OneRank:
    """A tensor-parallel group of one rank: its all_reduce leaves the tensor as it is."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        class Done:
            def wait(self) -> None:
                pass

        return Done()


def _reference(shards: int, shard: int, seed: int) -> reference_model.ParallelMLP:
    layout = reference_model.Layout(1, shards, shard, _OneRank(), None, None)
    return reference_model.ParallelMLP(TrainConfig().model_config(), layout, seed)


@pytest.mark.parametrize("shards", [1, 2])
def test_the_restated_init_is_the_trainers(shards: int) -> None:
    params = trainer_math.Params(trainer_math.Shape(replicas=2, shards=shards), seed=3)
    for shard in range(shards):
        mine = params.state_dict(shard)
        theirs = _reference(shards, shard, seed=3).state_dict()
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            assert torch.equal(mine[key].detach(), theirs[key].detach()), key


def test_one_replicas_gradients_are_the_trainers() -> None:
    """One shard, so the reference model needs no process group: the same loss and the same
    gradients, bit for bit (two shards are covered by real runs, see the module docstring)."""
    shape = trainer_math.Shape(replicas=1, shards=1)
    params = trainer_math.Params(shape, seed=1)
    x, y = trainer_math.batch(shape, 1, 0, 0)
    loss = params.loss(x, y)
    grads = dict(zip([id(t) for t in params.all()], torch.autograd.grad(loss, params.all()),
                     strict=True))
    model = _reference(1, 0, seed=1)
    reference_loss = F.mse_loss(model(x), y)
    reference_loss.backward()
    assert torch.equal(loss, reference_loss)
    state = params.state_dict(0)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None
        assert torch.equal(grads[id(state[name])], parameter.grad), name


def test_membership_log_later_generations_replace_earlier_ones(tmp_path: Path) -> None:
    log = tmp_path / "membership.jsonl"
    lines = [{"gen": 0, "first_step": 1, "replicas": [0, 1]},
             {"gen": 1, "first_step": 28, "replicas": [1]},
             {"gen": 2, "first_step": 28, "replicas": [1, 0]},  # superseded gen 1 at once
             {"gen": 3, "first_step": 40, "replicas": [0]},
             {"gen": 4, "first_step": 35, "replicas": [1]}]  # went back to a snapshot
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert oracle.read_membership(log) == [
        Generation(1, (0, 1)), Generation(28, (0, 1)), Generation(35, (1,))]


@pytest.mark.parametrize("text", ["", "{\"gen\": 0}\n",
                                  "{\"gen\": 0, \"first_step\": 3, \"replicas\": [0]}\n"])
def test_a_malformed_membership_log_is_refused(tmp_path: Path, text: str) -> None:
    log = tmp_path / "membership.jsonl"
    log.write_text(text)
    with pytest.raises(ValueError, match="membership"):
        oracle.read_membership(log)


@pytest.mark.parametrize(("world", "backend", "schedule", "why"), [
    ("{replicas: 2, shards: 4}", "gloo", [Generation(1, (0, 1))], "4 shards"),
    ("{replicas: 3, shards: 1}", "gloo", [Generation(1, (0, 1, 2))], "3 live replicas"),
    ("{replicas: 2, shards: 2}", "nccl", [Generation(1, (0, 1))], "backend nccl"),
    ("{replicas: 1, shards: 2}", "nccl", [Generation(1, (0,))], "backend nccl"),
    ("{replicas: 2, shards: 2}", "gloo", [Generation(1, (0, 2))], "not in the world"),
])
def test_a_layout_it_cannot_reproduce_is_not_observed(
    world: str, backend: str, schedule: list[Generation], why: str
) -> None:
    expected = oracle.trainer_digests(trainer(world, backend), seed=0, schedule=schedule)
    assert expected.digests is None
    assert expected.note.startswith("not observed")
    assert why in expected.note


def test_one_nccl_rank_is_restated_on_cuda_and_needs_a_cuda_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL with one rank (1 replica x 1 shard) sums one term: the oracle restates it on the
    GPU. Without a CUDA device it cannot, and says so: never a pass."""
    assert oracle.unsupported(backend="nccl", replicas=1, shards=1,
                              schedule=[Generation(1, (0,))]) is None
    sent: list[dict[str, object]] = []

    def fake_run(argv: list[str], *, input: str, **kwargs: object) -> object:
        sent.append(json.loads(input))
        raise OSError("no interpreter here")

    monkeypatch.setattr(oracle.subprocess, "run", fake_run)
    expected = oracle.trainer_digests(trainer("{replicas: 1, shards: 1}", "nccl"), seed=0,
                                      schedule=[Generation(1, (0,))])
    assert expected.digests is None
    assert sent[0]["device"] == "cuda"
    # The gloo request names the CPU.
    oracle.trainer_digests(trainer("{replicas: 1, shards: 1}"), seed=0,
                           schedule=[Generation(1, (0,))])
    assert sent[1]["device"] == "cpu"


def test_the_restatement_refuses_cuda_without_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ci/gpu-check runs the restatement there")
    shape = trainer_math.Shape(replicas=1, shards=1)
    with pytest.raises(ValueError, match="no CUDA device"):
        trainer_math.final_digests(shape, 0, 2, [Generation(1, (0,))], device="cuda")
    with pytest.raises(ValueError, match="backend nccl"):
        trainer_math.final_digests(trainer_math.Shape(replicas=2, shards=1), 0, 2,
                                   [Generation(1, (0, 1))], device="cuda")


def test_params_match_replay_fails_as_not_observed_beyond_the_oracle(tmp_path: Path) -> None:
    """Three live replicas: the check fails and says why, it never passes by default."""
    text = ("name: wide\nsystem: {reference: trainer, world: {replicas: 3, shards: 1}, "
            "recovery: elastic, steps: 6}\nexpect: {params_match: replay}\n")
    path = tmp_path / "wide.yaml"
    path.write_text(text)
    (tmp_path / "run" / "output").mkdir(parents=True)
    (tmp_path / "run" / "output" / "membership.jsonl").write_text(
        '{"gen": 0, "first_step": 1, "replicas": [0, 1, 2]}\n')
    loaded = LoadedScenario(parse_scenario(text, str(path)), path, text)
    digests, note = replay_digests(loaded, seed=0, run_dir=tmp_path / "run",
                                   observer=NullObserver())
    assert digests is None
    assert note.startswith("not observed")
    assert "3 live replicas" in note
    digests, note = replay_digests(loaded, seed=0, run_dir=tmp_path / "nothing",
                                   observer=NullObserver())
    assert digests is None
    assert "no membership log" in note


@pytest.mark.slow
def test_the_membership_changes_the_digests_only_where_it_should() -> None:
    """Through the subprocess the check uses: a replica missing for two steps changes every
    rank's digest; the replicas of one shard always agree; shards differ."""
    system = trainer()
    full = oracle.trainer_digests(system, seed=0, schedule=oracle.full_membership(system))
    gap = oracle.trainer_digests(system, seed=0, schedule=[
        Generation(1, (0, 1)), Generation(4, (1,)), Generation(6, (0, 1))])
    assert full.digests is not None, full.note
    assert gap.digests is not None, gap.note
    assert sorted(full.digests) == sorted(gap.digests) == [0, 1, 2, 3]
    assert full.digests[0] == full.digests[2] != full.digests[1] == full.digests[3]
    assert all(full.digests[r] != gap.digests[r] for r in range(4))
    # A replica still missing at the end reports nothing, as in the trainer.
    alone = oracle.trainer_digests(system, seed=0, schedule=[
        Generation(1, (0, 1)), Generation(4, (1,))])
    assert alone.digests is not None
    assert sorted(alone.digests) == [2, 3]
