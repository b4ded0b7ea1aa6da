"""What a new user of `command:` met, each as a test (docs/own-job.md).

Each runs a real (tiny, torch-free) job through the harness and reads what the job saw of
its own launch: where it ran, its temporary folder, the interpreter it got, its arguments.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import cli

from aftershock.harness.errors import SpecError
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.run.target import interpreter_bin
from aftershock.harness.scenario.load import load_scenario

#: Records what the job saw of its launch in $JOB_OUT, and whether a snapshot from an
#: earlier run was where it stands.
JOB = """\
import json, os, sys, tempfile
scratch = tempfile.mkdtemp(prefix="torchelastic_")
found = os.path.exists("snapshot.pt")
open("snapshot.pt", "w").write("epoch 175")
json.dump({"cwd": os.getcwd(), "argv": sys.argv, "executable": sys.executable,
           "scratch": scratch, "found_snapshot": found}, open(os.environ["JOB_OUT"], "w"))
"""


def scenario(folder: Path, *, command: str, extra: str = "") -> Path:
    (folder / "job.py").write_text(JOB)
    path = folder / "job.yaml"
    path.write_text(f"name: own\nsystem:\n  command: {command}\n"
                    f"  env: {{JOB_OUT: '${{run_dir}}/seen.json'}}\n{extra}"
                    "expect: {completes: true}\n")
    return path


def seen(path: Path, run_dir: Path, seed: int | None = None) -> dict[str, Any]:
    result = run_scenario(load_scenario(path), run_dir=run_dir, seed=seed)
    assert result.passed, result
    data: dict[str, Any] = json.loads((run_dir / "seen.json").read_text())
    return data


def test_a_command_runs_in_a_fresh_folder_of_its_run(tmp_path: Path) -> None:
    """A snapshot a fault-free run wrote where it stood resumed the next run at epoch 175."""
    path = scenario(tmp_path, command=f"[{sys.executable}, job.py]")
    first = seen(path, tmp_path / "run1")
    assert Path(first["cwd"]) == (tmp_path / "run1" / "work").resolve()
    assert not first["found_snapshot"]
    second = seen(path, tmp_path / "run2")
    assert not second["found_snapshot"], "a file of the first run reached the second"
    # The same run folder again: its work folder starts empty too.
    again = seen(path, tmp_path / "run1")
    assert not again["found_snapshot"]
    assert not (tmp_path / "snapshot.pt").exists()


def test_cwd_may_name_the_run_folder(tmp_path: Path) -> None:
    path = scenario(tmp_path, command=f"[{sys.executable}, '${{scenario_dir}}/job.py']",
                    extra="  cwd: ${run_dir}/here\n")
    (tmp_path / "run" / "here").mkdir(parents=True)
    assert Path(seen(path, tmp_path / "run")["cwd"]) == (tmp_path / "run" / "here").resolve()


def test_seed_reaches_the_command(tmp_path: Path) -> None:
    path = scenario(tmp_path, command=f"[{sys.executable}, job.py, '--seed=${{seed}}']")
    assert seen(path, tmp_path / "run", seed=1234)["argv"][1:] == ["--seed=1234"]


def test_a_command_is_found_as_in_an_activated_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`command: [torchrun, ...]` failed unless the venv was activated: the bare name must be
    the one beside the harness's own interpreter, whatever PATH says."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    name = Path(sys.executable).name
    path = scenario(tmp_path, command=f"[{name}, job.py]")
    assert os.path.dirname(seen(path, tmp_path / "run")["executable"]) == interpreter_bin()


def test_a_missing_program_says_where_it_was_looked_for(tmp_path: Path) -> None:
    from aftershock.harness.errors import RunFailed
    path = scenario(tmp_path, command="[no-such-program-xyz, job.py]")
    with pytest.raises(RunFailed, match=r"not found in .*this interpreter's bin folder"):
        run_scenario(load_scenario(path), run_dir=tmp_path / "run")


def test_temporary_files_stay_in_the_run_folder(tmp_path: Path) -> None:
    path = scenario(tmp_path, command=f"[{sys.executable}, job.py]")
    scratch = Path(seen(path, tmp_path / "run")["scratch"])
    assert scratch.is_relative_to((tmp_path / "run").resolve()), scratch


STEPS = """\
import sys, time
for step in range(int(sys.argv[1]), int(sys.argv[1]) + 40):
    print(f"step {step}", flush=True)
    time.sleep(0.02)
"""


@pytest.mark.parametrize(("start", "late"), [(175, True), (0, False)])
def test_a_step_trigger_fired_far_past_its_step_is_a_warning(
        tmp_path: Path, start: int, late: bool) -> None:
    """A run that resumed at step 175 fired a `step: 60` trigger there without a word."""
    (tmp_path / "steps.py").write_text(STEPS)
    path = tmp_path / "late.yaml"
    path.write_text(f"""\
