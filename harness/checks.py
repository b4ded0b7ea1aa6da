"""Checks: each `expect:` entry of a scenario, evaluated over the run's timeline.

A check never raises for a bad run; it returns a failed CheckResult that says
what was observed against what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aftershock.harness import metrics as _metrics
from aftershock.harness._duration import format_duration
from aftershock.harness.logprobe import unread
from aftershock.harness.metrics import Output
from aftershock.harness.records import CheckResult, Event, FaultRecord
from aftershock.harness.spec import WINDOWED, CountBudget, DetectBudget, Expect
from aftershock.harness.triggers import describe_file_state


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the system under test ended, as the harness saw it."""

    exit_code: int | None
    timed_out: bool
    duration_s: float


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
    """``world``: the configured world size (for recovery's reason when not observed).
    ``file_triggers``: fault index -> its `at.when`, for the faults a file triggers."""
    results: list[CheckResult] = []
    if expect.completes:
        if outcome.timed_out:
            results.append(
                CheckResult("completes", False, "timed out", "exit 0",
                            f"still running after {outcome.duration_s:.1f}s; it was stopped")
            )
        else:
            ok = outcome.exit_code == 0
            results.append(
                CheckResult("completes", ok, f"exit {outcome.exit_code}", "exit 0",
                            "exited 0" if ok else f"exited with code {outcome.exit_code}")
            )
    if faults:
        missed = [f for f in faults if f.injected_at_s is None]
        results.append(
            CheckResult(
                "faults_injected",
                not missed,
                f"{len(faults) - len(missed)}/{len(faults)}",
                f"{len(faults)}/{len(faults)}",
                "every fault was injected" if not missed else
                "never injected: " + "; ".join(f"{f.kind} at {f.target} ({f.detail})"
                                               for f in missed),
            )
        )
    if expect.params_match:
        results.append(_params_match(digests, baseline, expect.params_match))
    if expect.time_to_detect:
        results.append(_time_to_detect(expect.time_to_detect, _f(metrics.get("time_to_detect_s")),
                                       events or (), world))
    if expect.time_to_recover:
        results.append(_time_to_recover(_f(metrics.get("time_to_recover_s")),
                                        expect.time_to_recover.max.total_seconds(),
                                        events, world))
    if expect.lost_steps:
        results.append(_lost_steps(metrics.get("lost_steps"), expect.lost_steps,
                                   events or ()))
    if expect.skipped_steps:
        skipped = metrics.get("skipped_steps")
        limit = expect.skipped_steps.max
        ok = isinstance(skipped, int) and skipped <= limit
        unseen = _nothing_after_the_fault(events or ())
        results.append(CheckResult(
            "skipped_steps", ok and unseen is None, skipped, f"<= {limit}",
            "not observed: no world was seen committing two consecutive steps, so a gap "
            "cannot be told from sparse reporting" if skipped is None else
            unseen or f"{skipped} steps were jumped over (at most {limit})"))
    if expect.single_history:
        results.append(_single_history(metrics.get("forked_steps"), events))
    if expect.step_rate:
        rate = _f(metrics.get("min_step_rate"))
        floor = expect.step_rate.min
        # A job that stopped at its fault (it exited, so its windows end at its last step,
        # before the fault) made progress only before it: no rate describes the fault.
        stopped = _nothing_after_the_fault(events or ())
        ok = rate is not None and rate >= floor and stopped is None
        results.append(CheckResult(
            "step_rate", ok, None if rate is None else round(rate, 2), f">= {floor:g}/s",
            "too short to measure (needs 2 s of steps)" if rate is None else
            f"{stopped}, so the rate describes the run before the fault only"
            if stopped is not None else
            f"slowest 2 s window committed {rate:.2f} steps/s ({'at least' if ok else 'below'} "
            f"{floor:g})"))
    if expect.straggler_named:
        results.append(_straggler_named(events or ()))
    if expect.xid_action:
        results.append(_xid_action(events or ()))
    if expect.checkpoint_durable:
        results.append(_checkpoint_durable(events or ()))
    if expect.faults_landed:
        results.append(_faults_landed(file_triggers or {}, events or ()))
    if expect.slurm_witness:
        from aftershock.harness.nodes.slurm_witness import slurm_witness

        results.append(slurm_witness(events or ()))
    unsent = "no request was sent"
    if (not_ready := _metrics.load_not_ready(events or ())) is not None:
        unsent = f"no request was sent: {not_ready}"
    if expect.no_lost_requests:
        lost, total = metrics.get("lost_requests"), metrics.get("requests")
        tokens, never_sent = metrics.get("lost_tokens"), metrics.get("unsent_requests")
        ok = lost == 0 and bool(total)
        results.append(CheckResult(
            "no_lost_requests", ok, lost, 0,
            f"all {total} requests completed with every token" if ok else
            unsent if not total else
            f"{lost} of {total} requests did not complete ({tokens} tokens of those sent "
            "never arrived" + (f"; {never_sent} were never sent: the run ended before the "
                               "load generator sent them" if never_sent else "")
            + _why_lost(events or ()) + ")"))
    if expect.no_duplicated_tokens:
        dup = metrics.get("duplicated_tokens")
        unindexed = metrics.get("unindexed_requests") or 0
        went_on = _metrics.streamed_after_faults(events or ())
        ok = dup == 0 and bool(metrics.get("requests")) and not unindexed and went_on
        results.append(CheckResult(
            "no_duplicated_tokens", ok, dup, 0,
            "no client received a token twice" if ok else
            unsent if not metrics.get("requests") else
            f"clients received {dup} tokens they already had" if dup else
            "not observed: no token arrived after the fault, and the load was not served "
            "whole before it, so no token could have been sent twice by a recovery"
            if not went_on else
            f"not observed: the chunks of {unindexed} of {metrics.get('requests')} requests "
            "carried no token_index, so a token sent twice could not be told from a new one "
            "(the server must send `token_index` per chunk)"))
    if expect.outputs_match:
        results.append(_outputs_match(outputs or {}, baseline_outputs))
    if expect.acknowledged_durable:
        from aftershock.harness.oracle.serving_journal import acknowledged_durable

        results.append(acknowledged_durable(events or ()))
    if expect.latency:
        for name in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
            budget = getattr(expect.latency, name)
            if budget is not None:
                results.append(_latency(name, metrics, budget.max.total_seconds()))
    # A line a log probe gave up on, or lines read too late, leave a hole in the timeline:
    # the checks that read what such a line may have said are not observed.
    return unread(results, events or ())


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
        if event.event == "membership" and isinstance(value, int) \
                and not isinstance(value, bool) and value >= 1:
            interval = max(interval or value, value)
        elif event.event == "checkpoint_loaded":
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


