"""A run as a Chrome trace-event file, for Perfetto's UI (ui.perfetto.dev) or chrome://tracing.

One track (trace "process") per process of the run, named after what it said it is
(``rank 1``, ``controller``, ``worker 0``), plus the harness, the faults and the
load generator; each step a rank committed is a slice; each fault a span from its
injection to its heal; detection and recovery are instant events across the whole
trace, named with the metric values. Format: the Trace Event Format's JSON object
form (``traceEvents``, ``displayTimeUnit``); timestamps in microseconds on the run's
monotonic clock, or on the wall clock (``clock="wall"``) to line up with other logs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aftershock.harness.errors import SpecError
from aftershock.harness.run.records import Event
from aftershock.harness.run.rundir import RecordedRun
from aftershock.harness.verdict import metrics as _metrics

#: Above Linux's largest pid (4194304), so a made-up track never takes a real process's id.
_SYNTHETIC = 4_194_305
HARNESS, FAULTS, CLIENT, LOGS = range(_SYNTHETIC, _SYNTHETIC + 4)
#: Between runs in one file: their pids are shifted apart so their tracks stay apart.
_RUN_STRIDE = 5_000_000

#: Events that are instants on their process's track.
_INSTANTS = {
    "hello", "failure_detected", "recovery_done", "checkpoint_saved", "checkpoint_loaded",
    "checkpoint_skipped", "checkpoint_failed", "checkpoint_started", "membership", "exit",
    "params", "xid_action", "straggler_detected", "worker_started", "serving_ready",
    "request_migrated", "fault_armed", "fault_failed", "launch", "timeout", "run_end",
    "load_started", "load_finished",
}


def trace_events(run: RecordedRun, *, clock: str = "run", offset_pid: int = 0,
                 label: str | None = None) -> list[dict[str, Any]]:
    """The trace events of one recorded run (``clock``: ``run`` monotonic, ``wall``)."""
    shift = 0.0
    if clock == "wall":
        if run.wall_offset is None:
            raise SpecError([f"{run.path}:1:1: the run recorded no wall-clock offset (its "
                             "launch event predates it); use the run's own clock"])
        shift = run.wall_offset

    def ts(t: float) -> float:
        return round((t + shift) * 1e6, 1)

    name = label or run.result.name
    out: list[dict[str, Any]] = []
    names: dict[int, tuple[str, int]] = {
        HARNESS: (f"{name}: harness", 0), FAULTS: (f"{name}: faults", 1),
    }
    events = run.events
    for e in events:
        pid = _pid_of(e)
        if pid == CLIENT:
            names.setdefault(CLIENT, (f"{name}: load generator", 2))
        elif pid == LOGS:
            names.setdefault(LOGS, (f"{name}: log probes", 3))
        elif pid not in names or e.event == "hello":
            names[pid] = (_process_name(name, e, pid), _sort_key(e))
    out.extend(_step_slices(events, ts))
    for e in events:
        if e.event in _INSTANTS:
            out.append({"ph": "i", "s": "t", "name": e.event, "cat": e.event, "pid": _pid_of(e),
                        "tid": e.rank if e.rank is not None else 0, "ts": ts(e.t),
                        "args": _args(e)})
    out.extend(_fault_spans(events, ts))
    out.extend(_metric_instants(run, ts))
    out.extend(_requests(events, ts))
    for pid, (title, order) in names.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": title}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": order}})
    if offset_pid:
        for item in out:
            item["pid"] = item["pid"] + offset_pid
    return out


def _pid_of(e: Event) -> int:
    """The trace's process row of an event: the harness's, the load generator's, the
    process's own, or the log probes'."""
    pid = e.fields.get("pid")
    if e.source == "harness":
        return HARNESS
    if e.source == "client":
        return CLIENT
    if isinstance(pid, int) and 0 < pid < _SYNTHETIC:
        return pid
    return LOGS


def _step_slices(events: Sequence[Event], ts: Callable[[float], float]
                 ) -> list[dict[str, Any]]:
    """A slice per committed step, from the rank's previous report to this one."""
    out: list[dict[str, Any]] = []
    last: dict[tuple[int, int], float] = {}
    for e in events:
        step = e.fields.get("step")
        if e.event != "step" or not isinstance(step, int):
            continue
        pid = _pid_of(e)
        key = (pid, e.rank if e.rank is not None else 0)
        start = last.get(key, e.t)
        last[key] = e.t
        out.append({"ph": "X", "name": f"step {step}", "cat": "step", "pid": pid, "tid": key[1],
                    "ts": ts(start), "dur": round((e.t - start) * 1e6, 1),
                    "args": _args(e)})
    return out


def _process_name(run: str, e: Event, pid: int) -> str:
    role = e.fields.get("role")
    if e.rank is not None:
        what = f"rank {e.rank}"
    elif isinstance(e.fields.get("worker"), int) and e.event in ("hello", "worker_started"):
        what = f"worker {e.fields['worker']}"
    elif isinstance(role, str):
        what = role
    else:
        what = e.source
    return f"{run}: {what} (pid {pid})"