name: late
system:
  command: [{sys.executable}, steps.py, "{start}"]
  probes: [{{pattern: 'step (?P<step>\\d+)', event: step}}]
faults:
  - {{kind: process.freeze, target: {{rank: 0}}, at: {{step: {start + 20 if not late else 60}}},
     duration: 0.1s}}
expect: {{completes: true}}
""")
    run_scenario(load_scenario(path), run_dir=tmp_path / "run")
    events = [json.loads(line) for line in
              (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    warned = [e for e in events if e["event"] == "trigger_late"]
    assert bool(warned) == late, warned
    if late:
        assert warned[0]["resumed"]
        assert warned[0]["at_step"] == 60
        assert warned[0]["step"] >= 175
        assert warned[0]["first_step"] >= 175


# ---------------------------------------------------------------- targeting by coordinate

GROUPS_JOB = Path(__file__).parent / "fixtures" / "groups_job.py"
GROUP_LINE = re.compile(r"group (\d+) rank 0 pid (\d+) agent (\d+)")


def groups_scenario(folder: Path, target: str, *, hello: bool = False) -> Path:
    """Two replica groups, both RANK=0 (tests/fixtures/groups_job.py); a 0.3 s freeze of
    ``target`` once step 5 is seen."""
    announce = ("    - {pattern: 'group (?P<rank>(?P<replica>\\d+)) rank 0 pid (?P<pid>\\d+)',"
                " event: hello}\n") if hello else ""
    path = folder / "groups.yaml"
    path.write_text(f"""\
name: groups
system:
  command: [{sys.executable}, {GROUPS_JOB}, "30"]
  probes:
    - {{pattern: 'group (?P<generation>\\d+) rank 0 pid .* step (?P<step>\\d+)', event: step}}
{announce}faults:
  - {{kind: process.freeze, target: {target}, at: {{step: 5}}, duration: 0.3s}}
expect: {{completes: true}}
""")
    return path


def group_pids(run_dir: Path, agent: bool = False) -> dict[int, int]:
    """Replica group -> its worker's pid (or its agent's), as the workers printed them."""
    text = (run_dir / "logs" / "launcher.stdout.log").read_text()
    return {int(g): int(a if agent else p) for g, p, a in GROUP_LINE.findall(text)}


def injected(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] in ("fault_injected", "fault_failed")]


@pytest.mark.parametrize("target", [
    "{env: {REPLICA_GROUP_ID: '1'}, role: worker}",
    "{cmdline: 'worker 1 '}",
    "{env: {REPLICA_GROUP_ID: '1'}, cmdline: 'groups_job.py worker'}",
])
def test_a_fault_targets_a_process_by_any_coordinate(tmp_path: Path, target: str) -> None:
    """torchft's replica groups all have RANK=0: `rank: 1` cannot reach group 1."""
    run_dir = tmp_path / "run"
    result = run_scenario(load_scenario(groups_scenario(tmp_path, target)), run_dir=run_dir)
    (fault,) = injected(run_dir)
    assert fault["event"] == "fault_injected", fault
    assert fault["pid"] == group_pids(run_dir)[1]
    assert result.faults[0].target.startswith("REPLICA_GROUP_ID=1" if "env" in target
                                              else "cmdline")


def test_role_agent_is_the_process_that_started_a_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_scenario(load_scenario(groups_scenario(
        tmp_path, "{env: {REPLICA_GROUP_ID: '0'}, role: agent}")), run_dir=run_dir)
    (fault,) = injected(run_dir)
    assert fault["event"] == "fault_injected", fault
    assert fault["pid"] == group_pids(run_dir, agent=True)[0]


def test_a_rank_two_processes_claim_is_refused_not_guessed(tmp_path: Path) -> None:
    """`rank: 0` hit whichever group had the lower pid."""
    run_dir = tmp_path / "run"
    result = run_scenario(load_scenario(groups_scenario(tmp_path, "{rank: 0}")),
                          run_dir=run_dir)
    (fault,) = injected(run_dir)
    assert fault["event"] == "fault_failed"
    assert "2 processes say RANK=0" in fault["error"]
    assert not result.passed


def test_a_rank_announced_in_a_log_line_is_the_rank(tmp_path: Path) -> None:
    """A pid announced in a log line (`event: hello`) makes `replica: 1` reach group 1."""
    run_dir = tmp_path / "run"
    run_scenario(load_scenario(groups_scenario(tmp_path, "{replica: 1}", hello=True)),
                 run_dir=run_dir)
    (fault,) = injected(run_dir)
    assert fault["event"] == "fault_injected", fault
    assert fault["pid"] == group_pids(run_dir)[1]


