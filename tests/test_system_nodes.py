"""The `nodes: N` system kind without an engine: its block, what each node launches, its
twin's key, and what validate refuses (a node target where there are no nodes, a node that
is not there). The runs on a real engine are the shipped scenarios/nodes/ and tests/nodes/."""

from __future__ import annotations

from pathlib import Path

import pytest

from aftershock.harness import systems
from aftershock.harness.errors import SpecError
from aftershock.harness.scenario.load import parse_scenario, unreachable
from aftershock.harness.systems.nodes import NodesLaunch

TRAINER = "  nodes: 2\n  trainer: {steps: 30, checkpoint_every: 5, step_sleep: 50ms}\n"


def scenario(system: str, faults: str = "") -> str:
    return f"name: x\nsystem:\n{system}" + (f"faults:\n{faults}" if faults else "")


def test_each_node_runs_torchrun_meeting_at_node_0(tmp_path: Path) -> None:
    spec = parse_scenario(scenario(TRAINER))
    kind = systems.of(spec.system)
    assert kind is systems.get("nodes")
    launch = kind.launch(spec.system, run_dir=tmp_path, scenario_dir=tmp_path, seed=3)
    assert isinstance(launch, NodesLaunch)
    assert (launch.nodes, launch.restart, launch.world) == (2, "on-failure", 2)
    for flag in ("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=node0:29400", "--replicas=2", "--shards=1", "--seed=3",
                 "--steps=30", "--step-sleep=0.05", f"--checkpoint-dir={tmp_path}/checkpoints"):
        assert flag in launch.argv, flag
    assert kind.default_root(spec.system, tmp_path) == tmp_path / "checkpoints"
    assert {"containers", "signals", "files"} <= kind.capabilities(spec.system)


