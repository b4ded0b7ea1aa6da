"""Slurm as the harness and its faults talk to it: its own client programs, nothing else.

Every call is one of Slurm's commands (``sbatch``, ``squeue``, ``scontrol``, ``scancel``)
against whatever cluster they reach (``SLURM_CONF``, else ``/etc/slurm/slurm.conf``): the
test cluster of ``make slurm-cluster`` or a site's. A run's jobs are named
``aftershock-<run id>`` (:func:`job_name`), so a heal finds and cancels them from the journal
alone, and touches no job of anyone else's.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

JOB_PREFIX = "aftershock-"
#: The label value (``aftershock.run``) of the test cluster's containers
#: (harness/nodes/slurm_cluster.py): the only containers in which slurm.kill_slurmd starts
#: a slurmd again.
TEST_CLUSTER_ID = "slurm-test-cluster"
#: Job states after which nothing of the job runs or will run again (Slurm's squeue(1)).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"})
CALL_TIMEOUT_S = 30.0
#: How often scancel is sent again while a cancelled job is still in the queue.
RECANCEL_S = 5.0
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(\S*)")


class SlurmError(RuntimeError):
    """A Slurm command failed: what it said."""


def job_name(run_id: str) -> str:
    """The name of every job a run submits (``scancel --name`` finds them all)."""
    return f"{JOB_PREFIX}{run_id}"


def problem() -> str | None:
    """Why no Slurm cluster can be used from here, or None when ``sinfo`` answers."""
    for program in ("sbatch", "squeue", "scontrol", "scancel", "sinfo"):
        if shutil.which(program) is None:
            return (f"Slurm's `{program}` is not installed (apt-get install slurm-client; "
                    "`make slurm-cluster` installs a test cluster)")
    # Slurm's clients retry a missing configuration for a minute before they give up.
    named = os.environ.get("SLURM_CONF")
    places = [Path(named)] if named else [Path("/etc/slurm/slurm.conf"),
                                          Path("/run/slurm/conf/slurm.conf")]
    if not any(p.is_file() for p in places):
        return (f"no Slurm configuration at {' or '.join(map(str, places))} (SLURM_CONF): "
                "start a test cluster with `make slurm-cluster`")
    try:
        done = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True,
                              text=True, timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "`sinfo` did not answer in 30 s"
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"no Slurm cluster answers `sinfo` ({said[0]}): start one with `make slurm-cluster`"
    return None


def run(argv: list[str], *, timeout: float = CALL_TIMEOUT_S) -> str:
    """Run one Slurm command; its output, or SlurmError with what it said."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not finish in {timeout:g}s") from None
    except OSError as exc:
        raise SlurmError(f"`{argv[0]}`: {exc}") from None
    if done.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` record as its ``Key=Value`` fields (values with spaces,
    such as a command line, keep their first word only)."""
    return {key: value for key, value in _FIELD.findall(line)}


def show_job(job_id: str, *, timeout: float = CALL_TIMEOUT_S) -> dict[str, str] | None:
    """Slurm's view of job ``job_id`` (``scontrol show job -o``), or None when Slurm no
    longer knows it (MinJobAge passed) or says it is invalid."""
    try:
        text = run(["scontrol", "show", "job", "-o", job_id], timeout=timeout)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    lines = [line for line in text.splitlines() if line.strip()]
    return parse_record(lines[0]) if lines else None


def exit_status(record: dict[str, str]) -> int:
    """A finished job's exit status as a shell gives one: its ``ExitCode`` (``code:signal``),
    128 + the signal when a signal ended it; 1 for a job that failed without either."""
    code, _, sig = record.get("ExitCode", "0:0").partition(":")
    status = int(code) if code.isdigit() else 0
    if status == 0 and sig.isdigit() and int(sig):
        status = 128 + int(sig)
    if status == 0 and record.get("JobState") != "COMPLETED":
        status = 1
    return status


def live_jobs(name: str, *, timeout: float = CALL_TIMEOUT_S) -> list[str]:
    """Ids of the jobs named ``name`` that are queued, running or ending."""
    return [job for job, _ in live_states(name, timeout=timeout)]


def live_states(name: str, *, timeout: float = CALL_TIMEOUT_S) -> list[tuple[str, str]]:
    """(id, state) of each job named ``name`` that is queued, running or ending."""
    text = run(["squeue", "--noheader", f"--name={name}", "--format=%i %T"], timeout=timeout)
    return [(line.split()[0], line.split()[-1]) for line in text.splitlines()
            if len(line.split()) == 2 and line.split()[-1] not in TERMINAL]


class JobsLeft(SlurmError):
    """Jobs of a run outlived its cancel: ``jobs`` as Slurm last showed them (id, state), or
    empty when Slurm could not be asked."""

    def __init__(self, message: str, jobs: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.jobs = jobs


def cancel_named(name: str, *, patience_s: float = 60.0) -> None:
    """Cancel every job named ``name`` (``scancel --name``: SIGTERM, then SIGKILL after the
    cluster's KillWait) and wait until none is queued or running, all within ``patience_s``
    (each command's own limit included: slurmctld may be slow or away); JobsLeft, naming
    what Slurm last showed, when one is left."""
    if not name.startswith(JOB_PREFIX):
        raise SlurmError(f"job name {name!r} is not one of a run ({JOB_PREFIX}<run id>)")
    deadline = time.monotonic() + patience_s
    left: list[tuple[str, str]] = []
    why = ""
    asked = -math.inf  # when scancel was last sent: again every few seconds while jobs stay
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            # scancel before squeue: an squeue that hangs must not keep the cancel from
            # being sent at all.
            if time.monotonic() - asked >= RECANCEL_S:
                asked = time.monotonic()
                run(["scancel", f"--name={name}"], timeout=min(CALL_TIMEOUT_S, remaining))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            left = live_states(name, timeout=min(CALL_TIMEOUT_S, remaining))
        except SlurmError as exc:
            why = f" ({exc})"
        else:
            if not left:
                return
            why = ""
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    shown = ", ".join(f"{job} ({state})" for job, state in left) or "Slurm could not be asked"
    raise JobsLeft(f"jobs named {name} were still in the queue {patience_s:g}s after scancel: "
                   f"{shown}{why}", left)


def srun_epilog() -> str | None:
    """The cluster's own SrunEpilog (``scontrol show config``), or None when it has none;
    SlurmError when Slurm cannot say."""
    for line in run(["scontrol", "show", "config"]).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "SrunEpilog":
            return None if value.strip() in ("", "(null)") else value.strip()
    return None


def job_steps(job_id: str, *, timeout: float = CALL_TIMEOUT_S) -> list[dict[str, str]] | None:
    """Each step of job ``job_id`` as Slurm's accounting recorded it (``sacct``: step id,
    state, exit code, nodes), or None where the cluster keeps no accounting (no slurmdbd:
    ``sacct`` says so, as on the test cluster)."""
    fields = ("JobID", "State", "ExitCode", "NodeList")
    try:
        text = run(["sacct", "--jobs", job_id, "--noheader", "--parsable2", "--duplicates",
                    f"--format={','.join(fields)}"], timeout=timeout)
    except SlurmError:
        return None  # "Slurm accounting storage is disabled", or sacct is not installed
    rows = [dict(zip(fields, line.split("|"), strict=False)) for line in text.splitlines()
            if line.strip()]
    return [row for row in rows if "." in row.get("JobID", "")] or None
