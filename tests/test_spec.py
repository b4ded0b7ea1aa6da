"""Scenario parsing: exact positions, allowed values, strictness, durations."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from aftershock.harness.errors import SpecError
from aftershock.harness.scenario._duration import parse_duration
from aftershock.harness.scenario.load import discover, json_schema, load_scenario, parse_scenario
from aftershock.harness.scenario.spec import CommandSystem, ProcessFreeze, TrainerSystem

ROOT = Path(__file__).resolve().parent.parent

GOOD = """\
name: kill-one
system:
  reference: trainer
  world: {replicas: 2, shards: 2}
faults:
  - kind: process.freeze
    target: {rank: 1}
    at: {time: 1.5s}
    duration: 500ms
expect:
  params_match: fault_free
  time_to_recover: {max: 5s}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_scenario(text, "s.yaml")
    return info.value.problems


def test_good_scenario_parses_into_typed_models() -> None:
    spec = parse_scenario(GOOD)
    assert isinstance(spec.system, TrainerSystem)
    assert spec.system.world.size == 4
    fault = spec.faults[0]
    assert isinstance(fault, ProcessFreeze)
    assert fault.at.time == timedelta(seconds=1.5)
    assert fault.duration == timedelta(milliseconds=500)
    assert spec.expect.time_to_recover is not None
    assert spec.expect.time_to_recover.max == timedelta(seconds=5)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("1.5m", 90.0), ("1h", 3600.0), (3, 3.0)],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5q", "-1s", "s", True, "1 2s"])
def test_bad_durations_say_what_is_allowed(bad: object) -> None:
    with pytest.raises(ValueError, match="duration like 500ms"):
        parse_duration(bad)


def test_misspelt_key_names_line_column_and_suggests() -> None:
    text = GOOD.replace("    duration: 500ms", "    duraton: 500ms")
    (problem,) = problems(text)
    assert problem.startswith("s.yaml:9:5: faults.0.duraton: unknown key 'duraton'")
    assert "did you mean 'duration'?" in problem
    assert "allowed: at, duration, every, kind, target" in problem


def test_unknown_fault_kind_lists_kinds() -> None:
    (problem,) = problems(GOOD.replace("process.freeze", "process.explode"))
    assert problem.startswith("s.yaml:6:5: faults.0: unknown kind 'process.explode'")
    assert "'process.kill'" in problem


def test_wrong_value_points_at_the_value() -> None:
    (problem,) = problems(GOOD.replace("replicas: 2", "replicas: 0"))
    assert problem.startswith("s.yaml:4:21: system.world.replicas:")
    assert "greater than or equal to 1" in problem


def test_every_problem_is_reported_at_once() -> None:
    text = GOOD.replace("replicas: 2", "replicas: x").replace("max: 5s", "max: soon")
    found = problems(text)
    assert len(found) == 2
    assert any("system.world.replicas" in p for p in found)
    assert any("expect.time_to_recover.max" in p and "got 'soon'" in p for p in found)


def test_system_needs_reference_or_command() -> None:
    (problem,) = problems("name: x\nsystem: {steps: 3}\n")
    assert problem == ("s.yaml:2:9: system: system needs `reference: trainer`, "
                       "`reference: server`, `command: [...]`, `nodes: N` or "
                       "`slurm: {nodes: N, ...}`")


def test_duplicate_keys_are_errors() -> None:
    (problem,) = problems("name: x\nname: y\nsystem: {reference: trainer}\n")
    assert problem == "s.yaml:2:1: duplicate key 'name'"


def test_yaml_syntax_error_has_position() -> None:
    (problem,) = problems("name: x\nsystem: [\n")
    assert problem.startswith("s.yaml:3:1: invalid YAML:")


def test_target_needs_exactly_one_selector() -> None:
    (problem,) = problems(GOOD.replace("{rank: 1}", "{rank: 1, pick: random}"))
    assert "s.yaml:7:13: faults.0.target: give exactly one of" in problem


def test_budgets_without_faults_are_rejected() -> None:
    text = "name: x\nsystem: {reference: trainer}\nexpect: {time_to_detect: {max: 1s}}\n"
    (problem,) = problems(text)
    assert "expect.time_to_detect needs at least one fault" in problem