def _each_detected(budget: DetectBudget, found: Sequence[_metrics.FaultDetection]
                   ) -> CheckResult:
    n = len(found)

    def which(i: int) -> str:
        kind = found[i].fault.fields.get("kind")
        return f"fault {i + 1} of {n}" + (f" ({kind})" if kind else "")

    wanted = " or ".join(budget.cause) if budget.cause is not None else None
    expected = f"<= {format_duration(budget.max.total_seconds())}" + (
        f" by {wanted}" if wanted else "") + " after each fault"
    missing = [i for i, f in enumerate(found) if f.detected is None and not f.rode_through]
    if missing:
        return CheckResult("time_to_detect", False, None, expected,
                           f"not observed: {which(missing[0])} was never followed by a "
                           "failure_detected, and the system did not ride through it")
    taken = [(f.detected.t - f.fault.t, i, str(f.detected.fields.get("cause")))
             for i, f in enumerate(found) if f.detected is not None]
    if not taken:
        return CheckResult("time_to_detect", False, None, expected,
                           "not observed: the system rode through every fault; nothing was "
                           "detected")
    if budget.cause is not None:
        for seconds, i, cause in taken:
            if not budget.admits(cause):
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
    if forked is None:
        several = _metrics.one_launcher(events or ())
        steps_from_torchrun = any("attempt" in e.fields for e in events or ())
        why = f" ({several})" if several and steps_from_torchrun else ""
        return CheckResult("single_history", False, None, expected,
                           "not observed: steps after the fault name no world (generation)"
                           f"{why}, so two worlds cannot be told apart; a framework preset "
                           "(`preset: torchft`) or a (?P<generation>...) group names it")
    if not any(e.event == "fault_injected" for e in events or ()):
        return CheckResult("single_history", False, None, expected,
                           "not observed: no fault was injected, so there was no failure "
                           "for two worlds to split at")
    if forked == 0 and (unseen := _nothing_after_the_fault(events or ())) is not None:
        return CheckResult("single_history", False, 0, expected,
                           f"{unseen}, so no second history could have formed")
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
        pairs = [(_at(got.digests, k), _at(want.digests, k)) for k in range(len(got.tokens))]
        wrong = [k for k, (a, b) in enumerate(pairs) if a is not None and b is not None
                 and a != b]
        unknown = [k for k, (a, b) in enumerate(pairs) if a is None or b is None]
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

    injected = [e for e in events if e.event == "fault_injected" and e.fields.get("kind")
                == "gpu.xid"]
    expected, observed, wrong = [], [], []
    has_steps = any(e.event == "step" for e in events)
    used: set[int] = set()  # each answer answers one Xid: two Xids need two
    for fault in injected:
        code = _xid_code(fault)
        want = str(CATALOG[code].action) if code is not None and code in CATALOG else "?"
        expected.append(f"{code}:{want}")
        pid = fault.fields.get("pid")
        reply = next((a for a in events if a.event == "xid_action" and a.t >= fault.t
                      and id(a) not in used and a.fields.get("code") == code
                      and a.fields.get("pid") in (pid, None)), None)
        if reply is not None:
            used.add(id(reply))
        got = str(reply.fields.get("action")) if reply else "none reported"
        if reply is None or got != want:
            observed.append(f"{code}:{got}")
            wrong.append(f"Xid {code}: expected {want}, got {got}")
            continue
        steps = [e for e in events if e.event == "step" and e.t > reply.t
                 and e.fields.get("pid") == pid]
        exited = next((e for e in events if e.event == "target_exited" and e.t >= fault.t
                       and e.fields.get("pid") == pid), None)
        if want == "none":
            kept_on = bool(steps) if has_steps else exited is None
            observed.append(f"{code}:{got}, {'went on' if kept_on else 'stopped'}")
            if not kept_on:
                wrong.append(f"Xid {code}: action none, but pid {pid} " + (
                    "committed no step after it" if has_steps else "exited"))
            continue
        observed.append(f"{code}:{got}, {'exited' if exited else 'still running'}")
        if len(steps) > 1:
            wrong.append(f"Xid {code}: announced {got}, but pid {pid} committed "
                         f"{len(steps)} more steps")
        if exited is None:
            wrong.append(f"Xid {code}: announced {got}, but pid {pid} never exited while "
                         "the run went on (it kept its GPU)")
    ok = bool(injected) and not wrong
    message = ("every Xid got NVIDIA's recommended action, and the process hit took it" if ok
               else "; ".join(wrong) or "no gpu.xid fault was injected")
    return CheckResult("xid_action", ok, ", ".join(observed) or None,
                       ", ".join(expected) or "an Xid", message)


