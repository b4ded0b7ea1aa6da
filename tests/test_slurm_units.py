"""The `slurm:` system kind and Slurm's helpers without a cluster: the scenario block, the
batch script and sbatch options it makes, how Slurm's answers are read, what a heal
accepts, and that the Slurm tests skip (or fail, where required) without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aftershock.faults import slurm_cli as _slurm
from aftershock.faults.heal import validate_launch
from aftershock.faults.journal import UndoContext, UndoRefused
from aftershock.harness.errors import SpecError
from aftershock.harness.nodes.slurm_witness import slurm_witness
from aftershock.harness.run.records import Event
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.systems import slurm as kind
from aftershock.harness.verdict.checks import Outcome, evaluate

ROOT = Path(__file__).resolve().parents[1]
TRAINER = """\
name: s
system:
  slurm:
    nodes: 2
    ntasks_per_node: 2
    trainer: {steps: 10}
"""


def test_a_slurm_block_gives_exactly_one_job() -> None:
    spec = parse_scenario(TRAINER)
    assert isinstance(spec.system, kind.SlurmSystem)
    with pytest.raises(SpecError, match="exactly one of"):
        parse_scenario(TRAINER.replace("trainer: {steps: 10}",
                                       "trainer: {steps: 10}\n    command: [hostname]"))
    with pytest.raises(SpecError, match="exactly one of"):
        parse_scenario("name: s\nsystem:\n  slurm: {nodes: 2}\n")
    with pytest.raises(SpecError, match="partition"):
        parse_scenario("name: s\nsystem:\n  slurm: {nodes: 2, command: [x], partition: 'a b'}\n")


def test_the_trainer_runs_one_torchrun_agent_per_node_meeting_at_the_batch_host(
        tmp_path: Path) -> None:
    system = parse_scenario(TRAINER).system
    assert isinstance(system, kind.SlurmSystem)
    launch = kind.SLURM.launch(system, run_dir=tmp_path, scenario_dir=tmp_path, seed=3)
    assert isinstance(launch, kind.SlurmLaunch)
    (srun,) = [line for line in launch.script.splitlines() if line.startswith("srun ")]
    assert srun.startswith("srun --ntasks-per-node=1 ")
    assert "--nnodes=$SLURM_JOB_NUM_NODES" in srun
    assert "--nproc-per-node=2" in srun
    assert "--rdzv-endpoint=$head:29400" in srun
    assert "head=$(hostname)" in launch.script
    assert "--replicas=4" in srun
    assert "--seed=3" in srun
    assert f"--checkpoint-dir={tmp_path / 'checkpoints'}" in srun
    assert kind.SLURM.world(system) == 4


def test_a_sites_partition_account_and_requeue_reach_sbatch(tmp_path: Path) -> None:
    spec = parse_scenario(
        "name: s\nsystem:\n  slurm: {nodes: 3, command: [python, job.py, '--x=1'], "
        "partition: gpu, account: proj-42, qos: high, requeue: true, time_limit: 10m, "
        "sbatch_args: ['--gres=gpu:8']}\n")
    system = spec.system
    assert isinstance(system, kind.SlurmSystem)
    launch = kind.SLURM.launch(system, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    assert isinstance(launch, kind.SlurmLaunch)
    assert set(launch.sbatch) >= {"--nodes=3", "--ntasks-per-node=1", "--partition=gpu",
                                  "--account=proj-42", "--qos=high", "--requeue",
                                  "--time=10", "--gres=gpu:8", "--open-mode=append"}
    assert "\nsrun python job.py --x=1\nrc=$?\n" in launch.script
    assert launch.script.splitlines()[-1] == "exit $rc"
    unset = parse_scenario("name: s\nsystem:\n  slurm: {nodes: 1, command: [x]}\n").system
    assert isinstance(unset, kind.SlurmSystem)
    options = kind.sbatch_options(unset, run_dir=tmp_path)
    assert "--no-requeue" in options
    assert not [o for o in options if o.startswith(("--partition", "--account"))]


def test_a_batch_script_of_the_users_runs_as_it_is(tmp_path: Path) -> None:
    """Its text unchanged in the run folder, exec'd by what is submitted, which carries its
    #SBATCH lines (tests/slurm/test_slurm_srun_wrapper.py runs the two)."""
    text = "#!/bin/bash\n#SBATCH --time=5\nsrun hostname\n"
    (tmp_path / "job.sbatch").write_text(text)
    spec = parse_scenario("name: s\nsystem:\n  slurm: {nodes: 2, script: job.sbatch}\n")
    assert isinstance(spec.system, kind.SlurmSystem)
    launch = kind.SLURM.launch(spec.system, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    assert isinstance(launch, kind.SlurmLaunch)
    assert dict(launch.files)["slurm/script/job.sbatch"] == text
    assert launch.script.splitlines()[:2] == ["#!/bin/sh", "#SBATCH --time=5"]
    assert launch.script.splitlines()[-1] == \
        f'exec {tmp_path.absolute() / "slurm" / "script" / "job.sbatch"} "$@"'
    assert kind.SLURM.file_problems(spec.system, tmp_path / "elsewhere") == [
        (("slurm", "script"), f"no file 'job.sbatch' in {tmp_path / 'elsewhere'}")]


def test_a_script_or_command_job_is_observed_through_its_probes(tmp_path: Path) -> None:
    spec = parse_scenario(
        "name: s\nsystem:\n  slurm:\n    nodes: 2\n    command: [hostname]\n"
        "    preset: torchrun\n    logs: ['${run_dir}/torchrun/**/stdout.log']\n"
        "    probes: [{pattern: 'step (?P<step>\\d+)', event: step}]\n")
    assert isinstance(spec.system, kind.SlurmSystem)
    launch = kind.SLURM.launch(spec.system, run_dir=tmp_path, scenario_dir=tmp_path, seed=0)
    # Slurm's output file of the job (every requeue appended to it), then its own files.
    assert launch.tails == (str(tmp_path / "logs" / "slurm-*.out"),
                            str(tmp_path / "torchrun/**/stdout.log"))
    assert launch.probes[-1].event == "step"
    assert len(launch.probes) > 1  # the preset's too
    assert kind.SLURM.log_probes(spec.system) == list(launch.probes)
    with pytest.raises(SpecError, match="`preset`, `probes` and `logs` are for"):
        parse_scenario(TRAINER + "    probes: [{pattern: x, event: checkpoint_saved}]\n")
    with pytest.raises(SpecError, match="unknown preset"):
        parse_scenario("name: s\nsystem:\n  slurm: {nodes: 1, command: [x], preset: nope}\n")


def test_slurms_view_of_a_job_is_read_as_it_says() -> None:
    record = _slurm.parse_record(
        "JobId=7 JobName=aftershock-x JobState=FAILED Reason=NonZeroExitCode Restarts=2 "
        "ExitCode=3:0 NodeList=node[0-1] Command=/bin/sh -c x")
    assert record["JobState"] == "FAILED"
    assert record["Restarts"] == "2"
    assert record["NodeList"] == "node[0-1]"
    assert _slurm.exit_status(record) == 3
    assert _slurm.exit_status({"JobState": "CANCELLED", "ExitCode": "0:15"}) == 128 + 15
    assert _slurm.exit_status({"JobState": "NODE_FAIL", "ExitCode": "0:0"}) == 1
    assert _slurm.exit_status({"JobState": "COMPLETED", "ExitCode": "0:0"}) == 0


def test_a_heal_cancels_only_the_jobs_named_for_its_own_run(tmp_path: Path) -> None:
    context = UndoContext(run_id="abc", folders=(), state=tmp_path)
    ours = {"env": "AFTERSHOCK_RUN_ID", "value": "abc", "cgroup": None,
            "slurm_job_name": _slurm.job_name("abc")}
    validate_launch(ours, context)
    with pytest.raises(UndoRefused, match="slurm_job_name"):
        validate_launch({**ours, "slurm_job_name": "someone-elses-job"}, context)
    with pytest.raises(_slurm.SlurmError, match="not one of a run"):
        _slurm.cancel_named("someone-elses-job")


@pytest.mark.parametrize(("required", "outcome"), [("0", "1 skipped"), ("1", "1 error")])
def test_without_a_cluster_the_slurm_tests_skip_unless_required(
        tmp_path: Path, required: str, outcome: str) -> None:
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "no-such.conf"),
           "AFTERSHOCK_REQUIRE_SLURM": required}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
         "tests/slurm/test_slurm_cluster.py::test_two_nodes_each_with_its_own_hostname_and_address"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert outcome in done.stdout, done.stdout[-2000:]
    assert (done.returncode == 0) == (required == "0")
    assert f"no Slurm configuration at {tmp_path / 'no-such.conf'}" in done.stdout or \
        "Slurm's `sbatch` is not installed" in done.stdout, done.stdout[-2000:]


