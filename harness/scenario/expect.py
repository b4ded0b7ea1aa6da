"""What must hold after a run: the scenario's ``expect:`` block, one field per built-in check
(harness/verdict/checks.py evaluates them) and ``checks:`` for the checks plug-ins add."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from aftershock.harness.scenario.schema import MAX_STEPS, Duration
from aftershock.harness.scenario.schema import Strict as _Strict
from aftershock.harness.verdict import check_registry


class Budget(_Strict):
    max: Duration


class DetectBudget(Budget):
    """A detection budget, and optionally the causes that must detect the fault."""

    cause: list[str] | None = Field(
        None, min_length=1,
        description="the `cause` of the first failure_detected event after the fault must be "
        "one of these: exactly, or with a detail after a colon (`collective_error` matches "
        "`collective_error: Connection reset`), or by prefix with a trailing `*` (`xid_*`)",
    )

    @field_validator("cause", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("cause")
    @classmethod
    def _named(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(c.strip() for c in value):
            raise ValueError("a cause must not be empty")
        return value

    def admits(self, cause: str) -> bool:
        """Whether a failure_detected event's ``cause`` is one of ours (no cause: any)."""
        if self.cause is None:
            return True
        return any(cause == want or cause.startswith(want + ":") or
                   (want.endswith("*") and cause.startswith(want[:-1])) for want in self.cause)


class CountBudget(_Strict):
    max: int = Field(ge=0, le=MAX_STEPS)
    # lost_steps only (Expect refuses it elsewhere)
    snapshot_interval: bool = Field(
        False, description="`max` for each restore from snapshots, plus what the snapshot "
        "interval leaves unsaved (interval - 1) at each: restores x (max + interval - 1), at "
        "least `max`; the interval and the restores read from the run's timeline (the "
        "reference trainer's `membership` events, its `checkpoint_loaded`); a run that "
        "recorded no interval fails, not observed")


class RateFloor(_Strict):
    min: float = Field(gt=0, le=1_000_000, description="steps per second, over any 2 s window")


class Latency(_Strict):
    """Latency budgets over every request of the run, the fault included (client-side)."""

    ttft_p50: Budget | None = Field(None, description="time to first token, median")
    ttft_p99: Budget | None = Field(None, description="time to first token, 99th percentile")
    tpot_p50: Budget | None = Field(None, description="time between tokens, median")
    tpot_p99: Budget | None = Field(None, description="time between tokens, 99th percentile")


class Expect(_Strict):
    """What must hold after the run. Each field is one named check in the report."""

    completes: bool = Field(True, description="the system exits 0 within its timeout")
    params_match: Literal["fault_free", "replay"] | None = Field(
        None, description="fault_free: final parameters bitwise equal to a fault-free run "
        "(same seed); replay: equal to what the membership the run recorded implies, "
        "recomputed by an independent oracle from the model's math (elastic recovery changes "
        "the math while a replica is missing)"
    )
    time_to_detect: DetectBudget | None = None
    time_to_recover: Budget | None = None
    lost_steps: CountBudget | None = None
    skipped_steps: CountBudget | None = Field(
        None, description="steps the history jumped over (a world going from step a to b > "
        "a+1, or resuming past where it loaded); needs every step reported"
    )
    single_history: bool = Field(
        False, description="no step is committed after the fault by two worlds that both "
        "go on (a split brain); needs steps that name their world (generation)"
    )
    step_rate: RateFloor | None = Field(
        None, description="the slowest 2 s of the run commits at least this many steps/s"
    )
    xid_action: bool = Field(
        False, description="for every gpu.xid fault, the process hit reports an xid_action "
        "event with the action NVIDIA recommends for that Xid (aftershock faults xid) and takes "
        "it: for none it goes on working, for any other action it stops and exits"
    )
    straggler_named: bool = Field(
        False, description="the system reports a straggler_detected event naming the rank "
        "the process.straggle fault slowed"
    )
    no_lost_requests: bool = Field(
        False, description="load: every request the load generator sent completed with all "
        "its tokens"
    )
    no_duplicated_tokens: bool = Field(
        False, description="load: no client received a token index twice"
    )
    outputs_match: Literal["fault_free"] | None = Field(
        None, description="load: every request's tokens equal those of a fault-free run "
        "of the same load"
    )
    latency: Latency | None = None
    acknowledged_durable: bool = Field(
        False, description="load: every token a client received is in the server's journal "
        "where the server said (`journal_offset`), every acknowledged request is in it, and a "
        "request in flight at a crash was resumed from it, not started again (the reference "
        "server's journal); under storage.lose_unsynced, every token was received after the "
        "fsync that made its record durable"
    )
    checkpoint_durable: bool = Field(
        False, description="after the first fault, the system resumes (checkpoint_loaded) from "
        "a checkpoint at least as new as the last one it reported saved (checkpoint_saved) "
        "before the fault, and rejects none on the way (checkpoint_skipped): what it called "
        "committed survived, whole"
    )
    faults_landed: Literal["in_window"] | None = Field(
        None, description="in_window: every fault triggered by a file being created, opened "
        "or modified landed while a process of the run still had that file open for writing "
        "(inside the save, not after it)"
    )
    slurm_witness: bool = Field(
        False, description="a `slurm:` job: Slurm's own record (`scontrol show job`: its "
        "requeues, each run's start, state, exit code) agrees with the job's reports: its "
        "first run starts fresh, and a run after a requeue resumes from the checkpoint it "
        "had saved (docs/scale-out.md)"
    )
    checks: dict[str, Any] = Field(
        default_factory=dict, description="checks other packages add "
        "(the aftershock.checks entry points, docs/extending.md): NAME: its arguments, or true"
    )

    @field_validator("checks")
    @classmethod
    def _plugin_checks(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Each by its own model, so a typo in a plug-in check's arguments is a scenario error.
        parsed: dict[str, Any] = {}
        for name, args in value.items():
            if name in cls.model_fields:
                raise ValueError(f"{name} is a built-in check: write it as `expect: {{{name}: "
                                 "...}`, not under `checks`")
            try:
                parsed[name] = check_registry.parse_args(name, args)
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
            except ValidationError as exc:
                raise ValueError(f"checks.{name}: " + "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                    for e in exc.errors())) from None
        return parsed

    @field_validator("time_to_detect", mode="before")
    @classmethod
    def _detect_budget(cls, value: Any) -> Any:
        # A plain Budget (programmatic use) is a detection budget without a cause.
        if isinstance(value, Budget) and not isinstance(value, DetectBudget):
            return DetectBudget(max=value.max)
        return value

    @field_validator("skipped_steps")
    @classmethod
    def _no_interval(cls, value: CountBudget | None) -> CountBudget | None:
        if value is not None and value.snapshot_interval:
            raise ValueError("`snapshot_interval` applies to `lost_steps` only")
        return value

    #: Checks that read what the load's clients received (a load: `load:` or the
    #: reference server's `system.load`).
    SERVING: typing.ClassVar[tuple[str, ...]] = (
        "no_lost_requests", "no_duplicated_tokens", "outputs_match", "latency",
        "acknowledged_durable")
    #: Checks that read training steps or parameters.
    TRAINING: typing.ClassVar[tuple[str, ...]] = (
        "params_match", "lost_steps", "skipped_steps", "single_history", "step_rate",
        "straggler_named", "checkpoint_durable")
