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
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from harness.records import Event
from harness.schema import Strict

#: Event kinds a log probe may produce (see docs/events.md).
LogEventKind = Literal[
    "step",
    "failure_detected",
    "recovery_done",
    "checkpoint_saved",
    "checkpoint_loaded",
    "params",
    "hello",
    # A server says it listens ("Uvicorn running on ..."): a load's `ready: {event}`.
    "serving_ready",
]


class LogProbe(Strict):
    """Turns matching output lines of a system that has no probe into timeline events.

    Named groups become event fields: ``step`` (int), ``rank`` (int), ``digest``,
    ``cause``, and ``generation``: the identity of the world that wrote the line (a
    restart count, a quorum id; an int when it is digits). Two steps with the same
    ``generation`` were committed by one world; recovery and ``single_history`` need it
    on step lines. ``time`` is the moment the line's event happened (for a step: when it
    was committed), in seconds on ``clock``; without it an event is stamped when the
    harness reads the line, which only bounds when it was written and never proves a
    step came after a fault. Lines are matched after torchrun's ``[rank]:`` prefixes are
    kept, so a pattern can capture the rank from them.
    """

    pattern: str
    event: LogEventKind
    stream: Literal["stdout", "stderr", "logs", "both"] = Field(
        "both", description="which lines it reads: the launcher's stdout or stderr, the "
        "per-process files a command's `logs` names, or both: every stream")
    clock: Literal["monotonic", "unix"] = Field(
        "monotonic",
        description="what the (?P<time>...) group counts: monotonic: seconds of "
        "CLOCK_MONOTONIC (Python's time.monotonic(), the clock of the timeline); unix: "
        "seconds since the epoch (time.time()), converted with the offset between the two "
        "clocks that the harness records at launch",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        # re.compile raises OverflowError for a{99999999999} and runs out of stack on a few
        # hundred nested groups.
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if "world" in compiled.groupindex:
            raise ValueError("a (?P<world>...) group: name the world's identity "
                             "(?P<generation>...); `world` is the world's size in events")
        return value

    @model_validator(mode="after")
    def _clock_needs_time(self) -> LogProbe:
        if self.clock != "monotonic" and "time" not in re.compile(self.pattern).groupindex:
            raise ValueError(f"clock: {self.clock} needs a (?P<time>...) group in pattern")
        return self

    @model_validator(mode="after")
    def _step_needs_its_number(self) -> LogProbe:
        # A step event without its number moves no step trigger and counts no step: the
        # run would fail later with "trigger step N not reached", naming no cause.
        groups = re.compile(self.pattern).groupindex
        if self.event == "hello" and "pid" not in groups:
            raise ValueError("an `event: hello` probe needs a (?P<pid>...) group in pattern: "
                             "it says which process is which rank (and `replica`, `shard`, "
                             "`role`), so faults can target it")
        if self.event == "step" and "step" not in groups:
            raise ValueError("an `event: step` probe needs a (?P<step>...) group in pattern: "
                             "the step number is what `at: {step}`, every step metric and "
                             "recovery read")
        return self


#: Groups whose digits become integers.
_INTEGRAL = ("step", "rank", "generation", "pid", "replica", "shard")
_RANK_PREFIX = re.compile(r"^\[(?:default)?(\d+)\]:")
LINE_SHOWN = 300  # characters of the matched line an event keeps
#: Beside each ``logs/<name>.log``: one row per line, ``<offset> <monotonic read time>``.
TIMES_SUFFIX = ".times"

CompiledProbes = list[tuple[LogProbe, "re.Pattern[str]"]]


def compile_probes(probes: Sequence[LogProbe], stream: str) -> CompiledProbes:
    """The probes that read ``stream`` (stdout, stderr, or logs: a per-process file),
    compiled."""
    return [(p, re.compile(p.pattern)) for p in probes if p.stream in (stream, "both")]


def line_events(line: str, compiled: CompiledProbes, *, read_t: float, clock_offset: float,
                started: float, defaults: dict[str, Any] | None = None) -> list[Event]:
    """Every event ``line`` stands for: each match of each probe, not only the first, so
    two ranks' reports that one pipe ran together into one line are both counted.
    ``defaults``: fields the line's stream gives (a per-rank file's rank and attempt) where
    the pattern gives none."""
    events = [log_event(spec, match, line, read_t=read_t, clock_offset=clock_offset,
                        started=started)
              for spec, pattern in compiled for match in pattern.finditer(line)]
    for event in events:
        for key, value in (defaults or {}).items():
            event.fields.setdefault(key, value)
    return events


#: torchrun's per-process files (``--log-dir D --redirects 3``):
#: ``D/<run id>/attempt_<restart>/<local rank>/stdout.log``.
_TORCHRUN_FILE = re.compile(r"attempt_(\d+)/(\d+)/(?:stdout|stderr)\.log$")


def file_fields(path: str) -> dict[str, Any]:
    """What a per-process log file's path says of the lines in it: torchrun's layout gives
    the (local) rank and the restart count (the world's ``generation``)."""
    fields: dict[str, Any] = {"stream": path}
    found = _TORCHRUN_FILE.search(path)
    if found:
        fields["generation"] = int(found.group(1))
        fields["rank"] = int(found.group(2))
    return fields


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
        integral = key in _INTEGRAL and value.isdigit()
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