def test_slurm_faults_act_only_on_a_job_named_for_their_run(tmp_path: Path) -> None:
    from aftershock.faults import ProcessRef
    from aftershock.faults import slurm as kinds
    from aftershock.faults._errors import FaultUnavailable
    from aftershock.faults.journal import Journal

    journal = Journal.create("runA", folders=[tmp_path])
    try:
        env = {**os.environ, "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node1",
               "SLURM_JOB_NAME": _slurm.job_name("runB")}
        other = subprocess.Popen(
            [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
            env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None
            assert other.stdout.readline() == "ready\n"  # exec'd: its environment is env
            ref = ProcessRef.of(other.pid)
            assert ref is not None
            with pytest.raises(FaultUnavailable, match="not this run's"):
                kinds.NODE_DOWN.inject(ref, {"state": "down"}, journal)
            mine = ProcessRef.of(os.getpid())
            assert mine is not None
            with pytest.raises(FaultUnavailable, match="not a task of a Slurm job"):
                kinds.SIGNAL.inject(mine, {"signal": "SIGUSR1", "scope": "tasks"}, journal)
        finally:
            other.kill()
            other.wait()
            if other.stdout is not None:
                other.stdout.close()
    finally:
        journal.close()


def test_a_heal_resumes_only_a_slurm_node_of_its_own_run(tmp_path: Path) -> None:
    from aftershock.faults import slurm as kinds

    context = UndoContext(run_id="abc", folders=(), state=tmp_path)
    kinds.NODE_DOWN.validate({"node": "node1", "run": "abc", "job": "7"}, context)
    with pytest.raises(UndoRefused, match="run"):
        kinds.NODE_DOWN.validate({"node": "node1", "run": "xyz", "job": "7"}, context)
    with pytest.raises(UndoRefused, match="node name"):
        kinds.NODE_DOWN.validate({"node": "node1; rm -rf /", "run": "abc"}, context)


def test_slurm_faults_need_a_slurm_system() -> None:
    fault = "faults:\n  - {kind: slurm.preempt, target: {rank: 0}, at: {step: 3}}\n"
    parse_scenario(TRAINER + fault)
    with pytest.raises(SpecError, match="slurm"):
        parse_scenario("name: t\nsystem: {reference: trainer}\n" + fault)
    with pytest.raises(SpecError, match="not a signal"):
        parse_scenario(TRAINER + "faults:\n  - {kind: slurm.signal, target: {rank: 0}, "
                       "at: {step: 3}, signal: SIGNOPE}\n")


def test_a_heal_starts_only_slurmd_itself_again(tmp_path: Path) -> None:
    from aftershock.faults import slurm as kinds

    context = UndoContext(run_id="abc", folders=(), state=tmp_path)
    good = {"node": "node1", "run": "abc", "container": "f" * 64,
            "argv": ["/usr/sbin/slurmd-wlm", "-f", "/etc/slurm/slurm.conf", "-N", "node1"]}
    for argv in (["/bin/sh", "-c", "rm -rf /", "-N", "node1"],
                 ["/usr/sbin/slurmd", "-f", "x", "-N", "node2"],
                 ["/tmp/slurmd", "-f", "x", "-N", "node1"],
                 ["/usr/sbin/slurmd", "-f", "x", "-N", "node1", "--extra"]):
        with pytest.raises(UndoRefused, match="argv"):
            kinds.KILL_SLURMD.validate({**good, "argv": argv}, context)
    with pytest.raises(UndoRefused, match="container"):
        kinds.KILL_SLURMD.validate({**good, "container": "nope"}, context)


def _state(t: float, state: str, restarts: int) -> Event:
    return Event(t=t, event="slurm_state", source="harness",
                 fields={"jobstate": state, "restarts": str(restarts)})


def _witness_timeline(first_after_requeue: str | None, *, restarts: int = 1) -> list[Event]:
    """A job run, preempted at t=10 after saving step 4, and requeued; what its second run
    reports first: ``resume`` (from step 4), ``scratch`` (step 0 again), or nothing."""
    events = [_state(0.0, "PENDING", 0), _state(0.5, "RUNNING", 0)]
    events += [Event(t=1.0 + s, event="step", source="log", fields={"step": s})
               for s in range(6)]
    events.append(Event(t=5.5, event="checkpoint_saved", source="log", fields={"step": 4}))
    if restarts:
        events += [_state(10.0, "COMPLETING", 1), _state(11.0, "PENDING", 1),
                   _state(21.5, "RUNNING", 1)]
    if first_after_requeue == "resume":
        events.append(Event(t=21.2, event="checkpoint_loaded", source="log",
                            fields={"step": 4}))
    first = 4 if first_after_requeue == "resume" else 0
    if first_after_requeue is not None:
        events += [Event(t=22.0 + s, event="step", source="log", fields={"step": first + s})
                   for s in range(3)]
    events.append(Event(t=30.0, event="slurm_job", source="harness",
                        fields={"JobState": "COMPLETED", "Restarts": str(restarts),
                                "ExitCode": "0:0", "NodeList": "node[0-1]"}))
    return events


def test_the_slurm_witness_agrees_with_a_job_that_resumes_after_its_requeue() -> None:
    # Its first lines come before the poll sees it RUNNING again: they are still its run's.
    result = slurm_witness(_witness_timeline("resume"))
    assert result.passed, result.message
    assert "run 1: resumed from step 4" in result.message
    assert result.observed == ("COMPLETED, 1 requeue(s), exit 0:0 on node[0-1]; step exit "
                               "codes not observed (no accounting, and no record from the "
                               "job's srun)")
    steps = [Event(t=30.1, event="slurm_step", source="srun",
                   fields={"step": f"7.{n}", "exit_code": code}) for n, code in ((0, 0), (1, 3))]
    recorded = slurm_witness([*_witness_timeline("resume"), *steps])
    assert recorded.observed.endswith("; steps 7.0 exit 0, 7.1 exit 3 (srun)")


def test_the_slurm_witness_fails_a_requeue_that_restarted_from_scratch() -> None:
    result = slurm_witness(_witness_timeline("scratch"))
    assert not result.passed
    assert "started from scratch (first step 0)" in result.message
    assert "saved at step 4" in result.message


def test_the_slurm_witness_fails_a_resume_slurm_never_made() -> None:
    events = _witness_timeline(None, restarts=0)
    events.insert(2, Event(t=0.9, event="checkpoint_loaded", source="log", fields={"step": 4}))
    result = slurm_witness(events)
    assert not result.passed
    assert "first run claims to continue (resumed from step 4)" in result.message


def test_the_slurm_witness_is_not_observed_without_slurms_record() -> None:
    events = [e for e in _witness_timeline("resume") if e.event != "slurm_job"]
    result = slurm_witness(events)
    assert not result.passed
    assert result.message.startswith("not observed")
    # Slurm says it requeued the job, but the harness never saw that run: nothing to judge.
    missed = [e for e in _witness_timeline("resume")
              if not (e.event == "slurm_state" and e.fields["restarts"] == "1")]
    result = slurm_witness(missed)
    assert not result.passed
    assert "not observed" in result.message
    steps = [e for e in _witness_timeline("resume") if e.event not in ("step",
                                                                         "checkpoint_loaded")]
    assert slurm_witness(steps).message.startswith("not observed: the job reported no step")


def test_slurm_witness_is_a_check_of_the_expect_block() -> None:
    spec = parse_scenario(TRAINER + "expect: {slurm_witness: true}\n")
    assert spec.expect.slurm_witness
    results = evaluate(spec.expect, outcome=Outcome(0, False, 1.0), metrics={}, faults=[],
                       digests={}, baseline=None, events=_witness_timeline("scratch"))
    (result,) = [r for r in results if r.name == "slurm_witness"]
    assert not result.passed


def test_a_campaign_on_slurm_is_one_array_task_per_run_seeded_as_locally(
        tmp_path: Path) -> None:
    from aftershock.harness.nodes.slurm_campaign import array_script, tasks_of
    from aftershock.harness.scenario.load import load_scenario

    file = tmp_path / "s.yaml"
    file.write_text("name: s\nseed: 7\nsystem:\n  command: [x]\n")
    tasks = tasks_of([load_scenario(file)], root=tmp_path / "c", seed=None, repeat=2)
    assert [(t.seed, t.folder.name) for t in tasks] == [(7, "0000"), (8, "0001")]
    script = array_script(tasks, use_cache=False)
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    (second,) = [line for line in script.splitlines() if line.lstrip().startswith("1) ")]
    assert f"AFTERSHOCK_STATE_DIR={tmp_path / 'c' / '0001' / 'state'};" in second
    assert f"run {file} --run-dir {tmp_path / 'c' / '0001'} --seed 8" in second
    assert "--no-cache" in second