def _sort_key(e: Event) -> int:
    return 10 + (e.rank if e.rank is not None else 1000)


def _args(e: Event) -> dict[str, Any]:
    shown: dict[str, Any] = {}
    for key, value in e.fields.items():
        if key in ("tensors", "tokens", "times"):
            continue  # bulky, and in events.jsonl for whoever needs them
        text = value if isinstance(value, int | float | bool) or value is None else str(value)
        shown[key] = text[:500] if isinstance(text, str) else text
    shown["source"] = e.source
    return shown


def _fault_spans(events: Sequence[Event], ts: Any) -> list[dict[str, Any]]:
    """Each injected fault a span on the faults track, from its injection to its heal (or,
    for a fault nothing undoes, such as a kill, to the end of the run), plus a global
    instant at the moment it landed."""
    end = events[-1].t if events else 0.0
    healed = [e for e in events if e.event == "fault_healed"]
    out: list[dict[str, Any]] = []
    for index, e in enumerate(e for e in events if e.event == "fault_injected"):
        kind = str(e.fields.get("kind"))
        heal = next((h for h in healed if h.t >= e.t and h.fields.get("kind") == kind), None)
        if heal is not None:
            healed.remove(heal)
        stop = heal.t if heal is not None else end
        where = f"rank {e.rank}" if e.rank is not None else str(e.fields.get("role", ""))
        title = f"{kind} -> {where}".strip()
        args = {**_args(e), "healed": heal is not None}
        out.append({"ph": "X", "name": title, "cat": "fault", "pid": FAULTS, "tid": index,
                    "ts": ts(e.t), "dur": round((stop - e.t) * 1e6, 1), "args": args})
        out.append({"ph": "i", "s": "g", "name": f"FAULT {title}", "cat": "fault",
                    "pid": FAULTS, "tid": index, "ts": ts(e.t), "args": args})
    return out


def _metric_instants(run: RecordedRun, ts: Any) -> list[dict[str, Any]]:
    """Detection and recovery, where the run's metrics put them (fault + the metric)."""
    fault = _metrics.first_fault_time(run.events)
    if fault is None:
        return []
    out = []
    for metric, what in (("time_to_detect_s", "detected"), ("time_to_recover_s", "recovered")):
        value = run.result.metrics.get(metric)
        if isinstance(value, int | float):
            out.append({"ph": "i", "s": "g", "name": f"{what} (+{value * 1000:.0f} ms)",
                        "cat": "metric", "pid": HARNESS, "tid": 0, "ts": ts(fault + value),
                        "args": {metric: value}})
    return out


def _requests(events: Sequence[Event], ts: Any) -> list[dict[str, Any]]:
    """Serving: each request its own row on the load generator's track: queued (sent to
    first token), then streaming (first token to its last)."""
    out: list[dict[str, Any]] = []
    records = _metrics.requests(events)
    migrated = [e for e in events if e.event == "request_migrated"]
    for tid, r in enumerate(records, start=1):
        out.append({"ph": "M", "name": "thread_name", "pid": CLIENT, "tid": tid,
                    "args": {"name": r.id}})
        end = r.times[-1] if r.times else r.sent
        state = "done" if r.done and len(r.tokens) >= r.max_tokens else "LOST"
        out.append({"ph": "X", "name": f"{r.id} ({state})", "cat": "request", "pid": CLIENT,
                    "tid": tid, "ts": ts(r.sent), "dur": round((end - r.sent) * 1e6, 1),
                    "args": {"tokens": len(r.tokens), "max_tokens": r.max_tokens,
                             "duplicates": r.duplicates}})
        if r.times:
            out.append({"ph": "X", "name": "queued", "cat": "request", "pid": CLIENT,
                        "tid": tid, "ts": ts(r.sent),
                        "dur": round((r.times[0] - r.sent) * 1e6, 1), "args": {}})
            out.append({"ph": "X", "name": "streaming", "cat": "request", "pid": CLIENT,
                        "tid": tid, "ts": ts(r.times[0]),
                        "dur": round((end - r.times[0]) * 1e6, 1), "args": {}})
        for m in migrated:
            if m.fields.get("request_id") == r.id:
                out.append({"ph": "i", "s": "t", "name": "migrated", "cat": "request",
                            "pid": CLIENT, "tid": tid, "ts": ts(m.t), "args": _args(m)})
    return out


def write_trace(runs: Sequence[RecordedRun], path: Path, *, clock: str = "run") -> None:
    """One trace file for one or more runs (each run's tracks apart, named after it)."""
    events: list[dict[str, Any]] = []
    for index, run in enumerate(runs):
        label = run.result.name if len(runs) == 1 else f"{run.result.name} #{index + 1}"
        events.extend(trace_events(run, clock=clock, offset_pid=index * _RUN_STRIDE,
                                   label=label))
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "aftershock",
            "clock": "wall clock (Unix epoch)" if clock == "wall" else "CLOCK_MONOTONIC",
            "runs": [str(r.path) for r in runs],
            "wall_offset_s": [r.wall_offset for r in runs],
        },
    }
    path.write_text(json.dumps(document, separators=(",", ":"), default=str))
