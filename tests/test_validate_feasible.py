"""`validate` refuses scenarios that can never work, naming the cause: an in-process fault on
a job without the in-process probe, a step probe that reads no step number, a fault that
needs what the system's target cannot do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _helpers import RANKS_JOB, ROOT, cli

from aftershock.harness import systems
from aftershock.harness.errors import SpecError
from aftershock.harness.scenario.load import load_scenario, parse_scenario

PROBE_JOB = ROOT / "tests" / "fixtures" / "probe_job.py"

HANG = """\
name: hang
system:
  command: [{python}, {job}]
{extra}faults:
  - kind: collective.hang
    target: {{rank: 1}}
    at: {{step: 3}}
"""


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_scenario(path)
    return caught.value.problems


def scenario(job: Path, extra: str = "") -> str:
    return HANG.format(python=sys.executable, job=job, extra=extra)


def test_an_in_process_fault_on_a_job_without_the_probe_is_refused(tmp_path: Path) -> None:
    (problem,) = problems(tmp_path, scenario(RANKS_JOB))
    assert problem.startswith(f"{tmp_path / 's.yaml'}:5:5: faults.0: collective.hang")
    assert "aftershock.harness.probe.install()" in problem
    assert str(RANKS_JOB) in problem  # what was read
    assert "in_process_probe: true" in problem  # and how to say it is called elsewhere


def test_a_job_that_calls_the_probe_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(scenario(PROBE_JOB))
    assert load_scenario(path).spec.faults[0].kind == "collective.hang"
    # From the command line itself (python -c), too.
    inline = f'name: x\nsystem:\n  command: [{sys.executable}, -c, "from aftershock import ' \
        'probe; probe.install()"]\nfaults:\n  - {kind: process.hang, target: {rank: 0}, ' \
        'at: {step: 1}}\n'
    assert parse_scenario(inline).faults[0].kind == "process.hang"


def test_the_scenario_can_say_what_the_files_do_not_show(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(scenario(RANKS_JOB, "  in_process_probe: true\n"))
    assert load_scenario(path)
    (problem,) = problems(tmp_path, scenario(PROBE_JOB, "  in_process_probe: false\n"))
    assert "collective.hang" in problem
    assert "in_process_probe: false" in problem


def test_a_fault_that_acts_inside_only_with_some_parameters_is_judged_by_them(
    tmp_path: Path,
) -> None:
    base = f"name: x\nsystem:\n  command: [{sys.executable}, {RANKS_JOB}]\nfaults:\n"
    outside = base + "  - {kind: process.kill, target: {rank: 0}, at: {step: 3}}\n"
    path = tmp_path / "ok.yaml"
    path.write_text(outside)
    assert load_scenario(path)
    (problem,) = problems(tmp_path, base + "  - {kind: process.kill, target: {rank: 0}, "
                          "at: {step: 3, phase: save}}\n")
    assert "process.kill with `at.phase`" in problem
    (problem,) = problems(tmp_path, base + "  - {kind: memory.nan, target: {rank: 0}, "
                          "at: {step: 3}, tensor: 'param:w'}\n")
    assert "memory.nan with `tensor`" in problem


def test_validate_exits_2_and_names_the_cause(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(scenario(RANKS_JOB))
    proc = cli("validate", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "collective.hang" in proc.stderr
    assert "aftershock.harness.probe.install()" in proc.stderr


def test_a_step_probe_without_a_step_group_is_refused() -> None:
    text = ("name: x\nsystem:\n  command: [x]\n  probes:\n"
            "    - {pattern: 'step \\d+ done', event: step}\n")
    with pytest.raises(SpecError) as caught:
        parse_scenario(text, "s.yaml")
    (problem,) = caught.value.problems
    assert problem.startswith("s.yaml:5:7: system.probes.0: ")
    assert "(?P<step>...)" in problem


def test_a_fault_needing_what_the_target_cannot_do_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A target without the harness's network namespace (as a container's is): net faults
    # cannot reach its sockets, and say so before anything runs.
    trainer = systems.get("trainer")
    monkeypatch.setattr(trainer, "capabilities", lambda system: frozenset({"signals", "files"}))
    text = ("name: x\nsystem: {reference: trainer}\nfaults:\n"
            "  - {kind: net.partition, target: {rank: 1}, at: {step: 3}}\n"
            "  - {kind: process.freeze, target: {rank: 1}, at: {step: 4}}\n")
    with pytest.raises(SpecError) as caught:
        parse_scenario(text, "s.yaml")
    (problem,) = caught.value.problems
    assert problem.startswith("s.yaml:4:5: faults.0: net.partition needs the target's sockets")
    assert "`reference: trainer`" in problem