def test_hot_spare_puts_the_spares_on_node_0_after_its_ranks(tmp_path: Path) -> None:
    """Node 0 runs its ranks and the spares (its slots come first in torchrun's order), the
    others their ranks; every agent bounds torchrun's exit barrier, and a node that died
    and stays down does not fail the job."""
    spec = parse_scenario(scenario("  nodes: 2\n  per_node: 2\n  restart: 'no'\n  trainer: "
                                   "{recovery: hot_spare, spares: 2, shards: 2}\n"))
    kind = systems.of(spec.system)
    launch = kind.launch(spec.system, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    assert isinstance(launch, NodesLaunch)
    assert launch.world == 4
    assert launch.node_loss_ok
    assert "--nproc-per-node=4" in launch.node0_argv
    assert "--nproc-per-node=2" in launch.argv
    for argv in (launch.argv, launch.node0_argv):
        for flag in ("aftershock.harness.nodes.launcher", "--recovery=hot_spare", "--spares=2",
                     "--first-spare=2", "--replicas=2", "--shards=2"):
            assert flag in argv, flag
    restart = parse_scenario(scenario(TRAINER)).system
    plain = kind.launch(restart, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    assert isinstance(plain, NodesLaunch)
    assert (plain.node0_argv, plain.node_loss_ok) == ((), False)
    assert "torch.distributed.run" in plain.argv


def test_the_twin_key_keeps_the_math_and_drops_the_pacing() -> None:
    kind = systems.get("nodes")
    slow = parse_scenario(scenario(TRAINER + "  restart: always\n  rdzv_conf: "
                                   "keep_alive_interval=1\n")).system
    fast = parse_scenario(scenario("  nodes: 2\n  trainer: {steps: 30}\n")).system
    assert kind.twin_key(kind.twin(slow)) == kind.twin_key(fast)
    other = parse_scenario(scenario("  nodes: 2\n  trainer: {steps: 31}\n")).system
    assert kind.twin_key(other) != kind.twin_key(fast)
    four = parse_scenario(scenario("  nodes: 2\n  per_node: 2\n  trainer: {steps: 30}\n")).system
    assert kind.twin_key(four) != kind.twin_key(fast)


@pytest.mark.parametrize(("system", "needle"), [
    ("  nodes: 2\n", "exactly one of `trainer:`"),
    ("  nodes: 2\n  trainer: {}\n  program: [x.py]\n", "exactly one of `trainer:`"),
    ("  nodes: 1\n  trainer: {}\n", "greater than or equal to 2"),
    ("  nodes: 3\n  trainer: {shards: 2}\n", "not a multiple of trainer.shards 2"),
    ("  nodes: 2\n  trainer: {}\n  world: 2\n", "`world` is for `program`"),
    ("  nodes: 2\n  trainer: {}\n  rdzv_conf: 'a b'\n", "rdzv_conf"),
    ("  nodes: 2\n  trainer: {recovery: elastic}\n", "elastic is not offered across nodes"),
    ("  nodes: 2\n  trainer: {recovery: hot_spare}\n", 'set restart: "no"'),
    ("  nodes: 2\n  per_node: 2\n  trainer: {recovery: hot_spare, spares: 1}\n"
     "  restart: 'no'\n", "set trainer.spares: 2 or more"),
])
def test_a_malformed_nodes_block_is_refused(system: str, needle: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_scenario(scenario(system), "s.yaml")
    assert needle in " ".join(caught.value.problems), caught.value.problems


def test_a_node_target_needs_nodes_and_one_that_is_there() -> None:
    kill = "  - kind: node.kill\n    target: {node: 1}\n    at: {step: 5}\n"
    assert unreachable(parse_scenario(scenario(TRAINER, kill)), None) == []
    with pytest.raises(SpecError) as caught:
        parse_scenario(scenario("  reference: trainer\n", kill), "s.yaml")
    assert "s.yaml:5:5: faults.0: target {node: 1} names a node of a multi-node system" in \
        caught.value.problems[0]
    process = "  - kind: node.kill\n    target: {rank: 1}\n    at: {step: 5}\n"
    with pytest.raises(SpecError) as caught:
        parse_scenario(scenario("  reference: trainer\n", process), "s.yaml")
    assert "Docker engine" in caught.value.problems[0]
    with pytest.raises(SpecError) as caught:
        parse_scenario(scenario(TRAINER, kill.replace("node: 1", "node: 2")), "s.yaml")
    assert "the system has 2 nodes (0..1)" in " ".join(caught.value.problems)
    with pytest.raises(SpecError):
        parse_scenario(scenario(TRAINER, kill.replace("{node: 1}", "{node: 1, rank: 0}")))


def test_a_local_target_has_no_nodes(tmp_path: Path) -> None:
    spec = parse_scenario("name: x\nsystem: {command: [echo]}\n")
    kind = systems.of(spec.system)
    launch = kind.launch(spec.system, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    from aftershock.harness.run.timeline import Timeline

    target = kind.target(launch, run_dir=tmp_path, run_id="0" * 32,
                         timeline=Timeline(tmp_path / "events.jsonl"))
    assert target.node_processes(0) == []


def test_a_relative_run_folder_is_the_same_absolute_path_in_every_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node mounts the run folder at its absolute path and runs from the project's folder:
    a relative one (`aftershock golden` runs twins under .aftershock/runs) would be refused
    by the engine, or name another folder inside the node."""
    monkeypatch.chdir(tmp_path)
    spec = parse_scenario(scenario(TRAINER))
    kind = systems.of(spec.system)
    launch = kind.launch(spec.system, run_dir=Path("r"), scenario_dir=tmp_path, seed=0)
    assert f"--checkpoint-dir={tmp_path}/r/checkpoints" in launch.argv
    assert f"--log-dir={tmp_path}/r/logs/torchrun" in launch.argv
    from aftershock.harness.run.timeline import Timeline

    target = kind.target(launch, run_dir=Path("r"), run_id="0" * 32,
                         timeline=Timeline(tmp_path / "events.jsonl"))
    assert target.tracking()["value"] == "0" * 32
    assert target.cluster.run_dir == tmp_path / "r"  # type: ignore[attr-defined]
    assert target.cluster.env[
        "AFTERSHOCK_EVENTS"] == f"{tmp_path}/r/events.jsonl"  # type: ignore[attr-defined]
