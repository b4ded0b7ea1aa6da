"""A command's fault-free twin is keyed on the content of what the command runs.

The twin of a `command:` scenario is cached; if its key ignored the script the command runs,
editing that script would silently reuse a twin of the old code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, cli

JOB = ROOT / "tests" / "fixtures" / "resume_job.py"

SCENARIO = f"""\
name: resume-job
system:
  command: [{sys.executable}, job.py]
  env: {{JOB_CKPT: "${{run_dir}}/ckpt.json", JOB_STEPS: "30"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
    - {{pattern: 'rank (?P<rank>\\d+) params digest=(?P<digest>[0-9a-f]+)', event: params}}
  timeout: 1m
faults:
  - kind: process.kill
    target: {{rank: 0}}
    at: {{step: 10}}
expect:
  completes: true
  params_match: fault_free
"""

# An edit with a bug on the path of a run that is never interrupted: its result now depends
# on whether it was killed, which is what params_match is for. The faulted run resumed, so it
# ends as the old code did; only a twin of the *new* code shows the difference.
BUG = """\
if start == 0:  # (the edit's bug: a run that was never interrupted ends differently)
    state = hashlib.sha256(state.encode()).hexdigest()
print(f"rank 0 params"""


def run(folder: Path, cache: Path, name: str) -> dict:
    out = folder / f"{name}.json"
    proc = cli("run", str(folder / "job.yaml"), "--json", str(out), "--run-dir",
               str(folder / name), cache=cache, timeout=100)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    return {c["name"]: c for c in record["checks"]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_editing_the_script_reruns_the_fault_free_twin(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(SCENARIO)
    (tmp_path / "job.py").write_text(JOB.read_text())
    cache = tmp_path / "cache"
    first = run(tmp_path, cache, "v1")
    assert first["params_match"]["passed"], first["params_match"]
    assert first["faults_injected"]["passed"]

    edited = JOB.read_text().replace('print(f"rank 0 params', BUG)
    assert edited != JOB.read_text()
    (tmp_path / "job.py").write_text(edited)
    second = run(tmp_path, cache, "v2")
    assert second["faults_injected"]["passed"]
    assert not second["params_match"]["passed"], second["params_match"]


def command(inputs: str = "", command: str = "[python, train.py]") -> str:
    return (f"name: c\nsystem:\n  command: {command}\n"
            f"  probes: [{{pattern: 'p=(?P<digest>.+)', event: params}}]\n{inputs}"
            "expect: {params_match: fault_free}\n")


def key_of(folder: Path, text: str) -> str:
    from aftershock.harness.run.runner import baseline_key
    from aftershock.harness.scenario.load import load_scenario

    path = folder / "s.yaml"
    path.write_text(text)
    return baseline_key(load_scenario(path).spec, 0, scenario_dir=folder)


def test_the_key_follows_the_content_of_the_script_and_of_declared_inputs(
    tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("print('v1')\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.json").write_text("{}")
    (tmp_path / "data.bin").write_bytes(b"\0" * 10)
    text = command("  inputs: [conf, '*.bin']\n")
    first = key_of(tmp_path, text)
    assert key_of(tmp_path, text) == first  # same content, same twin
    (tmp_path / "train.py").write_text("print('v2')\n")
    second = key_of(tmp_path, text)
    assert second != first
    (tmp_path / "conf" / "a.json").write_text('{"lr": 2}')  # a file in a declared folder
    third = key_of(tmp_path, text)
    assert third != second
    (tmp_path / "data.bin").write_bytes(b"\1" * 10)  # a file a declared glob matches
    assert key_of(tmp_path, text) != third


def test_files_named_as_option_values_count_and_the_run_folder_does_not(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text("a: 1\n")
    text = command(command="[python, -m, job, '--config=cfg.yaml', '--out=${run_dir}/x']")
    first = key_of(tmp_path, text)
    (tmp_path / "cfg.yaml").write_text("a: 2\n")
    assert key_of(tmp_path, text) != first


def test_a_missing_declared_input_is_an_invalid_scenario(tmp_path: Path) -> None:
    from aftershock.harness.errors import SpecError
    from aftershock.harness.scenario.load import load_scenario

    (tmp_path / "train.py").write_text("")
    path = tmp_path / "s.yaml"
    path.write_text(command("  inputs: [train.py, configs/*.yaml, model]\n"))
    with pytest.raises(SpecError) as caught:
        load_scenario(path)
    assert [p.split(": ", 1)[0] for p in caught.value.problems] == [
        f"{path}:5:22", f"{path}:5:38"]
    assert "system.inputs.1: nothing matches 'configs/*.yaml'" in caught.value.problems[0]
    proc = cli("validate", str(path))
    assert proc.returncode == 2
    assert f"{path}:5:22: system.inputs.1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hydra_style_key_path_arguments_are_made_absolute_and_keyed(tmp_path: Path) -> None:
    # `train.py data.path=cfg.yaml` (hydra, OmegaConf, fire) names a file as a key's value:
    # run in a fresh folder, a relative one would not be found; edited, the twin is stale.
    from aftershock.harness.scenario.load import load_scenario
    from aftershock.harness.systems.command import absolute_args

    (tmp_path / "cfg.yaml").write_text("a: 1\n")
    (tmp_path / "train.py").write_text("")
    text = command(command="[python, train.py, 'data.path=cfg.yaml', '+extra=none.yaml', "
                           "'lr=0.1', 'out=${run_dir}/x']")
    path = tmp_path / "s.yaml"
    path.write_text(text)
    system = load_scenario(path).spec.system
    assert absolute_args(system, tmp_path) == [
        "python", str(tmp_path.resolve() / "train.py"),
        f"data.path={tmp_path.resolve() / 'cfg.yaml'}", "+extra=none.yaml", "lr=0.1",
        "out=${run_dir}/x"]
    first = key_of(tmp_path, text)
    (tmp_path / "cfg.yaml").write_text("a: 2\n")
    assert key_of(tmp_path, text) != first
