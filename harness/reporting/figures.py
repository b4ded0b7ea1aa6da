"""The charts of the HTML report, as plotly.js figure specs (plain dicts, JSON-ready).

Built here in Python from the timeline alone, so tests can read them without a
browser; `harness/reporting/html.py` embeds them and plotly.js draws them. Every trace
carries ``meta.role`` (``rank``, ``fault``, ``request``, ...) so the page, and the
tests that drive it, can tell what each series is. x is seconds since launch;
the page turns it into wall-clock time on demand (`docs/report.md`).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from aftershock.harness.run.records import Event
from aftershock.harness.run.rundir import RecordedRun
from aftershock.harness.verdict import metrics as _metrics

Figure = dict[str, Any]

FAULT = "#d62728"
DETECT = "#ff7f0e"
RECOVER = "#2ca02c"
#: Above this many token arrivals the serving chart leaves the token dots out (the page
#: would get slow); lifelines and percentiles stay.
MAX_TOKEN_DOTS = 20_000


def figure(run: RecordedRun) -> Figure:
    """The run's chart: serving when a load was served, training otherwise."""
    if _metrics.is_serving(run.events):
        return serving_figure(run)
    return training_figure(run)


def _rel(run: RecordedRun, t: float) -> float:
    return round(t - run.t0, 6)


def _faults(run: RecordedRun) -> list[tuple[Event, float | None]]:
    """Each injected fault with the time it was healed (None: nothing undoes it)."""
    healed = [e for e in run.events if e.event == "fault_healed"]
    out = []
    for e in run.events:
        if e.event != "fault_injected":
            continue
        heal = next((h for h in healed if h.t >= e.t and h.fields.get("kind")
                     == e.fields.get("kind")), None)
        if heal is not None:
            healed.remove(heal)
        out.append((e, heal.t if heal is not None else None))
    return out


def _fault_label(e: Event) -> str:
    where = f"rank {e.rank}" if e.rank is not None else str(e.fields.get("role") or "")
    return f"{e.fields.get('kind')} -> {where} ({e.fields.get('detail', '')})"


