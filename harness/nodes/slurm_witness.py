"""``expect.slurm_witness``: Slurm's own record of a job against what the job's logs claim.

Slurm is a witness the job cannot talk over: ``scontrol show job`` (the ``slurm_state``
events the harness writes at every change, the ``slurm_job`` event at the end) says how many
times the job was requeued and when each run of it began. The job's own reports (``step``,
``checkpoint_loaded``, from its probe or its log lines) say where each run started. The two
must agree: a run that Slurm started for the first time cannot have resumed from anything,
and a run that Slurm started again after a requeue must resume from the checkpoint the job
had saved before, not train from scratch. Where Slurm's record is missing the check fails as
not observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aftershock.harness.run.records import CheckResult, Event

NAME = "slurm_witness"
EXPECTED = "each run as Slurm started it: a first run from scratch, a requeued one resumed"


def _int(value: object) -> int | None:
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _runs(states: Sequence[Event]) -> dict[int, float]:
    """Slurm's runs of the job (its requeue count) -> the moment after which every line of
    that run was written. The first run: from the start. A run after a requeue: the last
    state the harness saw it in before it ran again (PENDING: the run before had ended,
    COMPLETING is behind it), as the poll may see it RUNNING only after its first lines;
    where the poll saw no such state, the first state that carried its requeue count."""
    first: dict[int, float] = {}
    waiting: dict[int, float] = {}
    running: set[int] = set()
    for e in states:
        count = _int(e.fields.get("restarts"))
        if count is None:
            continue
        first.setdefault(count, e.t)
        state = e.fields.get("jobstate")
        if state == "RUNNING":
            running.add(count)
        elif state != "COMPLETING" and count not in running:
            waiting[count] = e.t
    return {count: -math.inf if count == 0 else waiting.get(count, t)
            for count, t in first.items()}


def slurm_witness(events: Sequence[Event]) -> CheckResult:
    """Each run of the job, as Slurm's record delimits it, against the job's first report in
    it: the first run must start fresh (no ``checkpoint_loaded`` first, no first step past
    the job's lowest), and each run after a requeue must resume (a ``checkpoint_loaded``
    first, or a first step past the lowest) when the job had reported a checkpoint saved
    before it began."""
    states = [e for e in events if e.event == "slurm_state"]
    final, restarts = _final(events)
    if final is None or restarts is None or not states:
        return CheckResult(NAME, False, None, EXPECTED,
                           "not observed: Slurm's record of the job is missing (no `slurm_job` "
                           "with its Restarts, or no `slurm_state`, from `scontrol show job`)")
    observed = _observed(final, restarts, events)
    runs = sorted(_runs(states).items())
    if [count for count, _ in runs] != list(range(restarts + 1)):
        return CheckResult(NAME, False, observed, EXPECTED,
                           f"not observed: Slurm requeued the job {restarts} time(s), but the "
                           f"harness saw the runs {[count for count, _ in runs]} of it")
    claims = _with_step(events, ("step", "checkpoint_loaded"))
    steps = [e.fields["step"] for e in claims if e.event == "step"]
    if not steps:
        return CheckResult(NAME, False, observed, EXPECTED,
                           "not observed: the job reported no step, so what it claims of its "
                           "runs is unknown")
    saved = _with_step(events, ("checkpoint_saved",))
    told, problems = _judge_runs(runs, claims, saved, fresh=min(steps))
    if problems:
        return CheckResult(NAME, False, observed, EXPECTED, "; ".join(problems))
    return CheckResult(NAME, True, observed, EXPECTED,
                       f"Slurm's record and the job's logs agree: {'; '.join(told)}")


def _final(events: Sequence[Event]) -> tuple[Event | None, int | None]:
    """Slurm's last record of the job (``slurm_job``) and its Restarts count."""
    final = next((e for e in reversed(events) if e.event == "slurm_job"), None)
    return final, _int(final.fields.get("Restarts")) if final is not None else None


def _with_step(events: Sequence[Event], names: tuple[str, ...]) -> list[Event]:
    """The events named ``names`` that carry a step number."""
    return [e for e in events if e.event in names and isinstance(e.fields.get("step"), int)]


def _observed(final: Event, restarts: int, events: Sequence[Event]) -> str:
    """Slurm's record of the job in one line, with each step's exit code as Slurm's
    accounting (or the batch script) recorded it."""
    observed = (f"{final.fields.get('JobState')}, {restarts} requeue(s), exit "
                f"{final.fields.get('ExitCode')} on {final.fields.get('NodeList')}")
    recorded = [e for e in events if e.event == "slurm_step"]
    if recorded:
        observed += "; steps " + ", ".join(
            f"{e.fields.get('step')} exit {e.fields.get('exit_code')}" for e in recorded
        ) + f" ({recorded[0].source})"  # who recorded them: sacct, the batch script, srun
    else:
        observed += ("; step exit codes not observed (no accounting, and no record from the "
                     "job's srun)")
    return observed


def _judge_runs(runs: list[tuple[int, float]], claims: list[Event], saved: list[Event], *,
                fresh: int) -> tuple[list[str], list[str]]:
    """What the job told of each of Slurm's runs (its first report in it), and where that
    contradicts Slurm: a first run that resumed, a requeued run that started over."""
    problems: list[str] = []
    told: list[str] = []
    for index, (count, began) in enumerate(runs):
        ends = runs[index + 1][1] if index + 1 < len(runs) else math.inf
        inside = [e for e in claims if began <= e.t < ends]
        if not inside:
            told.append(f"run {count}: no report")
            continue
        first = inside[0]  # the timeline's order: a resume is reported before its steps
        step = first.fields["step"]
        resumed = first.event == "checkpoint_loaded" or step > fresh
        said = f"resumed from step {step}" if first.event == "checkpoint_loaded" else \
            f"first step {step}"
        told.append(f"run {count}: {said}")
        if count == 0 and resumed:
            problems.append(
                f"the job's first run claims to continue ({said}) but Slurm had never "
                f"requeued it then (Restarts 0): it resumed from something no run of this "
                "job left")
        before = [e.fields["step"] for e in saved if e.t < began]
        if count > 0 and before and not resumed:
            problems.append(
                f"after Slurm's requeue {count} the job started from scratch ({said}) though "
                f"it had reported a checkpoint saved at step {max(before)} before the run")
    return told, problems