def test_params_match_on_a_command_needs_a_params_probe() -> None:
    text = "name: x\nsystem: {command: [/bin/true]}\nexpect: {params_match: fault_free}\n"
    (problem,) = problems(text)
    assert "event: params" in problem


def test_command_system_with_log_probes() -> None:
    spec = parse_scenario(
        "name: x\nsystem:\n  command: [python, job.py]\n  probes:\n"
        "    - {pattern: 'step (?P<step>\\d+)', event: step}\n"
    )
    assert isinstance(spec.system, CommandSystem)
    assert spec.system.probes[0].event == "step"


def test_bad_regex_in_probe() -> None:
    text = "name: x\nsystem:\n  command: [x]\n  probes: [{pattern: '(', event: step}]\n"
    (problem,) = problems(text)
    assert "s.yaml:4:22: system.probes.0.pattern: not a valid regular expression" in problem


def test_signal_names_are_checked() -> None:
    text = GOOD.replace("kind: process.freeze", "kind: process.kill\n    signal: SIGFOO").replace(
        "    duration: 500ms\n", ""
    )
    (problem,) = problems(text)
    assert "unknown signal 'SIGFOO'" in problem
    assert "SIGKILL" in problem


def test_shipped_scenarios_are_valid() -> None:
    files = discover([ROOT / "scenarios"])
    assert len(files) >= 3
    for file in files:
        load_scenario(file)


def test_json_schema_lists_fault_kinds() -> None:
    schema = json_schema()
    text = str(schema)
    for kind in ("process.kill", "process.term", "process.freeze"):
        assert kind in text
    assert schema["title"] == "Aftershock scenario"


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        discover([tmp_path / "nope.yaml"])


def test_role_targets_and_recovery_strategies() -> None:
    spec = parse_scenario(
        "name: x\nsystem: {reference: trainer, recovery: hot_spare, spares: 2}\n"
        "faults: [{kind: process.kill, target: {role: spare}, at: {step: 3}}]\n"
    )
    assert isinstance(spec.system, TrainerSystem)
    assert spec.system.spares == 2
    assert spec.faults[0].target.describe() == "role spare"
    (problem,) = problems("name: x\nsystem: {reference: trainer, recovery: magic}\n")
    assert "'restart', 'hot_spare' or 'elastic'" in problem


def test_bitflip_by_parameter_name_from_outside() -> None:
    spec = parse_scenario(
        "name: x\nsystem: {reference: trainer, recovery: hot_spare}\n"
        "faults: [{kind: memory.bitflip, target: {rank: 1}, at: {step: 4}, "
        "address_of: 'param:blocks.0.w_in', index: 3, bit: 12}]\n"
    )
    assert spec.faults[0].kind == "memory.bitflip"
    (problem,) = problems(
        "name: x\nsystem: {reference: trainer}\nfaults: [{kind: memory.bitflip, "
        "target: {rank: 1}, at: {step: 4}, address_of: 'param:w', region: heap}]\n"
    )
    assert "give exactly one of `tensor`, `address`, `address_of` or `region: heap`" in problem


def test_file_triggers_are_checked() -> None:
    def at(value: str, system: str = "{reference: trainer}") -> list[str]:
        return problems(f"name: x\nsystem: {system}\nfaults:\n  - kind: process.kill\n"
                        f"    target: {{rank: 0}}\n    at: {value}\n")

    spec = parse_scenario("name: x\nsystem: {reference: trainer}\nfaults:\n"
                          "  - {kind: process.kill, target: {rank: 0},\n"
                          "     at: {file: 'step_*/COMMIT', count: 2}}\n")
    assert (spec.faults[0].at.file, spec.faults[0].at.when) == ("step_*/COMMIT", "created")
    assert spec.faults[0].at.describe() == "file step_*/COMMIT created #2"
    (problem,) = at("{file: '../escape'}")
    assert "s.yaml:6:" in problem
    assert "relative path under the fault's root" in problem
    assert "'../escape'" in problem
    (problem,) = at("{file: /abs/COMMIT}")
    assert "relative path" in problem
    (problem,) = at("{file: x, when: written}")
    assert "'created', 'opened', 'modified', 'closed' or 'deleted'" in problem
    (problem,) = at("{step: 3, when: closed}")
    assert "`when` needs `file`" in problem
    (problem,) = at("{file: x, step: 3}")
    assert "`file: GLOB`" in problem