def _fault_marks(run: RecordedRun, y: list[float], yaxis: str = "y") -> tuple[
        dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The fault markers (one point per injected fault), their windows and the detection
    and recovery lines with the metric values."""
    faults = _faults(run)
    trace = {
        "type": "scatter", "mode": "markers", "name": "fault injected",
        "meta": {"role": "fault"}, "yaxis": yaxis,
        "x": [_rel(run, e.t) for e, _ in faults], "y": y,
        "text": [_fault_label(e) for e, _ in faults],
        "hovertemplate": "%{text}<br>at %{x:.3f}s<extra>FAULT</extra>",
        "marker": {"symbol": "x", "size": 14, "color": FAULT,
                   "line": {"width": 1, "color": "white"}},
        "cliponaxis": False,
    }
    shapes: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for e, healed in faults:
        x0 = _rel(run, e.t)
        if healed is not None:
            shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": x0,
                           "x1": _rel(run, healed), "y0": 0, "y1": 1, "fillcolor": FAULT,
                           "opacity": 0.12, "line": {"width": 0}, "layer": "below",
                           "name": "fault window"})
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x0, "x1": x0,
                       "y0": 0, "y1": 1, "line": {"color": FAULT, "width": 1.5}})
    first = _metrics.first_fault_time(run.events)
    if first is not None:
        marks = (("time_to_detect_s", "detected", DETECT, 1.0),
                 ("time_to_recover_s", "recovered", RECOVER, 0.93))
        for metric, what, color, height in marks:
            value = run.result.metrics.get(metric)
            if not isinstance(value, int | float):
                notes.append({"xref": "x", "yref": "paper", "x": _rel(run, first), "y": height,
                              "text": f"{what}: not observed", "showarrow": False,
                              "xanchor": "left", "font": {"color": color}})
                continue
            x = _rel(run, first + value)
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x,
                           "y0": 0, "y1": 1, "line": {"color": color, "width": 1.5,
                                                      "dash": "dash"}})
            notes.append({"xref": "x", "yref": "paper", "x": x, "y": height,
                          "text": f"{what} +{_duration(value)} ({metric})",
                          "showarrow": False, "xanchor": "left", "bgcolor": "white",
                          "font": {"color": color, "size": 11}})
        recovered = run.result.metrics.get("time_to_recover_s")
        if isinstance(recovered, int | float):
            shapes.append({"type": "rect", "xref": "x", "yref": "paper",
                           "x0": _rel(run, first), "x1": _rel(run, first + recovered),
                           "y0": 0, "y1": 1, "fillcolor": "#888", "opacity": 0.10,
                           "line": {"width": 0}, "layer": "below", "name": "outage"})
    return trace, shapes, notes


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _layout(title: str, run: RecordedRun) -> dict[str, Any]:
    return {
        "title": {"text": title, "x": 0.01},
        "hovermode": "closest",
        "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
        "legend": {"orientation": "h", "y": -0.15},
        "xaxis": {"title": {"text": "seconds since launch"}, "zeroline": False},
        "meta": {"t0": run.t0, "wall_offset": run.wall_offset},
        "height": 520,
    }


# ---------------------------------------------------------------------------- training


def training_figure(run: RecordedRun) -> Figure:
    events = run.events
    steps = [e for e in events if e.event == "step" and isinstance(e.fields.get("step"), int)]
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in steps:
        by_rank[e.rank if e.rank is not None else 0].append(e)
    data: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        series = by_rank[rank]
        data.append({
            "type": "scatter", "mode": "lines+markers", "name": f"rank {rank}",
            "meta": {"role": "rank", "rank": rank},
            "x": [_rel(run, e.t) for e in series], "y": [e.fields["step"] for e in series],
            "customdata": [[e.fields.get("generation", ""), e.fields.get("pid", ""),
                            _short(e.fields.get("loss"))] for e in series],
            "hovertemplate": (f"rank {rank}<br>step %{{y}} at %{{x:.3f}}s<br>generation "
                              "%{customdata[0]} · pid %{customdata[1]} · loss %{customdata[2]}"
                              "<extra></extra>"),
            "line": {"shape": "hv", "width": 1.5}, "marker": {"size": 3},
        })
    data.extend(_step_marks(run, by_rank))
    data.extend(_point_events(run, steps))
    top = max((e.fields["step"] for e in steps), default=0)
    fault_trace, shapes, notes = _fault_marks(
        run, [_step_at(steps, e.t) or top for e, _ in _faults(run)])
    data.append(fault_trace)
    for t, generation in _generations(events):
        x = _rel(run, t)
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x,
                       "y0": 0, "y1": 1, "line": {"color": "#7f7f7f", "width": 1,
                                                  "dash": "dot"}})
        notes.append({"xref": "x", "yref": "paper", "x": x, "y": 0.02,
                      "text": f"generation {generation}", "showarrow": False,
                      "xanchor": "left", "font": {"size": 10, "color": "#555"}})
    layout = _layout("committed step per rank", run)
    layout["yaxis"] = {"title": {"text": "committed step"}, "rangemode": "tozero"}
    layout["shapes"] = shapes
    layout["annotations"] = notes
    return {"data": data, "layout": layout}


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))


def _step_at(steps: Sequence[Event], t: float) -> int | None:
    """The highest step committed at time ``t`` (where a fault's marker sits)."""
    before = [e.fields["step"] for e in steps if e.t <= t]
    return max(before) if before else None


def _generations(events: Sequence[Event]) -> list[tuple[float, int]]:
    """When each new generation first said hello."""
    seen: dict[int, float] = {}
    for e in events:
        generation = e.fields.get("generation")
        if e.event == "hello" and isinstance(generation, int) and generation not in seen:
            seen[generation] = e.t
    first = min(seen, default=None)
    return sorted((t, g) for g, t in seen.items() if g != first)


def _step_marks(run: RecordedRun, by_rank: dict[int, list[Event]]) -> list[dict[str, Any]]:
    """Recomputed steps (lost: committed again) and skipped step numbers, per
    docs/metrics.md's `lost_steps`: a report of a step at or below the rank's best."""
    redone_x, redone_y, redone_text = [], [], []
    skipped_x, skipped_y, skipped_text = [], [], []
    for rank, series in by_rank.items():
        best: int | None = None
        for e in series:
            step = e.fields["step"]
            if best is not None and step <= best:
                redone_x.append(_rel(run, e.t))
                redone_y.append(step)
                redone_text.append(f"rank {rank} committed step {step} again")
            elif best is not None and step > best + 1:
                for missing in range(best + 1, step):
                    skipped_x.append(_rel(run, e.t))
                    skipped_y.append(missing)
                    skipped_text.append(f"rank {rank} never reported step {missing}")
            best = step if best is None else max(best, step)
    return [
        {"type": "scatter", "mode": "markers", "name": "recomputed (lost) step",
         "meta": {"role": "lost"}, "x": redone_x, "y": redone_y, "text": redone_text,
         "hovertemplate": "%{text}<extra></extra>",
         "marker": {"symbol": "circle-open", "size": 9, "color": FAULT, "line": {"width": 2}}},
        {"type": "scatter", "mode": "markers", "name": "step never reported (skipped)",
         "meta": {"role": "skipped"}, "x": skipped_x, "y": skipped_y, "text": skipped_text,
         "hovertemplate": "%{text}<extra></extra>",
         "marker": {"symbol": "triangle-up-open", "size": 8, "color": "#9467bd"}},
    ]


_POINTS = (
    ("checkpoint_saved", "checkpoint saved", "diamond", "#1f77b4"),
    ("checkpoint_loaded", "checkpoint loaded", "star", "#17becf"),
    ("checkpoint_skipped", "checkpoint skipped", "diamond-x", "#8c564b"),
    ("checkpoint_failed", "checkpoint failed", "diamond-x", FAULT),
    ("failure_detected", "failure detected", "circle-x", DETECT),
    ("recovery_done", "recovery done", "circle-cross", RECOVER),
)


def _point_events(run: RecordedRun, steps: Sequence[Event]) -> list[dict[str, Any]]:
    """Checkpoints, detections and recoveries as markers where the rank stood."""
    out = []
    for kind, name, symbol, color in _POINTS:
        found = [e for e in run.events if e.event == kind]
        if not found:
            continue
        ys = []
        for e in found:
            step = e.fields.get("step")
            ys.append(step if isinstance(step, int) else _step_at(
                [s for s in steps if s.rank == e.rank] or steps, e.t) or 0)
        out.append({
            "type": "scatter", "mode": "markers", "name": name, "meta": {"role": kind},
            "x": [_rel(run, e.t) for e in found], "y": ys,
            "text": [_describe(e) for e in found],
            "hovertemplate": "%{text}<br>at %{x:.3f}s<extra>" + name + "</extra>",
            "marker": {"symbol": symbol, "size": 10, "color": color,
                       "line": {"width": 1, "color": "#333"}},
        })
    return out


def _describe(e: Event) -> str:
    who = f"rank {e.rank}" if e.rank is not None else e.source
    extra = {k: v for k, v in e.fields.items()
             if k in ("cause", "step", "path", "reason", "error", "generation", "worker")}
    shown = ", ".join(f"{k}={str(v)[:80]}" for k, v in extra.items())
    return f"{who}: {e.event}" + (f" ({shown})" if shown else "")


# ----------------------------------------------------------------------------- serving


def serving_figure(run: RecordedRun) -> Figure:
    """Each request's life (a row: queued, then streaming, its tokens, migrations) above
    the latency percentiles over time, faults across both."""
    records = _metrics.requests(run.events)
    rows = {r.id: i for i, r in enumerate(records)}
    lines = _request_lines(run, records)
    (queued_x, queued_y), (stream_x, stream_y) = lines["queued"], lines["stream"]
    (lost_x, lost_y), (token_x, token_y) = lines["lost"], lines["token"]
    migrated = [e for e in run.events if e.event == "request_migrated"
                and str(e.fields.get("request_id")) in rows]
    line = {"type": "scatter", "mode": "lines", "hoverinfo": "skip", "yaxis": "y"}
    data: list[dict[str, Any]] = [
        {**line, "name": "queued (sent -> first token)", "meta": {"role": "queued"},
         "x": queued_x, "y": queued_y, "line": {"color": "#bbbbbb", "width": 3}},
        {**line, "name": "streaming", "meta": {"role": "request"},
         "x": stream_x, "y": stream_y, "line": {"color": "#1f77b4", "width": 3}},
        {**line, "name": "lost (never completed)", "meta": {"role": "lost"},
         "x": lost_x, "y": lost_y, "line": {"color": FAULT, "width": 3}},
        {"type": "scatter", "mode": "markers", "name": "token", "meta": {"role": "token"},
         "x": token_x, "y": token_y, "yaxis": "y", "hoverinfo": "skip",
         "marker": {"size": 3, "color": "#0b3d6b"}},
        {"type": "scatter", "mode": "markers", "name": "migrated", "meta": {"role": "migrated"},
         "x": [_rel(run, e.t) for e in migrated],
         "y": [rows[str(e.fields.get("request_id"))] for e in migrated], "yaxis": "y",
         "text": [f"{e.fields.get('request_id')}: worker {e.fields.get('from_worker')} -> "
                  f"{e.fields.get('to_worker')} after {e.fields.get('emitted')} tokens"
                  for e in migrated],
         "hovertemplate": "%{text}<extra>migrated</extra>",
         "marker": {"symbol": "triangle-right", "size": 10, "color": DETECT}},
        {"type": "scatter", "mode": "markers", "name": "request", "meta": {"role": "hover"},
         "showlegend": False, "yaxis": "y",
         "x": [_rel(run, r.sent) for r in records], "y": list(range(len(records))),
         "text": [_request_text(r) for r in records],
         "hovertemplate": "%{text}<extra></extra>", "marker": {"size": 4, "color": "#999"}},
    ]
    data.extend(_percentiles(run, records))
    fault_trace, shapes, notes = _fault_marks(run, [len(records)] * len(_faults(run)))
    data.append(fault_trace)
    layout = _layout("requests and latency", run)
    layout["height"] = 760
    layout["yaxis"] = {"title": {"text": "request (by send time)"}, "domain": [0.38, 1],
                       "autorange": "reversed", "zeroline": False}
    layout["yaxis2"] = {"title": {"text": "latency (s)"}, "domain": [0, 0.28],
                        "rangemode": "tozero"}
    layout["xaxis"]["anchor"] = "y2"
    layout["shapes"] = shapes
    layout["annotations"] = notes
    return {"data": data, "layout": layout}


def _request_lines(run: RecordedRun, records: list[_metrics.RequestRecord]
                   ) -> dict[str, tuple[list[float | None], list[int | None]]]:
    """Each request's row as line segments (x, y; None between two): ``queued`` (sent to
    first token), ``stream`` (first to last token), ``lost`` (never completed) and its
    ``token`` dots, unless there are too many to draw."""
    lines: dict[str, tuple[list[float | None], list[int | None]]] = {
        name: ([], []) for name in ("queued", "stream", "lost", "token")}
    dots = sum(len(r.times) for r in records) <= MAX_TOKEN_DOTS
    for i, r in enumerate(records):
        lost = not r.done or len(r.tokens) < r.max_tokens
        first = r.times[0] if r.times else None
        last = r.times[-1] if r.times else None
        if first is None:
            end = max(r.sent, run.events[-1].t if run.events else r.sent)
            lines["lost"][0].extend([_rel(run, r.sent), _rel(run, end), None])
            lines["lost"][1].extend([i, i, None])
            continue
        lines["queued"][0].extend([_rel(run, r.sent), _rel(run, first), None])
        lines["queued"][1].extend([i, i, None])
        xs, ys = lines["lost" if lost else "stream"]
        xs.extend([_rel(run, first), _rel(run, last or first), None])
        ys.extend([i, i, None])
        if dots:
            lines["token"][0].extend(_rel(run, t) for t in r.times)
            lines["token"][1].extend([i] * len(r.times))
    return lines


def _request_text(r: _metrics.RequestRecord) -> str:
    state = "done" if r.done and len(r.tokens) >= r.max_tokens else "LOST"
    ttft = f"{(r.times[0] - r.sent) * 1000:.0f} ms" if r.times else "never"
    return (f"{r.id} ({state})<br>{len(r.tokens)}/{r.max_tokens} tokens, first after {ttft}"
            f"<br>duplicates {r.duplicates}")


def _percentiles(run: RecordedRun, records: Sequence[_metrics.RequestRecord]
                 ) -> list[dict[str, Any]]:
    """TTFT and time-between-tokens percentiles per time bucket (a 20th of the load's span,
    at least 0.1 s), attributed to when the token arrived."""
    ttft = [(r.times[0], r.times[0] - r.sent) for r in records if r.times]
    tpot = [(b, b - a) for r in records for a, b in itertools.pairwise(r.times)]
    stamps = [t for t, _ in ttft] + [t for t, _ in tpot]
    if not stamps:
        return []
    start, stop = min(stamps), max(stamps)
    width = max((stop - start) / 20, 0.1)
    out = []
    series = (("ttft", ttft, "time to first token"), ("tpot", tpot, "time between tokens"))
    for name, points, what in series:
        buckets: dict[int, list[float]] = defaultdict(list)
        for t, value in points:
            buckets[int((t - start) / width)].append(value)
        for q, dash in ((50, "solid"), (99, "dot")):
            xs = [_rel(run, start + (b + 0.5) * width) for b in sorted(buckets)]
            ys = [_metrics.percentile(buckets[b], q) for b in sorted(buckets)]
            out.append({
                "type": "scatter", "mode": "lines+markers", "name": f"{name} p{q}",
                "meta": {"role": "latency"}, "x": xs, "y": ys, "yaxis": "y2",
                "hovertemplate": f"{what} p{q}: %{{y:.3f}}s<extra></extra>",
                "line": {"dash": dash, "color": "#1f77b4" if name == "ttft" else "#9467bd"},
                "marker": {"size": 4},
            })
    return out
