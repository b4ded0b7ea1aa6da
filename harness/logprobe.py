"""Log probes: the events a system's output lines stand for.

One home for what the live run (harness/target.py, as each line is read) and a re-check
(harness/recheck.py, over the saved logs) both do, so the two can never judge a line
differently: named groups become fields, ``step``, ``rank`` and ``generation`` integers, the
rank read from torchrun's ``[N]:`` prefix when the pattern has none, and the line's own
``time`` group, where it makes sense, as the event's time (docs/metrics.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from harness.records import Event
from harness.spec import LogProbe

_RANK_PREFIX = re.compile(r"^\[(?:default)?(\d+)\]:")
LINE_SHOWN = 300  # characters of the matched line an event keeps
#: Beside each ``logs/<name>.log``: one row per line, ``<offset> <monotonic read time>``.
TIMES_SUFFIX = ".times"

CompiledProbes = list[tuple[LogProbe, "re.Pattern[str]"]]


def compile_probes(probes: Sequence[LogProbe], stream: str) -> CompiledProbes:
    """The probes that read ``stream`` (stdout or stderr), compiled."""
    return [(p, re.compile(p.pattern)) for p in probes if p.stream in (stream, "both")]


def line_events(line: str, compiled: CompiledProbes, *, read_t: float, clock_offset: float,
                started: float) -> list[Event]:
    """Every event ``line`` stands for: each match of each probe, not only the first, so
    two ranks' reports that one pipe ran together into one line are both counted."""
    return [log_event(spec, match, line, read_t=read_t, clock_offset=clock_offset,
                      started=started)
            for spec, pattern in compiled for match in pattern.finditer(line)]


#: How far a line's own time may lie past the moment it was read (rounding in print, the
#: Unix-to-monotonic offset drifting by an NTP slew) before it is taken for the wrong clock.
LINE_TIME_SLACK_S = 1.0


def log_event(spec: LogProbe, match: re.Match[str], line: str, *, read_t: float,
              clock_offset: float, started: float) -> Event:
    """The event a matching log line stands for.

    Its time is the line's own ``time`` group when there is one that makes sense (not
    after the line was read, not before the run began), capped at the read time, which
    no line can postdate: ``clock: line``. Otherwise it is the read time, only an upper
    bound on when the line was written: ``clock: read`` (docs/metrics.md)."""
    fields: dict[str, Any] = {"line": line[:LINE_SHOWN]}
    raw_time: str | None = None
    for key, value in match.groupdict().items():
        if value is None:
            continue
        if key == "time":
            raw_time = value
            continue
        integral = key in ("step", "rank", "generation") and value.isdigit()
        fields[key] = int(value) if integral else value
    if "rank" not in fields:
        prefix = _RANK_PREFIX.match(line)
        if prefix:
            fields["rank"] = int(prefix.group(1))
    t, clock = read_t, "read"
    if raw_time is not None:
        try:
            value = float(raw_time)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            fields["time_rejected"] = f"not a number: {raw_time!r}"
        else:
            own = value - clock_offset if spec.clock == "unix" else value
            if spec.clock == "unix":
                fields["clock_offset"] = clock_offset
            if own > read_t + LINE_TIME_SLACK_S:
                fields["time_rejected"] = (f"{raw_time} is {own - read_t:.3g} s after the line "
                                           f"was read: not {spec.clock} time?")
            elif own < started - LINE_TIME_SLACK_S:
                fields["time_rejected"] = (f"{raw_time} is {started - own:.3g} s before the run "
                                           f"began: not {spec.clock} time?")
            else:
                t, clock = min(own, read_t), "line"
    fields["clock"] = clock
    fields["read_t"] = read_t
    return Event(t=t, event=spec.event, source="log", fields=fields)