def test_validate_refuses_a_coordinate_the_job_never_reports(tmp_path: Path) -> None:
    """`target: {replica: 1}` validated on a command but could never fire."""
    with pytest.raises(SpecError, match=r"groups.yaml:\d+:\d+: faults.0: target replica 1 "
                       r"can never be found: this command's processes have no replica"):
        load_scenario(groups_scenario(tmp_path, "{replica: 1}"))
    with pytest.raises(SpecError, match="can never be found"):
        load_scenario(groups_scenario(tmp_path, "{role: spare}"))
    with pytest.raises(SpecError, match="not a valid regular expression"):
        load_scenario(groups_scenario(tmp_path, "{cmdline: '('}"))
    with pytest.raises(SpecError, match="combine them with each other"):
        load_scenario(groups_scenario(tmp_path, "{env: {A: '1'}, rank: 1}"))
    load_scenario(groups_scenario(tmp_path, "{replica: 1}", hello=True))


def test_validate_refuses_a_rank_outside_the_declared_world(tmp_path: Path) -> None:
    """`rank: 5` with `world: 2` validated, then failed when due as "no rank 5"."""
    path = groups_scenario(tmp_path, "{rank: 5}")
    path.write_text(path.read_text().replace("  probes:", "  world: 2\n  probes:", 1))
    with pytest.raises(SpecError, match=r"groups.yaml:\d+:\d+: faults.0: target rank 5 can "
                       r"never be found: the system's `world: 2` has ranks 0-1"):
        load_scenario(path)
    proc = cli("validate", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rank 5 can never be found" in proc.stderr
    path.write_text(path.read_text().replace("{rank: 5}", "{rank: 1}"))
    load_scenario(path)


# ---------------------------------------------------------------- one stream per process

TWO_WRITERS = """\
import os, subprocess, sys
if len(sys.argv) > 1:  # a rank: its own file, as torchrun --redirects=3 lays them out
    rank = sys.argv[1]
    folder = os.path.join(os.environ["OUT"], "attempt_0", rank)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "stdout.log"), "w", buffering=1) as own:
        for step in range(400):
            own.write(f"epoch {step} loss 0.5\\n")
            sys.stdout.write(f"epoch {step} loss 0.5\\n")  # and the shared pipe
            sys.stdout.flush()
else:
    ranks = [subprocess.Popen([sys.executable, __file__, str(r)]) for r in (0, 1)]
    sys.exit(max(p.wait() for p in ranks))
"""


def test_each_process_has_its_own_stream(tmp_path: Path) -> None:
    """Two ranks writing one pipe merged 33 of 400 epoch lines; their own files never do."""
    (tmp_path / "two.py").write_text(TWO_WRITERS)
    path = tmp_path / "two.yaml"
    path.write_text(f"""\
name: two
system:
  command: [{sys.executable}, two.py]
  env: {{OUT: '${{run_dir}}/ranks'}}
  logs: ['${{run_dir}}/ranks/**/stdout.log']
  probes: [{{pattern: 'epoch (?P<step>\\d+) loss', event: step, stream: logs}}]
expect: {{completes: true}}
""")
    run_dir = tmp_path / "run"
    assert run_scenario(load_scenario(path), run_dir=run_dir).passed
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    steps = [e for e in map(json.loads, lines) if e["event"] == "step"]
    for rank in (0, 1):
        mine = [e for e in steps if e["rank"] == rank]
        assert sorted(e["step"] for e in mine) == list(range(400)), rank
        # The path's restart count, not a world: no launcher was seen (harness/verdict/metrics.py).
        assert {e["attempt"] for e in mine} == {0}
        assert "generation" not in mine[0]
        # Stamped as read, in the order written.
        assert [e["step"] for e in sorted(mine, key=lambda e: e["t"])] == list(range(400))


# ---------------------------------------------------------------- the Python API

def test_the_python_api_loads_runs_and_checks(tmp_path: Path) -> None:
    from aftershock.harness import api
    (tmp_path / "job.py").write_text(JOB)
    scenario = api.from_dict({
        "name": "from-python",
        "system": {"command": [sys.executable, "job.py", "${seed}"],
                   "env": {"JOB_OUT": "${run_dir}/seen.json"}},
        "expect": {"completes": True},
    }, folder=tmp_path)
    result = api.check(api.run(scenario, run_dir=tmp_path / "run", seed=5))
    assert isinstance(result, api.RunResult)
    assert json.loads((tmp_path / "run" / "seen.json").read_text())["argv"][1:] == ["5"]
    failing = api.loads("name: f\nsystem: {command: [/bin/false]}\nexpect: {completes: true}\n")
    with pytest.raises(AssertionError, match="completes"):
        api.check(api.run(failing, run_dir=tmp_path / "run2"))
    with pytest.raises(SpecError, match=r"scenario.yaml:2:\d+: system.command"):
        api.loads("name: f\nsystem: {command: []}\n")


def test_the_pytest_fixture_runs_into_the_tests_folder(aftershock: Any, tmp_path: Path) -> None:
    path = scenario(tmp_path, command=f"[{sys.executable}, job.py]")
    result = aftershock.run(path, check=True)
    assert Path(result.run_dir).is_relative_to(aftershock.root)
    bad = aftershock.loads("name: f\nsystem: {command: [/bin/false]}\nexpect: {completes: true}\n")
    with pytest.raises(AssertionError, match="completes"):
        aftershock.run(bad, check=True)


# ---------------------------------------------------------------- restarts, pids, exit

RESTARTING = """\
import os, subprocess, sys, time
if len(sys.argv) > 1:  # a worker: one step line per 50 ms; the first generation fails
    for step in range(8):
        print(f"step {step}", flush=True)
        time.sleep(0.05)
    sys.exit(1 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
for restart in range(2):  # a launcher that restarts its failed worker, as torchrun does
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0",
           "TORCHELASTIC_RESTART_COUNT": str(restart)}
    if subprocess.call([sys.executable, __file__, "worker"], env=env) == 0:
        break
"""


def test_restarts_pids_and_exit_are_seen_from_the_launcher(tmp_path: Path) -> None:
    """torchrun restarted twice, yet `generations` stayed 0 and the live view had no pid
    and said "running" after the exit."""
    from io import StringIO

    from rich.console import Console

    from aftershock.harness.reporting.report import LiveObserver

    (tmp_path / "restarting.py").write_text(RESTARTING)
    path = tmp_path / "restart.yaml"
    path.write_text(f"""\
name: restart
system:
  command: [{sys.executable}, restarting.py]
  steps: 8
  probes: [{{pattern: 'step (?P<step>\\d+)', event: step}}]
expect: {{completes: true}}
""")
    loaded = load_scenario(path)
    from aftershock.harness import systems
    assert systems.of(loaded.spec.system).steps(loaded.spec.system) == 8  # the progress bar
    view = LiveObserver(Console(file=StringIO(), width=120))
    result = run_scenario(loaded, run_dir=tmp_path / "run", observer=view)
    assert result.metrics["generations"] == 1
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    started = [e for e in map(json.loads, lines) if e["event"] == "process_started"]
    assert [e["generation"] for e in started] == [0, 1]
    assert len({e["pid"] for e in started}) == 2
    row = view.state.ranks[0]
    assert row.pid == started[-1]["pid"]
    assert row.generation == 1
    assert row.status.plain == "exited 0"


# ---------------------------------------------------------------- files from before the launch

APPENDER = """\
import os, sys
path, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, mode, buffering=1) as log:
    for step in range(steps):
        log.write(f"epoch {step} loss 0.5\\n")
"""


@pytest.mark.parametrize("where", ["run-folder", "elsewhere"])
@pytest.mark.parametrize("mode", ["a", "w"])
def test_lines_written_before_the_launch_are_not_this_runs(
        tmp_path: Path, where: str, mode: str) -> None:
    """A log file a `logs:` glob matches that was there before the launch (a reused run
    folder's torchrun/ logs, a server's log that persists) holds an earlier run's lines:
    they are never read as this run's. Lines appended after the launch are, and so is a
    file the job rewrites from its start."""
    (tmp_path / "appender.py").write_text(APPENDER)
    log = ("${run_dir}/ranks/attempt_0/0/stdout.log" if where == "run-folder"
           else str(tmp_path / "var" / "job.log"))

    def run_with(steps: int) -> list[int]:
        path = tmp_path / f"appender-{steps}.yaml"
        path.write_text(f"""\
name: appender
system:
  command: [{sys.executable}, {tmp_path / 'appender.py'}, '{log}', '{mode}', '{steps}']
  logs: ['{log}']
  probes: [{{pattern: 'epoch (?P<step>\\d+) loss', event: step, stream: logs}}]
expect: {{completes: true}}
""")
        run_dir = tmp_path / "run"
        assert run_scenario(load_scenario(path), run_dir=run_dir).passed
        lines = (run_dir / "events.jsonl").read_text().splitlines()
        return [e["step"] for e in map(json.loads, lines) if e["event"] == "step"]

    assert run_with(5) == [0, 1, 2, 3, 4]
    assert run_with(0) == []  # the same folder again: the first run's lines stay its own
    assert run_with(2) == [0, 1]  # appended after them, or the file rewritten from its start
