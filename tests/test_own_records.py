"""No fault touches the harness's own records, and a file fault on a command job lands where
the job works: `validate` refuses a fault aimed at the timeline, the logs, the result, the
heal journal's state folder or the cache; a command's file faults resolve in its working
folder (issue 47, class 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aftershock.harness import systems
from aftershock.harness.errors import SpecError
from aftershock.harness.run.runner import _storage_root
from aftershock.harness.scenario.load import parse_scenario

pytestmark = pytest.mark.timeout(60)

COMMAND = f"system:\n  command: [{sys.executable}, -c, 'pass']\n"


def _problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_scenario(text, "s.yaml")
    return info.value.problems


def _scenario(fault: str, system: str = COMMAND) -> str:
    return f"name: x\n{system}faults:\n  - {fault}\n"


@pytest.mark.parametrize(
    ("fault", "what"),
    [
        ("{kind: storage.corrupt, root: '${run_dir}', path: events.jsonl, at: {time: 1s}}",
         "events.jsonl"),
        ("{kind: storage.truncate, root: '${run_dir}', path: '*.jsonl', at: {time: 1s}}",
         "events.jsonl"),
        ("{kind: storage.delete, root: '${run_dir}', path: 'logs/*.log', at: {time: 1s}}",
         "logs"),
        ("{kind: storage.delete, root: '${run_dir}/logs', path: '*', at: {time: 1s}}",
         "logs"),
        ("{kind: storage.corrupt, root: '${run_dir}', path: '**/*', at: {time: 1s}}",
         "events.jsonl"),
        ("{kind: storage.delete, root: '${run_dir}', path: '*', at: {time: 1s}}",
         "events.jsonl"),
        ("{kind: storage.corrupt, root: '${run_dir}', path: result.json, at: {time: 1s}}",
         "result.json"),
        ("{kind: storage.full, root: '${run_dir}', at: {time: 1s}}", "events.jsonl"),
    ],
)
def test_validate_refuses_a_file_fault_aimed_at_the_run_records(fault: str, what: str) -> None:
    (problem,) = _problems(_scenario(fault))
    assert problem.startswith("s.yaml:5:")  # the fault's own line
    assert "faults.0" in problem
    assert what in problem
    assert "the harness's own records" in problem
    assert "the job's working folder" in problem  # how to fix it


def test_validate_refuses_the_state_folder_and_the_cache(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    state, cache = tmp_path / "state", tmp_path / "cache"
    monkeypatch.setenv("AFTERSHOCK_STATE_DIR", str(state))
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    (problem,) = _problems(_scenario(
        f"{{kind: storage.corrupt, root: {state}, path: 'journal/*.jsonl', at: {{time: 1s}}}}"))
    assert "heal journal" in problem
    (problem,) = _problems(_scenario(
        f"{{kind: storage.delete, root: {cache}/fault_free, path: '*', at: {{time: 1s}}}}"))
    assert "cache" in problem
    (problem,) = _problems(_scenario(
        f"{{kind: storage.full, root: {tmp_path}, dir: state, at: {{time: 1s}}}}"))
    assert "heal journal" in problem


def test_a_command_whose_cwd_is_the_run_folder_cannot_aim_at_its_timeline() -> None:
    system = COMMAND + "  cwd: ${run_dir}\n"
    (problem,) = _problems(_scenario(
        "{kind: storage.corrupt, path: events.jsonl, at: {time: 1s}}", system))
    assert "events.jsonl" in problem


def test_a_file_of_the_job_with_a_record_s_name_is_its_own() -> None:
    """A command's file faults resolve in its working folder: there `events.jsonl` is the
    job's own file, not the run's timeline."""
    spec = parse_scenario(_scenario(
        "{kind: storage.corrupt, path: events.jsonl, at: {time: 1s}}"))
    assert spec.faults[0].kind == "storage.corrupt"
    parse_scenario(_scenario(
        "{kind: storage.corrupt, root: '${run_dir}', path: 'work/*.jsonl', at: {time: 1s}}"))
    parse_scenario(_scenario(
        "{kind: storage.corrupt, root: '${run_dir}', path: 'checkpoints/*', at: {time: 1s}}"))


def test_a_command_s_file_faults_resolve_where_it_works(tmp_path: Path) -> None:
    run, scenario_dir = tmp_path / "run", tmp_path / "scenarios"
    plain = parse_scenario(_scenario("{kind: storage.corrupt, path: x, at: {time: 1s}}"))
    assert _storage_root(plain, run, None, scenario_dir) == str(run.resolve() / "work")
    assert not systems.of(plain.system).root_is_run_folder(plain.system)
    inside = parse_scenario(_scenario("{kind: storage.corrupt, path: x, at: {time: 1s}}",
                                      COMMAND + "  cwd: ${run_dir}/job\n"))
    assert _storage_root(inside, run, None, scenario_dir) == str(run.resolve() / "job")
    beside = parse_scenario(_scenario("{kind: storage.corrupt, path: x, at: {time: 1s}}",
                                      COMMAND + "  cwd: data\n"))
    assert _storage_root(beside, run, None, scenario_dir) == str(scenario_dir.resolve() / "data")
    given = parse_scenario(_scenario(
        "{kind: storage.corrupt, root: '${run_dir}/ckpt', path: x, at: {time: 1s}}"))
    assert _storage_root(given, run, "${run_dir}/ckpt", scenario_dir) == f"{run}/ckpt"
    at_run = parse_scenario(_scenario("{kind: storage.corrupt, path: x, at: {time: 1s}}",
                                      COMMAND + "  cwd: ${run_dir}\n"))
    assert systems.of(at_run.system).root_is_run_folder(at_run.system)


WRITES_AND_READS = """\
import pathlib, time
data = pathlib.Path("data.bin")  # where the job stands: its working folder
data.write_bytes(bytes(range(256)) * 4)
pathlib.Path("events.jsonl").write_text("the job's own file of that name\\n")
for step in range(1, 40):
    print(f"rank 0 step {step} gen 0 t={time.monotonic()}", flush=True)
    time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_command_s_file_faults_hit_its_files_and_a_miss_fails_faults_injected(
        tmp_path: Path) -> None:
    """The job writes in `${run_dir}/work`: `path: data.bin` hits that file, `path:
    events.jsonl` the job's file of that name (never the run's timeline), and a glob that
    matches nothing fails `faults_injected` with what it looked for."""
    import json

    from _helpers import cli

    job = tmp_path / "job.py"
    job.write_text(WRITES_AND_READS)
    scenario = tmp_path / "files.yaml"
    scenario.write_text(f"""\
name: command-files
system:
  command: [{sys.executable}, {job}]
  probes:
    - {{event: step, pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) gen (?P<generation>\\d+)'}}
faults:
  - {{kind: storage.corrupt, path: data.bin, at: {{step: 5}}}}
  - {{kind: storage.corrupt, path: events.jsonl, at: {{step: 5}}}}
  - {{kind: storage.truncate, path: 'ckpt/*.pt', at: {{step: 5}}}}
expect:
  completes: true
""")
    run_dir = tmp_path / "run"
    done = cli("run", str(scenario), "--run-dir", str(run_dir), "--plain",
               cache=tmp_path / "cache")
    assert done.returncode == 1, done.stdout + done.stderr  # a check failed, no harness error
    run_dir = run_dir / "command-files"
    record = json.loads((run_dir / "result.json").read_text())
    work = run_dir.resolve() / "work"
    hit, own, missed = record["faults"]
    assert f"corrupted 16 bytes of {work / 'data.bin'}" in hit["detail"]
    assert (work / "data.bin").read_bytes() != bytes(range(256)) * 4
    assert str(work / "events.jsonl") in own["detail"]
    assert missed["injected_at_s"] is None
    (check,) = [c for c in record["checks"] if c["name"] == "faults_injected"]
    assert not check["passed"]
    assert check["observed"] == "2/3"
    assert f"no file matches 'ckpt/*.pt' under {work}" in check["message"]
    # The run's own timeline was never touched: every line is an event.
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        assert "event" in json.loads(line)