def test_triggers_inside_a_save_and_faults_landed() -> None:
    """`opened` and `modified` hit a save over an existing file; `faults_landed` needs a
    trigger whose moment can lie inside a write."""
    def scenario(when: str, landed: str = "in_window") -> str:
        return ("name: x\nsystem: {reference: trainer}\nfaults:\n  - kind: process.kill\n"
                f"    target: {{rank: 0}}\n    at: {{file: snapshot.pt, when: {when}}}\n"
                f"expect: {{faults_landed: {landed}}}\n")

    for when in ("opened", "modified", "created"):
        spec = parse_scenario(scenario(when))
        assert spec.faults[0].at.describe() == f"file snapshot.pt {when}"
        assert spec.expect.faults_landed == "in_window"
    for when in ("closed", "deleted"):
        (problem,) = problems(scenario(when))
        assert "expect.faults_landed needs a fault triggered inside a write" in problem
        assert "`closed` and `deleted` come after the write" in problem
    (problem,) = problems(scenario("opened", "always"))
    assert "expect.faults_landed: Input should be 'in_window'" in problem
    (problem,) = problems("name: x\nsystem: {reference: trainer}\n"
                          "expect: {faults_landed: in_window}\n")
    assert "`at: {file: GLOB, when: opened}`" in problem


def test_lose_unsynced_defaults_and_limits() -> None:
    spec = parse_scenario("name: x\nsystem: {reference: trainer}\nfaults:\n"
                          "  - {kind: storage.lose_unsynced, at: {step: 5}}\n")
    fault = spec.faults[0]
    assert fault.target.pick == "all"  # a power loss takes every rank
    assert fault.dir == "."  # type: ignore[union-attr]
    twice = ("name: x\nsystem: {reference: trainer}\nfaults:\n"
             "  - {kind: storage.lose_unsynced, at: {step: 5}}\n"
             "  - {kind: storage.lose_unsynced, at: {step: 9}}\n")
    (problem,) = problems(twice)
    assert "at most one storage.lose_unsynced" in problem
    # A plain command's files are in its working folder (${run_dir}/work): the whole of it
    # may lose power. One that works in the run folder itself must name its folder.
    assert parse_scenario("name: x\nsystem: {command: [/bin/true]}\nfaults:\n"
                          "  - {kind: storage.lose_unsynced, at: {step: 5}}\n")
    command = ("name: x\nsystem: {command: [/bin/true], cwd: '${run_dir}'}\nfaults:\n"
               "  - {kind: storage.lose_unsynced, at: {step: 5}}\n")
    (problem,) = problems(command)
    assert "needs `dir` (or `root`)" in problem
    assert parse_scenario(command.replace("at: {step: 5}", "dir: ckpt, at: {step: 5}"))
    (problem,) = problems(command.replace("at: {step: 5}", "dir: ../x, at: {step: 5}"))
    assert "dir must be a relative path" in problem


def _kill(system: str, target: str, at: str = "{step: 3}") -> list[str]:
    try:
        parse_scenario(f"name: x\nsystem: {system}\nfaults:\n  - kind: process.kill\n"
                       f"    target: {target}\n    at: {at}\n")
    except SpecError as exc:
        return exc.problems
    return []


TRAINER_2X2 = "{reference: trainer, world: {replicas: 2, shards: 2}}"


