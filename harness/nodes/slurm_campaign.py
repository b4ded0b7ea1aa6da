"""Campaigns fanned out over a Slurm cluster: ``aftershock run DIR --executor slurm``.

Each run of the campaign (a scenario, a seed) is one task of one array job; each task runs
``python -m aftershock run <file> --run-dir <campaign>/<task> --seed <seed>`` on the node
Slurm gives it, so the run is the same as a local one, with the same seed: only where it
runs changes. The run folders are on the filesystem every node mounts (the project's
``.aftershock/`` on the test cluster, a site's shared filesystem elsewhere); the submitting
harness waits for the array to end, then reads each task's ``result.json``, so one report and
one JUnit file cover the campaign as for a local run.

The array job is named ``aftershock-<campaign id>`` and journalled before ``sbatch`` runs,
like a run's job (harness/nodes/slurm_target.py): the reaper of a killed harness, or
``aftershock heal``, cancels it, and each task's own harness heals its run on the SIGTERM
that the cancel sends.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aftershock.faults import slurm_cli as slurm
from aftershock.faults.heal import start_reaper
from aftershock.faults.journal import STATE_ENV, Journal, UnsafeFolder
from aftershock.harness.errors import HarnessError
from aftershock.harness.probe import RUN_ID_ENV
from aftershock.harness.run.records import RunResult
from aftershock.harness.scenario.spec import LoadedScenario

POLL_S = 1.0  # how often the queue is asked whether any task is left (each ask is a command)
#: How long a cancel waits for Slurm to end the tasks: KillWait, then each task's own heal.
CANCEL_PATIENCE_S = 120.0


@dataclass(frozen=True, slots=True)
class Task:
    """One run of the campaign, as one task of the array job."""

    scenario: Path
    name: str  # the scenario's name: its run folder is folder/name
    seed: int
    folder: Path  # the task's --run-dir


def tasks_of(loaded: Sequence[LoadedScenario], *, root: Path, seed: int | None,
             repeat: int) -> list[Task]:
    """The campaign's runs in the order a local run makes them, each seeded as it would be
    there (``--seed``, else the scenario's, plus the attempt)."""
    tasks: list[Task] = []
    for scenario in loaded:
        for attempt in range(repeat):
            this_seed = (seed if seed is not None else scenario.spec.seed) + attempt
            tasks.append(Task(scenario.path.absolute(), scenario.spec.name, this_seed,
                              root / f"{len(tasks):04d}"))
    return tasks


def array_script(tasks: Sequence[Task], *, use_cache: bool) -> str:
    """The array job's batch script: task ``$SLURM_ARRAY_TASK_ID`` runs its scenario with the
    harness's own Python (the same path on every node, as for a run's job)."""
    return task_script([
        ([sys.executable, "-m", "aftershock", "run", str(task.scenario), "--run-dir",
          str(task.folder), "--seed", str(task.seed), "--plain",
          *([] if use_cache else ["--no-cache"])], task.folder) for task in tasks])


def task_script(commands: Sequence[tuple[Sequence[str], Path]]) -> str:
    """An array job's batch script: task ``$SLURM_ARRAY_TASK_ID`` execs ``commands[i]``'s
    argv, with its heal journal under ``commands[i]``'s folder."""
    lines = ["#!/bin/bash", "# Written by Aftershock (harness/nodes/slurm_campaign.py).",
             "set -u", 'case "$SLURM_ARRAY_TASK_ID" in']
    for index, (argv, folder) in enumerate(commands):
        # Each task keeps its heal journal in a folder of its own: a harness on a node
        # (another process namespace, another host) would take the submitter's journal,
        # whose process it cannot see, for an orphan's, and heal it: cancel the campaign.
        state = shlex.quote(str(folder / "state"))
        lines.append(f"  {index}) export {STATE_ENV}={state}; exec {shlex.join(argv)} ;;")
    lines += ["esac", 'echo "aftershock: no run for array task $SLURM_ARRAY_TASK_ID" >&2',
              "exit 3"]
    return "\n".join(lines) + "\n"


def run_campaign(loaded: Sequence[LoadedScenario], *, run_dir: Path | None,
                 seed: int | None, repeat: int, use_cache: bool,
                 say: Callable[[str], None] = lambda line: None) -> list[RunResult]:
    """Run every scenario ``repeat`` times as the tasks of one array job and return their
    records in the local run's order; HarnessError when Slurm cannot take the job or a task
    left no record (its output file is named)."""
    from aftershock.harness.run.rundir import read_result

    problem = slurm.problem()
    if problem is not None:
        raise HarnessError(f"--executor slurm: {problem}")
    campaign_id = uuid.uuid4().hex
    root = (run_dir if run_dir is not None
            else Path(".aftershock") / "runs" / f"slurm-{campaign_id[:12]}").absolute()
    root.mkdir(parents=True, exist_ok=True)
    tasks = tasks_of(loaded, root=root, seed=seed, repeat=repeat)
    script = root / "campaign.sh"
    script.write_text(array_script(tasks, use_cache=use_cache))
    job_id = run_array(campaign_id, root=root, script=script, tasks=len(tasks), say=say)
    results: list[RunResult] = []
    for index, task in enumerate(tasks):
        record = task.folder / task.name / "result.json"
        try:
            results.append(read_result(record))
        except (OSError, ValueError) as exc:
            raise HarnessError(
                f"array task {index} ({task.scenario}, seed {task.seed}) left no run record "
                f"at {record} ({exc}); its output: {task_output(root, job_id, index)}"
            ) from None
    return results


def task_output(root: Path, job_id: str, index: int) -> Path:
    """Where Slurm writes what array task ``index`` printed (``--output`` of run_array)."""
    return root / f"slurm-{job_id}_{index}.out"


def run_array(campaign_id: str, *, root: Path, script: Path, tasks: int,
              say: Callable[[str], None], what: str = "run(s)") -> str:
    """Submit ``script`` as an array job of ``tasks`` tasks named for ``campaign_id`` and
    wait for it to end; its job id. Journalled for heal before ``sbatch``; on Ctrl-C,
    SIGTERM or an error the tasks are cancelled and waited for before it raises."""
    name = slurm.job_name(campaign_id)
    try:
        journal = Journal.create(campaign_id, folders=[root])
    except UnsafeFolder as exc:
        raise HarnessError(f"cannot keep a heal journal: {exc}") from None
    reaper = start_reaper(journal.path)
    # Journalled before sbatch: a harness killed right after it leaves a job that the
    # reaper or `aftershock heal` cancels by this name (faults/heal.py).
    entry = journal.intend("launch", {"env": RUN_ID_ENV, "value": campaign_id, "cgroup": None,
                                      "slurm_job_name": name}, op="launch")
    cancelled = False
    try:
        job_id = slurm.run([
            "sbatch", "--parsable", f"--array=0-{tasks - 1}", f"--job-name={name}",
            # One run per node at a time: a run's timing checks must not share its CPUs
            # with another run's ranks.
            "--nodes=1", "--ntasks=1", "--exclusive", f"--chdir={Path.cwd()}",
            f"--export=ALL,{RUN_ID_ENV}={campaign_id}",
            f"--output={root}/slurm-%A_%a.out", str(script)]).strip().split(";")[0]
        say(f"slurm: {tasks} {what} as array job {job_id} ({name}); folders in {root}")
        started = time.monotonic()
        while slurm.live_jobs(name):
            time.sleep(POLL_S)
        say(f"slurm: array job {job_id} ended after {time.monotonic() - started:.1f}s")
        cancelled = True
    finally:
        # Nothing left to cancel after a normal end; on Ctrl-C, SIGTERM or an error the
        # tasks are cancelled and waited for, and each task's harness heals its own run.
        with contextlib.suppress(slurm.SlurmError):
            slurm.cancel_named(name, patience_s=CANCEL_PATIENCE_S)
            cancelled = True
        if cancelled:
            journal.done(entry)
        journal.close()
        reaper.kill()
        reaper.wait(timeout=5)
    return job_id