def _xid_code(event: Event) -> int | None:
    params = event.fields.get("params")
    code = params.get("code") if isinstance(params, dict) else None
    return code if isinstance(code, int) else None


def _faults_landed(file_triggers: Mapping[int, str], events: Sequence[Event]) -> CheckResult:
    """Each fault a file's creation, opening or modification triggered landed inside that
    write: a process of the run still held the file open for writing at the fault's moment
    (the harness reads /proc just before sending it). A save that finished first is a miss;
    a fault never sent, or sent without that reading, proves nothing: not observed."""
    judged = sorted(i for i, when in file_triggers.items() if when in WINDOWED)
    first: dict[int, Event] = {}
    for ev in events:
        index = ev.fields.get("fault")
        if (ev.event == "fault_injected" and ev.source == "harness" and "file" in ev.fields
                and isinstance(index, int)):
            first.setdefault(index, ev)
    problems: list[str] = []
    for index in judged:
        found = first.get(index)
        when = file_triggers[index]
        if found is None:
            problems.append(f"fault {index} ({when}) was never injected: not observed")
        elif "file_open" not in found.fields:
            problems.append(f"fault {index} ({when}) has no record of its file at the fault's "
                            "moment: not observed")
        elif not isinstance(found.fields["file_open"], bool):
            state = describe_file_state(str(found.fields["file"]), found.fields)
            problems.append(f"fault {index} ({when}): {state}: not observed")
        elif not found.fields["file_open"]:
            state = describe_file_state(str(found.fields["file"]), found.fields)
            problems.append(f"fault {index} ({when}) missed its window: {state}, so the write "
                            "was over before the fault landed (the writer outran the trigger; "
                            "trigger earlier, e.g. `when: opened`, or on a slower save)")
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
    fault = next((e for e in events if e.event == "fault_injected"), None)
    if fault is None:
        return CheckResult(name, False, None, "a fault", "not observed: no fault landed")
    saved = [(e.t, e.fields["step"]) for e in events if e.event == "checkpoint_saved"
             and e.t < fault.t and isinstance(e.fields.get("step"), int)]
    if not saved:
        return CheckResult(name, False, None, "a checkpoint saved before the fault",
                           "not observed: the system reported no checkpoint saved before the "
                           "fault, so none had to survive it")
    faults = [e.t for e in events if e.event == "fault_injected"]
    saves = [(e.t, e.fields["step"]) for e in events if e.event == "checkpoint_saved"
             and isinstance(e.fields.get("step"), int)]

    def owed(t: float) -> tuple[float, int, float]:
        """What a resume at ``t`` must keep: the newest checkpoint saved before the last
        fault before it (its time, its step), and that fault's time."""
        before = max(f for f in faults if f < t)
        when, step = max(((w, s) for w, s in saves if w < before), key=lambda item: item[1])
        return when, step, before

    loads = [e for e in events if e.event == "checkpoint_loaded" and e.t > fault.t
             and isinstance(e.fields.get("step"), int)]
    last = max(step for _, step in saved)
    if not loads:
        return CheckResult(name, False, "no resume", f"resume from step >= {last}, none "
                           "rejected", "not observed: the system reported no "
                           "checkpoint_loaded after the fault (it started over, or never "
                           "restarted)")
    # Each resume against the fault it followed: what was saved before a second fault must
    # survive that one too, not only what was saved before the first.
    short = [(e, *owed(e.t)) for e in loads if e.fields["step"] < owed(e.t)[1]]
    last = max(owed(e.t)[1] for e in loads)
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
    rejected = [e for e in events if e.event == "checkpoint_skipped" and e.t > fault.t]
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


def _straggler_named(events: Sequence[Event]) -> CheckResult:
    """Every slowed rank named as the straggler (``straggler_detected``) after it was
    slowed, and no rank named that was not: a naming before the slowdown proves nothing
    about it, and a system that names every rank singles out none."""
    slowed: dict[int, float] = {}  # rank -> when it was first slowed
    for e in events:
        if e.event == "fault_injected" and e.fields.get("kind") == "process.straggle":
            listed = e.fields.get("ranks")
            group = listed if isinstance(listed, list) else [e.fields.get("rank")]
            for rank in group:
                if isinstance(rank, int):
                    slowed.setdefault(rank, e.t)
    named: dict[int, list[float]] = {}
    for e in events:
        rank = e.fields.get("slow_rank")
        if e.event == "straggler_detected" and isinstance(rank, int):
            named.setdefault(rank, []).append(e.t)
    shown = ", ".join(f"rank {r}" for r in sorted(named)) or None
    expected = ", ".join(f"rank {r}" for r in sorted(slowed)) or "a straggled rank"
    if not slowed:
        return CheckResult("straggler_named", False, shown, expected,
                           "not observed: no process.straggle fault was injected")
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