def test_validate_refuses_a_target_the_reference_systems_never_have() -> None:
    """`target: {rank: 5}` on a 4-rank trainer validated, then failed when due as "never
    injected: ... or the target never appeared"."""
    (problem,) = _kill(TRAINER_2X2, "{rank: 5}")
    assert problem.startswith("<string>:4:5: faults.0: target rank 5 can never be found: "
                              "the trainer's world (2 replicas × 2 shards) has ranks 0-3"), \
        problem
    assert "replicas 0-1" in _kill(TRAINER_2X2, "{replica: 2}")[0]
    assert "shards 0-1" in _kill(TRAINER_2X2, "{replica: 1, shard: 2}")[0]
    assert "ranks 0-3" in _kill(TRAINER_2X2, "{worker: 4}")[0]
    (spare,) = _kill("{reference: trainer, recovery: restart}", "{role: spare}")
    assert "target role spare can never be found: only `recovery: hot_spare` with " \
        "`spares` of 1 or more has warm spares" in spare, spare
    assert "spares" in _kill("{reference: trainer, recovery: hot_spare, spares: 0}",
                             "{role: spare}")[0]
    (router,) = _kill(TRAINER_2X2, "{role: router}")
    assert "the trainer has no router" in router, router
    (worker,) = _kill("{reference: server, workers: 3}", "{worker: 3}")
    assert "the server's 3 workers are workers 0-2" in worker, worker
    assert "spare" in _kill("{reference: server}", "{role: spare}")[0]
    # What they have validates, as before.
    for system, target in ((TRAINER_2X2, "{rank: 3}"), (TRAINER_2X2, "{replica: 1, shard: 1}"),
                           (TRAINER_2X2, "{role: launcher}"), (TRAINER_2X2, "{role: worker}"),
                           ("{reference: trainer, recovery: hot_spare}", "{role: spare}"),
                           ("{reference: server, workers: 3}", "{worker: 2}"),
                           ("{reference: server}", "{role: router}")):
        assert _kill(system, target) == [], (system, target)


def test_validate_refuses_an_awaited_hello_the_reference_systems_never_say() -> None:
    """`after: {event: hello, role: spare}` without spares validated, and the fault then
    waited for the whole run."""
    (problem,) = _kill(TRAINER_2X2, "{rank: 0}",
                       "{step: 3, after: {event: hello, role: spare}}")
    assert "faults.0.at.after: the trainer never says hello as role spare" in problem, problem
    assert "(its roles here: none)" in problem, problem
    (rank,) = _kill(TRAINER_2X2, "{rank: 0}", "{step: 3, after: {event: hello, rank: 4}}")
    assert "the trainer never says hello as rank 4 (its ranks: 0-3)" in rank, rank
    (server,) = _kill("{reference: server}", "{worker: 0}",
                      "{time: 1s, after: {event: hello, role: spare}}")
    assert "the server never says hello as role spare (its roles here: router, worker)" \
        in server, server
    for system, at in (
            ("{reference: trainer, recovery: hot_spare}",
             "{step: 3, after: {event: hello, role: spare}}"),
            ("{reference: trainer, recovery: elastic}",
             "{step: 3, after: {event: hello, role: trainer}}"),
            (TRAINER_2X2, "{step: 3, after: {event: hello, rank: 3}}"),
            ("{reference: server}", "{time: 1s, after: {event: hello, role: router}}"),
            # Other events: what carries a role there is not the system's alone to say.
            (TRAINER_2X2, "{step: 3, after: {event: checkpoint_saved, role: spare}}")):
        assert _kill(system, "{rank: 0}" if "trainer" in system else "{worker: 0}", at) \
            == [], (system, at)


def test_validate_refuses_what_the_trainer_on_nodes_never_has() -> None:
    """The same rules for the reference trainer on nodes (`nodes: N`), whose world is
    nodes × per_node ranks; a program's ranks are its world's."""
    nodes = "{nodes: 2, per_node: 1, trainer: {recovery: restart}}"
    (rank,) = _kill(nodes, "{rank: 2}")
    assert "has ranks 0-1; give one of them, or correct `nodes` or `per_node`" in rank, rank
    assert "warm spares" in _kill(nodes, "{role: spare}")[0]
    (hello,) = _kill(nodes, "{rank: 0}", "{step: 3, after: {event: hello, role: spare}}")
    assert "never says hello as role spare" in hello, hello
    spare = "{nodes: 2, per_node: 1, restart: 'no', trainer: {recovery: hot_spare, spares: 1}}"
    assert _kill(spare, "{role: spare}", "{step: 3, after: {event: hello, role: spare}}") == []
    program = "{nodes: 2, per_node: 2, program: [python, train.py]}"
    assert "the nodes' world (4 ranks) has ranks 0-3" in _kill(program, "{rank: 4}")[0]
    assert _kill(program, "{rank: 3}") == []
