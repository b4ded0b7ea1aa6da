"""Checks: each `expect:` entry of a scenario, evaluated over the run's timeline.

Each built-in check is one declaration at the end of the evaluations (a
:class:`check_registry.Check`: its name, doc line, evaluation, metric and `expect:` field),
registered by name; :func:`evaluate` runs the registry, plug-ins' checks included. A check
never raises for a bad run; it returns a failed CheckResult that says what was observed
against what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aftershock.faults import contract
from aftershock.harness.run.logprobe import unread
from aftershock.harness.run.records import CheckResult, Event, FaultRecord
from aftershock.harness.run.triggers import describe_file_state
from aftershock.harness.scenario._duration import format_duration
from aftershock.harness.scenario.spec import (
    WINDOWED,
    CountBudget,
    DetectBudget,
    Expect,
    Latency,
    RateFloor,
)
from aftershock.harness.verdict import check_registry
from aftershock.harness.verdict import metrics as _metrics
from aftershock.harness.verdict.check_registry import Check, Run
from aftershock.harness.verdict.check_registry import Outcome as Outcome
from aftershock.harness.verdict.metrics import Output


def _budget(name: str, observed: float | None, limit_s: float, what: str) -> CheckResult:
    expected = f"<= {format_duration(limit_s)}"
    if observed is None:
        return CheckResult(name, False, None, expected, f"{what} was never observed")
    ok = observed <= limit_s
    shown = format_duration(observed)
    verdict = "within" if ok else "over"
    return CheckResult(
        name, ok, round(observed, 4), expected, f"{what} took {shown}, {verdict} {expected}"
    )


def evaluate(
    expect: Expect,
    *,
    outcome: Outcome,
    metrics: Mapping[str, float | int | None],
    faults: Sequence[FaultRecord],
    digests: Mapping[int, str],
    baseline: Mapping[int, str] | None,
    events: Sequence[Event] | None = None,
    outputs: Mapping[str, Output] | None = None,
    baseline_outputs: Mapping[str, Output] | None = None,
    world: int | None = None,
    file_triggers: Mapping[int, str] | None = None,
) -> list[CheckResult]:
    """Every check ``expect`` asks for, in the registry's order (built-in checks, then the
    plug-ins' under ``expect.checks``). ``world``: the configured world size (for
    recovery's reason when not observed). ``file_triggers``: fault index -> its `at.when`,
    for the faults a file triggers."""
    run = Run(outcome=outcome, metrics=metrics, faults=faults, digests=digests,
              baseline=baseline, events=events or (), outputs=outputs or {},
              baseline_outputs=baseline_outputs, world=world, file_triggers=file_triggers or {})
    results: list[CheckResult] = []
    for check in check_registry.built_ins():
        asked = getattr(expect, check.field) if check.field else True
        if asked:
            results.extend(check_registry.run_one(check, asked, run))
    for name, asked in expect.checks.items():
        results.extend(check_registry.run_one(check_registry.plugin(name), asked, run))
    # A line a log probe gave up on, or lines read too late, leave a hole in the timeline:
    # the checks that read what such a line may have said are not observed.
    return unread(results, run.events)


# --------------------------------------------------------------------------- the declarations
# One per check, in the order a report lists them. `field` is the `expect:` key that asks
# for it (docs/metrics.md describes each); `evaluate` gets its value and the run.


def _completes(_: bool, run: Run) -> CheckResult:
    outcome = run.outcome
    if outcome.timed_out:
        return CheckResult("completes", False, "timed out", "exit 0",
                           f"still running after {outcome.duration_s:.1f}s; it was stopped")
    ok = outcome.exit_code == 0
    return CheckResult("completes", ok, f"exit {outcome.exit_code}", "exit 0",
                       "exited 0" if ok else f"exited with code {outcome.exit_code}")


def _faults_injected(_: bool, run: Run) -> list[CheckResult]:
    faults = run.faults
    if not faults:
        return []
    missed = [f for f in faults if f.injected_at_s is None]
    return [CheckResult(
        "faults_injected", not missed, f"{len(faults) - len(missed)}/{len(faults)}",
        f"{len(faults)}/{len(faults)}",
        "every fault was injected" if not missed else
        "never injected: " + "; ".join(f"{f.kind} at {f.target} ({f.detail})" for f in missed))]


def _skipped_steps(budget: CountBudget, run: Run) -> CheckResult:
    skipped = run.metrics.get("skipped_steps")
    limit = budget.max
    ok = isinstance(skipped, int) and skipped <= limit
    unseen = _nothing_after_the_fault(run.events)
    return CheckResult(
        "skipped_steps", ok and unseen is None, skipped, f"<= {limit}",
        "not observed: no world was seen committing two consecutive steps, so a gap "
        "cannot be told from sparse reporting" if skipped is None else
        unseen or f"{skipped} steps were jumped over (at most {limit})")


def _step_rate(floor_: RateFloor, run: Run) -> CheckResult:
    rate = _f(run.metrics.get("min_step_rate"))
    floor = floor_.min
    # A job that stopped at its fault (it exited, so its windows end at its last step,
    # before the fault) made progress only before it: no rate describes the fault.
    stopped = _nothing_after_the_fault(run.events)
    ok = rate is not None and rate >= floor and stopped is None
    return CheckResult(
        "step_rate", ok, None if rate is None else round(rate, 2), f">= {floor:g}/s",
        "too short to measure (needs 2 s of steps)" if rate is None else
        f"{stopped}, so the rate describes the run before the fault only"
        if stopped is not None else
        f"slowest 2 s window committed {rate:.2f} steps/s ({'at least' if ok else 'below'} "
        f"{floor:g})")


def _slurm_witness(_: bool, run: Run) -> CheckResult:
    from aftershock.harness.nodes.slurm_witness import slurm_witness

    return slurm_witness(run.events)


def _unsent(events: Sequence[Event]) -> str:
    """What a serving check says when no request was sent: why, where the load said."""
    not_ready = _metrics.load_not_ready(events)
    return "no request was sent" if not_ready is None else f"no request was sent: {not_ready}"


def _no_lost_requests(_: bool, run: Run) -> CheckResult:
    metrics = run.metrics
    lost, total = metrics.get("lost_requests"), metrics.get("requests")
    tokens, never_sent = metrics.get("lost_tokens"), metrics.get("unsent_requests")
    ok = lost == 0 and bool(total)
    return CheckResult(
        "no_lost_requests", ok, lost, 0,
        f"all {total} requests completed with every token" if ok else
        _unsent(run.events) if not total else
        f"{lost} of {total} requests did not complete ({tokens} tokens of those sent "
        "never arrived" + (f"; {never_sent} were never sent: the run ended before the "
                           "load generator sent them" if never_sent else "")
        + _why_lost(run.events) + ")")


def _no_duplicated_tokens(_: bool, run: Run) -> CheckResult:
    metrics = run.metrics
    dup = metrics.get("duplicated_tokens")
    unindexed = metrics.get("unindexed_requests") or 0
    went_on = _metrics.streamed_after_faults(run.events)
    ok = dup == 0 and bool(metrics.get("requests")) and not unindexed and went_on
    return CheckResult(
        "no_duplicated_tokens", ok, dup, 0,
        "no client received a token twice" if ok else
        _unsent(run.events) if not metrics.get("requests") else
        f"clients received {dup} tokens they already had" if dup else
        "not observed: no token arrived after the fault, and the load was not served "
        "whole before it, so no token could have been sent twice by a recovery"
        if not went_on else
        f"not observed: the chunks of {unindexed} of {metrics.get('requests')} requests "
        "carried no token_index, so a token sent twice could not be told from a new one "
        "(the server must send `token_index` per chunk)")


def _acknowledged_durable(_: bool, run: Run) -> CheckResult:
    from aftershock.harness.oracle.serving_journal import acknowledged_durable

    # The oracle stands apart from the harness and types its result loosely.
    result: CheckResult = acknowledged_durable(run.events)
    return result


def _latencies(latency: Latency, run: Run) -> list[CheckResult]:
    results = []
    for name in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        budget = getattr(latency, name)
        if budget is not None:
            results.append(_latency(name, run.metrics, budget.max.total_seconds()))
    return results


for _check in (
    Check("completes", "the system exits 0 within its timeout", _completes,
          field="completes"),
    Check("faults_injected", "every fault of the schedule was injected (always, with faults)",
          _faults_injected),
    Check("params_match", "final parameters bitwise equal to the fault-free run's (or the "
          "replay's)", lambda against, run: _params_match(run.digests, run.baseline, against),
          field="params_match"),
    Check("time_to_detect", "fault to the system's first failure_detected, within a budget",
          lambda budget, run: _time_to_detect(budget, _f(run.metrics.get("time_to_detect_s")),
                                              run.events, run.world),
          metric="time_to_detect_s", field="time_to_detect"),
    Check("time_to_recover", "fault to committed progress again, within a budget",
          lambda budget, run: _time_to_recover(_f(run.metrics.get("time_to_recover_s")),
                                               budget.max.total_seconds(), run.events,
                                               run.world),
          metric="time_to_recover_s", field="time_to_recover"),
    Check("lost_steps", "steps committed more than once, at most a budget",
          lambda budget, run: _lost_steps(run.metrics.get("lost_steps"), budget, run.events),
          metric="lost_steps", field="lost_steps"),
    Check("skipped_steps", "steps the history jumped over, at most a budget", _skipped_steps,
          metric="skipped_steps", field="skipped_steps"),
    Check("single_history", "no step committed by two worlds after the fault",
          lambda _, run: _single_history(run.metrics.get("forked_steps"), run.events),
          metric="forked_steps", field="single_history"),
    Check("step_rate", "the slowest 2 s of the run commits at least a floor of steps/s",
          _step_rate, metric="min_step_rate", field="step_rate"),
    Check("straggler_named", "the system names the slowed rank, and no other",
          lambda _, run: _straggler_named(run.events), field="straggler_named"),
    Check("xid_action", "each Xid answered with NVIDIA's recommended action, and taken",
          lambda _, run: _xid_action(run.events), field="xid_action"),
    Check("checkpoint_durable", "a resume from a checkpoint at least as new as the last "
          "saved before the fault, none rejected",
          lambda _, run: _checkpoint_durable(run.events), field="checkpoint_durable"),
    Check("faults_landed", "each file-triggered fault landed while its file was open",
          lambda _, run: _faults_landed(run.file_triggers, run.events),
          field="faults_landed"),
    Check("slurm_witness", "Slurm's own record agrees with the job's reports", _slurm_witness,
          field="slurm_witness"),
    Check("no_lost_requests", "every request sent completed with all its tokens",
          _no_lost_requests, metric="lost_requests", field="no_lost_requests"),
    Check("no_duplicated_tokens", "no client received a token index twice",
          _no_duplicated_tokens, metric="duplicated_tokens", field="no_duplicated_tokens"),
    Check("outputs_match", "every request's tokens and logits equal the fault-free run's",
          lambda _, run: _outputs_match(run.outputs, run.baseline_outputs),
          field="outputs_match"),
    Check("acknowledged_durable", "every token a client received is in the server's journal",
          _acknowledged_durable, field="acknowledged_durable"),
    Check("latency", "TTFT / TPOT percentiles (ttft_p50_s ... tpot_p99_s) within their "
          "budgets", _latencies, field="latency"),
):
    check_registry.built_in(_check)


def _latency(name: str, metrics: Mapping[str, float | int | None], limit_s: float
             ) -> CheckResult:
    """A latency percentile within its budget. Requests that never got a first token, or
    whose tokens stopped before they finished, count as waits longer than any budget
    (``metrics.serving``): where the percentile lands on one of them it is not a value, and
    the check fails saying how many there were."""
    first = name.startswith("ttft")
    what = ("time to first token" if first else "time between tokens") + f" ({name[-3:]})"
    result = _budget(f"latency.{name}", _f(metrics.get(f"{name}_s")), limit_s, what)
    missing = metrics.get("requests_without_first_token" if first else "requests_stalled")
    total = metrics.get("requests")
    if result.observed is not None or not missing:
        return result
    how = "never got a first token" if first else "stopped streaming before they finished"
    return CheckResult(result.name, False, "never", result.expected,
                       f"{what} is over any budget: {missing} of {total} requests {how}")


def _why_lost(events: Sequence[Event]) -> str:
    """What no_lost_requests adds about why requests were lost: the ones the server ended
    before ``max_tokens``, and the first error a client gave a request up for."""
    records = _metrics.requests(events)
    why = ""
    if early := _metrics.ended_early(records):
        reasons = " or ".join(sorted({repr(r.finish_reason) for r in early}))
        why += (f"; {len(early)} of them the server ended early, saying finish_reason "
                f"{reasons}: an end-of-sequence token or a stop string, or a recovery that cut "
                "them short, which the client cannot tell apart; make the server generate "
                "every token, e.g. `load: {extra_body: {ignore_eos: true}}` for vLLM or SGLang")
    if failed := [r for r in records if r.error]:
        why += f"; the first failed request, {failed[0].id}: {failed[0].error}"
    return why


def _snapshot_restores(events: Sequence[Event]) -> tuple[int | None, int]:
    """(the snapshot interval the job recorded, the restores from snapshots): the largest
    ``snapshot_every`` of its ``membership`` events (None: none recorded), and the
    generations that loaded a checkpoint (``checkpoint_loaded``, by its ``generation``; one
    that names none counts once for each step it loaded)."""
    interval: int | None = None
    restored: set[object] = set()
    for event in events:
        value = event.fields.get("snapshot_every")
        if event.event == contract.MEMBERSHIP and isinstance(value, int) \
                and not isinstance(value, bool) and value >= 1:
            interval = max(interval or value, value)
        elif event.event == contract.CHECKPOINT_LOADED:
            generation = event.fields.get("generation")
            restored.add(generation if generation is not None
                         else ("step", event.fields.get("step")))
    return interval, len(restored)


def _lost_steps(lost: float | int | None, budget: CountBudget,
                events: Sequence[Event]) -> CheckResult:
    """At most ``budget.max`` steps done twice (with ``snapshot_interval``: that many for
    each restore from snapshots, plus what the interval the run recorded leaves unsaved,
    the interval less one), counted only where there is something to count: a run that
    stopped at its last fault (no step after it, no final parameters) redid nothing because
    it never went on, and a PASS there would certify a recovery that never happened."""
    limit = budget.max
    expected = f"<= {limit}"
    if budget.snapshot_interval:
        interval, restores = _snapshot_restores(events)
        if interval is None:
            return CheckResult("lost_steps", False, lost, f"<= restores x ({limit} + "
                               "snapshot interval - 1)", "not observed: the run recorded no "
                               "snapshot interval (`snapshot_every` on a `membership` "
                               "event), so the steps a restore may lose are not known")
        # Each restore may lose what the budget allows and the steps since its snapshot.
        limit = max(limit, restores * (limit + interval - 1))
        expected = (f"<= {limit} ({restores} restore(s) from snapshots x ({budget.max} + "
                    f"interval {interval} - 1), at least {budget.max})")
    unseen = _nothing_after_the_fault(events)
    if unseen is not None:
        return CheckResult("lost_steps", False, lost, expected,
                           f"{unseen}, so no work done twice could be counted")
    ok = isinstance(lost, int) and lost <= limit
    return CheckResult("lost_steps", ok, lost, expected,
                       f"{lost} steps were committed more than once (recomputed, or by two "
                       f"worlds; at most {limit}), in {_metrics.step_unit(events)}")


def _time_to_detect(budget: DetectBudget, observed: float | None,
                    events: Sequence[Event], world: int | None = None) -> CheckResult:
    """The budget, and with ``cause``: the first detection must be by one of those causes
    (the fault was caught by the mechanism meant for it, not by a slower fallback). With
    several faults, each must be followed by a detection (its first ``failure_detected``
    at or after it) within the budget, by one of the causes, unless the system rode
    through it (``metrics.detections``); at least one must be detected. The slowest is
    shown."""
    found = _metrics.detections(events, world)
    if len(found) > 1:
        return _each_detected(budget, found)
    result = _budget("time_to_detect", observed, budget.max.total_seconds(), "detection")
    if budget.cause is None or observed is None:
        return result
    first = _metrics.detection(events)
    cause = str(first.fields.get("cause")) if first is not None else "nothing"
    wanted = " or ".join(budget.cause)
    expected = f"{result.expected} by {wanted}"
    shown = f"{format_duration(observed)} by {cause}"
    if not budget.admits(cause):
        return CheckResult("time_to_detect", False, shown, expected,
                           f"the fault was detected by {cause} after "
                           f"{format_duration(observed)}, not by {wanted}")
    return CheckResult("time_to_detect", result.passed, shown, expected,
                       f"{result.message}, by {cause}")


def _which_fault(found: Sequence[_metrics.FaultDetection], i: int) -> str:
    kind = found[i].fault.fields.get("kind")
    return f"fault {i + 1} of {len(found)}" + (f" ({kind})" if kind else "")


def _undetected(found: Sequence[_metrics.FaultDetection]) -> str | None:
    """Why detection of several faults is not observed, or None."""
    missing = [i for i, f in enumerate(found) if f.detected is None and not f.rode_through]
    if missing:
        return (f"not observed: {_which_fault(found, missing[0])} was never followed by a "
                "failure_detected, and the system did not ride through it")
    if all(f.detected is None for f in found):
        return "not observed: the system rode through every fault; nothing was detected"
    return None


def _each_detected(budget: DetectBudget, found: Sequence[_metrics.FaultDetection]
                   ) -> CheckResult:
    def which(i: int) -> str:
        return _which_fault(found, i)

    wanted = " or ".join(budget.cause) if budget.cause is not None else None
    expected = f"<= {format_duration(budget.max.total_seconds())}" + (
        f" by {wanted}" if wanted else "") + " after each fault"
    unseen = _undetected(found)
    if unseen is not None:
        return CheckResult("time_to_detect", False, None, expected, unseen)
    taken = [(f.detected.t - f.fault.t, i, str(f.detected.fields.get("cause")))
             for i, f in enumerate(found) if f.detected is not None]
    other = [(s, i, c) for s, i, c in taken if not budget.admits(c)]
    if other:
        seconds, i, cause = other[0]
        return CheckResult("time_to_detect", False,
                           f"{format_duration(seconds)} by {cause}", expected,
                           f"{which(i)} was detected by {cause} after "
                           f"{format_duration(seconds)}, not by {wanted}")
    seconds, i, cause = max(taken)
    rode = [j + 1 for j, f in enumerate(found) if f.rode_through]
    result = _budget("time_to_detect", seconds, budget.max.total_seconds(),
                     f"detection of {which(i)}, the slowest,")
    return CheckResult("time_to_detect", result.passed, result.observed, expected,
                       result.message + (f", by {cause}" if wanted else "")
                       + (f"; rode through fault {', '.join(map(str, rode))} without a "
                          "failure" if rode else ""))


def _time_to_recover(observed: float | None, limit_s: float, events: Sequence[Event] | None,
                     world: int | None) -> CheckResult:
    result = _budget("time_to_recover", observed, limit_s, "recovery")
    if events and _metrics.is_serving(events):  # judged from the clients' requests
        if observed is not None:
            return result
        why = _metrics.serving_unrecovered(events)
        return CheckResult(result.name, False, None, result.expected,
                           "recovery was not observed" + (f": {why}" if why else ""))
    found = _metrics.recovery(events, world) if events else None
    if observed is not None:
        if found is None or found.proof != _metrics.PROOF_WRITER_STARTED \
                or found.at_least is None:
            return result
        # Proven only as a bound: the budget is judged on the upper bound, and says so.
        return CheckResult(result.name, result.passed, result.observed, result.expected,
                           result.message.replace("took", "took at most", 1)
                           + f" (at least {format_duration(found.at_least)}; proof: "
                           f"{found.proof})")
    why = found.reason if found is not None else ""
    return CheckResult(result.name, False, None, result.expected,
                       "recovery was not observed" + (f": {why}" if why else ""))


def _nothing_after_the_fault(events: Sequence[Event]) -> str | None:
    """Why a check on what the run did after its fault has nothing to judge ("not observed:
    ..."), or None when the run went on after its last fault (``committed_after_faults``:
    a step committed after it, or the final parameters reported). A run that stopped at
    its fault redid nothing, skipped nothing and forked nothing; a PASS there would certify
    a recovery that never happened."""
    after = _metrics.committed_after_faults(events)
    if after is None:
        return "not observed: no step was committed"
    if not after:
        return ("not observed: no step was committed after the fault, and the run never "
                "reported its final parameters")
    return None


def _single_history(forked: float | int | None, events: Sequence[Event] | None
                    ) -> CheckResult:
    expected = "no step committed by two worlds after the fault"
    unseen = _no_second_history(forked, events or ())
    if unseen is not None:
        return CheckResult("single_history", False, unseen[0], expected, unseen[1])
    if forked == 0:
        return CheckResult("single_history", True, 0, expected,
                           "every step after the fault was committed by one history")
    found = _metrics.forks(events) if events else None
    detail = ""
    if found:
        names = sorted({str(w) for f in found for w in f.worlds})
        detail = (f": steps {found[0].step}..{found[-1].step} by generations "
                  f"{', '.join(names)}")
    return CheckResult("single_history", False, forked, expected,
                       f"split brain: {forked} steps were committed after the fault by two "
                       f"worlds that both went on{detail}")


def _no_second_history(forked: float | int | None, events: Sequence[Event]
                       ) -> tuple[int | None, str] | None:
    """Why single_history is not observed (what could not have split, or could not be
    seen splitting), with what it shows as observed; None when it is."""
    if forked is None:
        several = _metrics.one_launcher(events)
        steps_from_torchrun = any("attempt" in e.fields for e in events)
        why = f" ({several})" if several and steps_from_torchrun else ""
        return None, ("not observed: steps after the fault name no world (generation)"
                      f"{why}, so two worlds cannot be told apart; a framework preset "
                      "(`preset: torchft`) or a (?P<generation>...) group names it")
    if not any(e.event == contract.FAULT_INJECTED for e in events):
        return None, ("not observed: no fault was injected, so there was no failure "
                      "for two worlds to split at")
    if forked == 0 and (unseen := _nothing_after_the_fault(events)) is not None:
        return 0, f"{unseen}, so no second history could have formed"
    return None


def _outputs_match(outputs: Mapping[str, Output],
                   baseline: Mapping[str, Output] | None) -> CheckResult:
    """Every request's tokens, and the logits each was chosen from (by the server's digest),
    equal to the fault-free twin's. Greedy tokens rarely change when the numerics do (a
    re-prefill through a kernel that is not batch-invariant changed no token), so equal
    tokens alone prove little; a token whose digest either run lacks was not compared and
    fails the check as not observed."""
    expected = "tokens and logits identical to the fault-free run"
    if not baseline:
        return CheckResult("outputs_match", False, None, expected,
                           "the fault-free run produced no outputs to compare with")
    empty = Output((), ())
    ids = sorted(set(baseline) | set(outputs))
    tokens_differ: list[tuple[str, int]] = []  # (request, first token that differs)
    logits_differ: list[tuple[str, int]] = []  # same tokens, a digest differs
    unverified: list[tuple[str, int]] = []  # same tokens and known digests agree, some unknown
    for rid in ids:
        got, want = outputs.get(rid, empty), baseline.get(rid, empty)
        if got.tokens != want.tokens:
            tokens_differ.append((rid, _first_difference(got.tokens, want.tokens)))
            continue
        wrong, unknown = _digests_compared(got, want)
        if wrong:
            logits_differ.append((rid, wrong[0]))
        elif unknown:
            unverified.append((rid, len(unknown)))
    bad = len(tokens_differ) + len(logits_differ) + len(unverified)
    observed = f"{len(ids) - bad}/{len(ids)} requests identical"
    if not bad:
        return CheckResult("outputs_match", True, observed, expected,
                           f"all {len(ids)} requests identical to the fault-free run: every "
                           "token, and bitwise the logits it was chosen from")
    parts = []
    if tokens_differ:
        rid, at = tokens_differ[0]
        got, want = outputs.get(rid, empty), baseline.get(rid, empty)
        parts.append(f"{len(tokens_differ)} requests differ in their tokens; first {rid} at "
                     f"token {at} (got {len(got.tokens)} tokens, fault-free {len(want.tokens)})")
    if logits_differ:
        rid, at = logits_differ[0]
        parts.append(f"{len(logits_differ)} requests have the fault-free tokens but not its "
                     f"logits (the numerics changed); first {rid} at token {at}")
    if unverified:
        rid, count = unverified[0]
        parts.append(f"{len(unverified)} requests could not be compared bitwise: logits "
                     f"digests not observed (first {rid}, {count} tokens)")
    return CheckResult("outputs_match", False, observed, expected, "; ".join(parts))


def _digests_compared(got: Output, want: Output) -> tuple[list[int], list[int]]:
    """For two equal token lists: the tokens whose logits digests differ, and those whose
    digest either run lacks."""
    pairs = [(_at(got.digests, k), _at(want.digests, k)) for k in range(len(got.tokens))]
    wrong = [k for k, (a, b) in enumerate(pairs) if a is not None and b is not None and a != b]
    unknown = [k for k, (a, b) in enumerate(pairs) if a is None or b is None]
    return wrong, unknown


def _at(digests: Sequence[str | None], k: int) -> str | None:
    return digests[k] if k < len(digests) else None


def _first_difference(got: Sequence[int], want: Sequence[int]) -> int:
    return next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))


def _xid_action(events: Sequence[Event]) -> CheckResult:
    """Each injected Xid must be answered with NVIDIA's recommended action, by the process
    it hit, and that process must act on it (what it did, not only what it said):

    - action ``none``: it goes on working: it commits a step after its announcement (a
      system without steps: it does not exit while the run goes on);
    - any other action (restart_app, reset_gpu, drain_node) takes it off its GPU: it commits
      at most the one step in flight when it announced, and the harness sees it exit
      (``target_exited``) before the run ends. A restarted process is a new process.
    """
    from aftershock.faults.xid import CATALOG

    injected = [e for e in events if e.event == contract.FAULT_INJECTED
                and e.fields.get("kind") == "gpu.xid"]
    expected: list[str] = []
    observed: list[str] = []
    wrong: list[str] = []
    has_steps = any(e.event == contract.STEP for e in events)
    used: set[int] = set()  # each answer answers one Xid: two Xids need two
    for fault in injected:
        code = _xid_code(fault)
        want = str(CATALOG[code].action) if code is not None and code in CATALOG else "?"
        expected.append(f"{code}:{want}")
        seen, problems = _xid_answered(fault, code, want, events, used, has_steps)
        observed.append(seen)
        wrong.extend(problems)
    ok = bool(injected) and not wrong
    message = ("every Xid got NVIDIA's recommended action, and the process hit took it" if ok
               else "; ".join(wrong) or "no gpu.xid fault was injected")
    return CheckResult("xid_action", ok, ", ".join(observed) or None,
                       ", ".join(expected) or "an Xid", message)


def _xid_reply(fault: Event, code: int | None, events: Sequence[Event], used: set[int]
               ) -> Event | None:
    """The first ``xid_action`` answering ``fault`` not taken by another Xid (marked used)."""
    pid = fault.fields.get("pid")
    reply = next((a for a in events if a.event == contract.XID_ACTION and a.t >= fault.t
                  and id(a) not in used and a.fields.get("code") == code
                  and a.fields.get("pid") in (pid, None)), None)
    if reply is not None:
        used.add(id(reply))
    return reply


def _of_pid(events: Sequence[Event], kind: str, pid: object) -> list[Event]:
    return [e for e in events if e.event == kind and e.fields.get("pid") == pid]


def _xid_went_on(code: int | None, pid: object, steps: list[Event], exited: Event | None,
                 has_steps: bool) -> tuple[str, list[str]]:
    """Action ``none``: the process went on working (a step after its answer; a system
    without steps: no exit)."""
    kept_on = bool(steps) if has_steps else exited is None
    return f"{code}:none, {'went on' if kept_on else 'stopped'}", [] if kept_on else [
        f"Xid {code}: action none, but pid {pid} "
        + ("committed no step after it" if has_steps else "exited")]


def _xid_answered(fault: Event, code: int | None, want: str, events: Sequence[Event],
                  used: set[int], has_steps: bool) -> tuple[str, list[str]]:
    """What the process hit by one Xid said and did (for ``observed``), and what is wrong."""
    reply = _xid_reply(fault, code, events, used)
    got = str(reply.fields.get("action")) if reply else "none reported"
    if reply is None or got != want:
        return f"{code}:{got}", [f"Xid {code}: expected {want}, got {got}"]
    pid = fault.fields.get("pid")
    steps = [e for e in _of_pid(events, contract.STEP, pid) if e.t > reply.t]
    exited = next((e for e in _of_pid(events, contract.TARGET_EXITED, pid) if e.t >= fault.t),
                  None)
    if want == "none":
        return _xid_went_on(code, pid, steps, exited, has_steps)
    wrong = []
    if len(steps) > 1:
        wrong.append(f"Xid {code}: announced {got}, but pid {pid} committed "
                     f"{len(steps)} more steps")
    if exited is None:
        wrong.append(f"Xid {code}: announced {got}, but pid {pid} never exited while "
                     "the run went on (it kept its GPU)")
    return f"{code}:{got}, {'exited' if exited else 'still running'}", wrong


def _xid_code(event: Event) -> int | None:
    params = event.fields.get("params")
    code = params.get("code") if isinstance(params, dict) else None
    return code if isinstance(code, int) else None


def _landing_problem(index: int, when: str, found: Event | None) -> str | None:
    """What is wrong with how file-triggered fault ``index`` landed (``found``: its
    harness ``fault_injected``), or None: it landed inside the write."""
    if found is None:
        return f"fault {index} ({when}) was never injected: not observed"
    if found.fields.get("file_held") is True:
        return None  # the job's open of it waited in the kernel until the fault was in
    if "file_open" not in found.fields:
        return (f"fault {index} ({when}) has no record of its file at the fault's "
                "moment: not observed")
    state = describe_file_state(str(found.fields["file"]), found.fields)
    if not isinstance(found.fields["file_open"], bool):
        return f"fault {index} ({when}): {state}: not observed"
    if not found.fields["file_open"]:
        why = found.fields.get("file_held_why")
        return (f"fault {index} ({when}) missed its window: {state}, so the write "
                "was over before the fault landed (the writer outran the trigger; "
                "trigger earlier, e.g. `when: opened`, or on a slower save)"
                + (f"; the job was not held: {why}" if why else ""))
    return None


def _faults_landed(file_triggers: Mapping[int, str], events: Sequence[Event]) -> CheckResult:
    """Each fault a file's creation, opening or modification triggered landed inside that
    write: the job's open of it was held until the fault was in (``file_held``), or a
    process of the run still held the file open for writing at the fault's moment (the
    harness reads /proc just before sending it). A save that finished first is a miss;
    a fault never sent, or sent without that reading, proves nothing: not observed."""
    judged = sorted(i for i, when in file_triggers.items() if when in WINDOWED)
    first: dict[int, Event] = {}
    for ev in events:
        index = ev.fields.get("fault")
        if (ev.event == contract.FAULT_INJECTED and ev.source == "harness" and "file" in ev.fields
                and isinstance(index, int)):
            first.setdefault(index, ev)
    problems = [p for i in judged
                if (p := _landing_problem(i, file_triggers[i], first.get(i))) is not None]
    landed = len(judged) - len(problems)
    if not judged:
        return CheckResult("faults_landed", False, None, "in_window",
                           "not observed: no fault is triggered by a file being created, "
                           "opened or modified")
    return CheckResult(
        "faults_landed", not problems, f"{landed}/{len(judged)}", "in_window",
        "every file-triggered fault landed while its file was still open for writing: "
        + "; ".join(describe_file_state(str(first[i].fields["file"]), first[i].fields)
                    for i in judged)
        if not problems else "; ".join(problems))


def _checkpoint_durable(events: Sequence[Event]) -> CheckResult:
    """What the system called committed before the fault survives it, whole.

    The system's own reports are the evidence: the newest step it reported saved
    (``checkpoint_saved``) before the first fault, and every resume after the fault
    (``checkpoint_loaded``). Each resume must be from that step or a newer one. And the
    loader must not have had to reject anything on the way (``checkpoint_skipped``): after a
    crash or a power loss, a writer that publishes a checkpoint only once it is whole leaves
    nothing that looks like a checkpoint and is not; a rejection means it did, even when the
    loader's checksums then saved the day. Without a resume, or without a checkpoint saved
    before the fault, there is nothing to prove it with: the check fails as not observed.
    (``params_match`` cannot see a lost checkpoint: a deterministic trainer that resumes from
    an older one, or from scratch, still ends bitwise equal.)
    """
    name = "checkpoint_durable"
    fault = next((e for e in events if e.event == contract.FAULT_INJECTED), None)
    if fault is None:
        return CheckResult(name, False, None, "a fault", "not observed: no fault landed")
    saves = [(e.t, e.fields["step"]) for e in _with_step(events, contract.CHECKPOINT_SAVED)]
    saved = [(t, step) for t, step in saves if t < fault.t]
    if not saved:
        return CheckResult(name, False, None, "a checkpoint saved before the fault",
                           "not observed: the system reported no checkpoint saved before the "
                           "fault, so none had to survive it")
    loads = [e for e in _with_step(events, contract.CHECKPOINT_LOADED) if e.t > fault.t]
    if (redone := _saved_again(events, loads)) is not None:
        return redone
    if not loads:
        last = max(step for _, step in saved)
        return CheckResult(name, False, "no resume", f"resume from step >= {last}, none "
                           "rejected", "not observed: the system reported no "
                           "checkpoint_loaded after the fault (it started over, or never "
                           "restarted)")
    return _resumes_kept(events, fault, loads, saves)


def _saved_again(events: Sequence[Event], loads: Sequence[Event]) -> CheckResult | None:
    """A fault after which a rank reported saving a step it had itself reported saved before
    the fault, with no resume between (within the fault's window, up to the next fault): it
    trained that step again, so it did not resume from what it had saved. Any later resume
    (after another failure) may be from the new save, which proves nothing of the old one:
    a run that started over from nothing after a power loss, saved again and crashed again
    once resumed "from step 5" and passed. The same rank's own report, not any rank's: a
    peer's report of the same save may come (or be read) just after the fault."""
    saves = _with_step(events, contract.CHECKPOINT_SAVED)
    faults = sorted(e.t for e in events if e.event == contract.FAULT_INJECTED)
    for at, end in zip(faults, [*faults[1:], float("inf")], strict=True):
        before = {(e.rank, e.fields["step"]) for e in saves if e.t < at}
        resumed = min((e.t for e in loads if at < e.t < end), default=end)
        again = [e for e in saves if at < e.t < resumed and (e.rank, e.fields["step"]) in before]
        if again:
            return _trained_again(min(again, key=lambda e: e.t), at,
                                  max(step for _, step in before))
    return None


def _trained_again(save: Event, at: float, owed: int) -> CheckResult:
    """checkpoint_durable, failed by ``save``: a step saved again after the fault at ``at``
    before any resume, where ``owed`` was the newest step saved before it."""
    step, after = save.fields["step"], save.t - at
    who = f"rank {save.rank}" if save.rank is not None else "the system"
    observed = f"saved step {step} again"
    expected = f"resume from step >= {owed}, none rejected"
    if step < owed:
        return CheckResult(
            "checkpoint_durable", False, observed, expected,
            f"{after:.2f}s after the fault {who} saved step {step} again, before any resume: "
            f"it trained from older than step {owed}, which it had reported saved before the "
            "fault, so that checkpoint did not survive (it started over)")
    return CheckResult(
        "checkpoint_durable", False, observed, expected,
        f"not observed: {after:.2f}s after the fault {who} saved step {step} again before "
        "reporting any resume, so a later resume may be from that new save; nothing shows the "
        "one saved before the fault survived")


def _with_step(events: Sequence[Event], kind: str) -> list[Event]:
    return [e for e in events if e.event == kind and isinstance(e.fields.get("step"), int)]


def _owed(t: float, faults: Sequence[float], saves: Sequence[tuple[float, int]]
          ) -> tuple[float, int, float]:
    """What a resume at ``t`` must keep: the newest checkpoint saved before the last fault
    before it (its time, its step), and that fault's time."""
    before = max(f for f in faults if f < t)
    when, step = max(((w, s) for w, s in saves if w < before), key=lambda item: item[1])
    return when, step, before


def _resumes_kept(events: Sequence[Event], fault: Event, loads: Sequence[Event],
                  saves: Sequence[tuple[float, int]]) -> CheckResult:
    """checkpoint_durable, once there are resumes after the fault to judge."""
    name = "checkpoint_durable"
    faults = [e.t for e in events if e.event == contract.FAULT_INJECTED]
    # Each resume against the fault it followed: what was saved before a second fault must
    # survive that one too, not only what was saved before the first.
    short = [(e, *_owed(e.t, faults, saves)) for e in loads
             if e.fields["step"] < _owed(e.t, faults, saves)[1]]
    last = max(_owed(e.t, faults, saves)[1] for e in loads)
    expected = f"resume from step >= {last}, none rejected"
    oldest = min(loads, key=lambda e: e.fields["step"])
    step = oldest.fields["step"]
    if short:
        load, saved_t, owed_step, before = min(short, key=lambda item: item[0].fields["step"])
        who = f"rank {load.rank}" if load.rank is not None else load.source
        return CheckResult(
            name, False, f"resumed from step {load.fields['step']}",
            f"resume from step >= {owed_step}, none rejected",
            f"{who} resumed from step {load.fields['step']}, older than step {owed_step}, "
            f"which the system reported saved {before - saved_t:.2f}s before the fault: a "
            "checkpoint it called committed did not survive")
    rejected = [e for e in events if e.event == contract.CHECKPOINT_SKIPPED and e.t > fault.t]
    if rejected:
        first = rejected[0]
        by = f"rank {first.rank}" if first.rank is not None else first.source
        return CheckResult(
            name, False, f"{len(rejected)} rejected", expected,
            f"{by} had to reject {first.fields.get('path')} ({first.fields.get('reason')}): "
            "the writer left a checkpoint behind that was not whole")
    which = "the newest saved before the fault it followed" if len(faults) > 1 else \
        "the newest saved before the fault"
    return CheckResult(name, True, f"resumed from step {step}", expected,
                       f"resumed from step {step} ({which}: {last}), none rejected")


def _slowed(events: Sequence[Event]) -> dict[int, float]:
    """Rank -> when a ``process.straggle`` fault first slowed it."""
    slowed: dict[int, float] = {}
    for e in events:
        if e.event == contract.FAULT_INJECTED and e.fields.get("kind") == "process.straggle":
            listed = e.fields.get("ranks")
            group = listed if isinstance(listed, list) else [e.fields.get("rank")]
            for rank in group:
                if isinstance(rank, int):
                    slowed.setdefault(rank, e.t)
    return slowed


def _named_slow(events: Sequence[Event]) -> dict[int, list[float]]:
    """Rank -> when the system named it the straggler (``straggler_detected``)."""
    named: dict[int, list[float]] = {}
    for e in events:
        rank = e.fields.get("slow_rank")
        if e.event == contract.STRAGGLER_DETECTED and isinstance(rank, int):
            named.setdefault(rank, []).append(e.t)
    return named


def _misnamed(slowed: Mapping[int, float], named: Mapping[int, list[float]]) -> list[str]:
    """What straggler_named finds wrong: slowed ranks never named, or named only before
    they were slowed, and ranks named that were not slowed."""
    wrong = []
    unnamed = [r for r in sorted(slowed) if r not in named]
    early = [r for r in sorted(slowed) if r in named and max(named[r]) < slowed[r]]
    if unnamed:
        wrong.append("no straggler_detected event named " + _metrics.ranks_text(unnamed))
    if early:
        wrong.append(f"{_metrics.ranks_text(early)} named only before it was slowed")
    if others := sorted(set(named) - set(slowed)):
        wrong.append(f"the system also named {_metrics.ranks_text(others)}, which "
                     + ("was" if len(others) == 1 else "were") + " not slowed")
    return wrong


def _straggler_named(events: Sequence[Event]) -> CheckResult:
    """Every slowed rank named as the straggler (``straggler_detected``) after it was
    slowed, and no rank named that was not: a naming before the slowdown proves nothing
    about it, and a system that names every rank singles out none."""
    slowed, named = _slowed(events), _named_slow(events)
    shown = ", ".join(f"rank {r}" for r in sorted(named)) or None
    expected = ", ".join(f"rank {r}" for r in sorted(slowed)) or "a straggled rank"
    if not slowed:
        return CheckResult("straggler_named", False, shown, expected,
                           "not observed: no process.straggle fault was injected")
    wrong = _misnamed(slowed, named)
    return CheckResult("straggler_named", not wrong, shown, expected,
                       "; ".join(wrong) or "the system named the slowed rank, after it was "
                       "slowed, and no other")


def _f(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def _params_match(
    digests: Mapping[int, str], baseline: Mapping[int, str] | None, against: str = "fault_free"
) -> CheckResult:
    reference = ("the fault-free run" if against == "fault_free" else
                 "the independent replay of the membership log")
    expected = f"bitwise equal to {reference}"
    if baseline is None or not baseline:
        return CheckResult("params_match", False, None, expected,
                           f"{reference} reported no parameters to compare with")
    if not digests:
        return CheckResult("params_match", False, None, expected,
                           "the run reported no final parameters")
    missing = sorted(set(baseline) - set(digests))
    if missing:
        # Only the final world's digests count (metrics.final_digests): a rank of it that
        # never reported leaves nothing to compare, whatever the others say.
        reported = len(baseline) - len(missing)
        return CheckResult("params_match", False, f"{reported}/{len(baseline)} ranks reported",
                           expected, "the final world reported no parameters from "
                           + ", ".join(f"rank {r}" for r in missing))
    ranks = sorted(set(baseline) | set(digests))
    differ = [r for r in ranks if digests.get(r) != baseline.get(r)]
    observed = f"{len(ranks) - len(differ)}/{len(ranks)} ranks equal"
    if differ:
        detail = ", ".join(
            f"rank {r}: {_short(digests.get(r))} != {_short(baseline.get(r))}" for r in differ
        )
        return CheckResult("params_match", False, observed, expected,
                           f"parameters differ: {detail}")
    return CheckResult("params_match", True, observed, expected,
                       f"all {len(ranks)} ranks bitwise equal to {reference}")


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "missing"
