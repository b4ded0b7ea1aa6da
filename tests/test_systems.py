"""System kinds as plug-ins: each built-in one answers everything the harness asks, the
scenario format tells them apart by their tags, and `aftershock faults` filters by them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import RANKS_JOB, ROOT, cli

from aftershock.harness import systems
from aftershock.harness.errors import SpecError
from aftershock.harness.scenario.load import parse_scenario

PROBE_JOB = ROOT / "tests" / "fixtures" / "probe_job.py"
#: Everything the run loop, the baseline cache, goldens, the CLI and the spec ask a kind.
ASKED = ("name", "model", "tag", "shape", "order", "family", "golden", "launch", "target",
         "capabilities", "probe", "world", "steps", "default_root", "root_is_run_folder",
         "twin", "twin_key", "fingerprint", "device", "driver", "log_probes", "replays",
         "file_problems", "problems")


def test_the_built_in_kinds_answer_everything_the_harness_asks() -> None:
    kinds = systems.kinds()
    assert [k.name for k in kinds][:3] == ["trainer", "server", "command"]
    for kind in kinds:
        missing = [name for name in ASKED if not hasattr(kind, name)]
        assert not missing, (kind.name, missing)


def test_a_system_block_is_told_apart_by_its_tag() -> None:
    assert systems.claimed({"reference": "server", "workers": 2}) is systems.get("server")
    assert systems.claimed({"command": ["x"]}) is systems.get("command")
    assert systems.claimed({"reference": "bogus"}) is None
    spec = parse_scenario("name: x\nsystem: {reference: trainer}\n")
    assert systems.of(spec.system) is systems.get("trainer")
    with pytest.raises(SpecError) as caught:
        parse_scenario("name: x\nsystem: {reference: bogus}\n", "s.yaml")
    assert caught.value.problems == [
        "s.yaml:2:9: system: system needs `reference: trainer`, `reference: server`, "
        "`command: [...]`, `nodes: N` or `slurm: {nodes: N, ...}`"]


def test_what_a_run_of_each_kind_launches(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = parse_scenario("name: x\nsystem: {reference: trainer, world: {replicas: 2, "
                             "shards: 1}}\n").system
    launch = systems.of(trainer).launch(trainer, run_dir=run, scenario_dir=tmp_path, seed=7)
    assert "--nproc-per-node=2" in launch.argv
    assert "--seed=7" in launch.argv
    assert launch.world == 2
    command = parse_scenario("name: x\nsystem:\n  command: [echo, '${run_dir}/x']\n"
                             "  env: {OUT: '${scenario_dir}'}\n").system
    launch = systems.of(command).launch(command, run_dir=run, scenario_dir=tmp_path, seed=0)
    assert launch.argv == ["echo", f"{run}/x"]
    assert launch.env == {"OUT": str(tmp_path.resolve())}
    # A command's file faults act where it works: the fresh folder it was launched in.
    assert systems.of(command).default_root(command, run) == run / "work" == launch.cwd
    assert systems.of(trainer).default_root(trainer, run) == run / "checkpoints"


def faults_listed(*args: str) -> set[str]:
    proc = cli("faults", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return {entry["kind"] for entry in json.loads(proc.stdout)}


def test_aftershock_faults_lists_what_applies_to_a_system(tmp_path: Path) -> None:
    plain = faults_listed("--system", "command")
    assert {"process.kill", "net.partition", "memory.nan", "storage.full"} <= plain
    assert not {k for k in plain if k.startswith("collective.")} | ({"process.hang"} & plain)
    assert {"collective.hang", "process.hang"} <= faults_listed("--system", "trainer")
    scenario = tmp_path / "probed.yaml"
    scenario.write_text(f"name: x\nsystem: {{command: [{sys.executable}, {PROBE_JOB}]}}\n")
    assert "collective.hang" in faults_listed("--for", str(scenario))
    scenario.write_text(f"name: x\nsystem: {{command: [{sys.executable}, {RANKS_JOB}]}}\n")
    assert "collective.hang" not in faults_listed("--for", str(scenario))
    unknown = cli("faults", "--system", "bogus")
    assert unknown.returncode == 2
    assert "unknown system kind 'bogus'" in unknown.stderr
    both = cli("faults", "--system", "command", "--for", str(scenario))
    assert both.returncode == 2
