"""Log probes: the events a system's output lines stand for.

One home for what the live run (harness/run/target.py, as each line is read) and a re-check
(harness/verdict/recheck.py, over the saved logs) both do, so the two can never judge a line
differently: named groups become fields, ``step``, ``rank`` and ``generation`` integers, the
rank read from torchrun's ``[N]:`` prefix when the pattern has none, and the line's own
``time`` group, where it makes sense, as the event's time (docs/metrics.md).

Probes are matched with the ``regex`` package, not ``re``: a user's pattern that backtracks
(``(a+)+b`` on a 64 KiB line of ``a``) runs for hours under ``re``, holding the GIL, so the
whole harness stops reading and triggering while the job goes on. ``regex`` takes ``re``'s
syntax as it is (named groups, lookarounds, backreferences: RE2 refuses the last two, so a
working scenario would stop validating) and gives up after ``timeout=`` seconds, counted in
the harness process's CPU time, not wall time: a busy machine does not make a sound probe
give up. A line a probe gave up on is a ``probe_timeout`` event (:func:`line_events`), and a
check that reads that probe's events is "not observed" (:func:`unread`).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import regex
from pydantic import Field, field_validator, model_validator

from aftershock.harness.run.records import CheckResult, Event
from aftershock.harness.scenario.schema import Strict

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
    # A process entered a world (its `generation`: torchft's "reconfiguring for
    # quorum_id=Q"): its later step lines without a generation of their own are in it.
    "world_changed",
]


class LogProbe(Strict):
    """Turns matching output lines of a system that has no probe into timeline events.

    Named groups become event fields: ``step`` (int), ``rank`` (int), ``digest``,
    ``cause``, and ``generation``: the identity of the world that wrote the line (a
    restart count, a quorum id; an int when it is digits). Two steps with the same
    ``generation`` were committed by one world; recovery and ``single_history`` need it
    on step lines. ``time`` is the moment the line's event happened (for a step: when it
    was committed): a date (ISO 8601, glog's ``I1206 05:27:42.123456``; without a zone,
    this machine's local time) or seconds on ``clock``; without it an event is stamped
    when the harness reads the line, which only bounds when it was written and never
    proves a step came after a fault. Lines are matched after torchrun's ``[rank]:``
    prefixes are kept, so a pattern can capture the rank from them.
    """

    pattern: str
    event: LogEventKind
    stream: Literal["stdout", "stderr", "logs", "both"] = Field(
        "both", description="which lines it reads: the launcher's stdout or stderr, the "
        "per-process files a command's `logs` names, or both: every stream")
    clock: Literal["monotonic", "unix"] = Field(
        "monotonic",
        description="what a (?P<time>...) group that holds a number counts: monotonic: "
        "seconds of CLOCK_MONOTONIC (Python's time.monotonic(), the clock of the timeline); "
        "unix: seconds since the epoch (time.time()), converted with the offset between the "
        "two clocks that the harness records at launch. A date (ISO 8601, glog's "
        "`I1206 05:27:42.123456`) is read as one whatever this says",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            compiled = regex.compile(value)
        # Compiled as the run matches it (the `regex` package, above): it refuses
        # a{99999999999} itself, and runs out of stack on a few hundred nested groups.
        except (regex.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if "world" in compiled.groupindex:
            raise ValueError("a (?P<world>...) group: name the world's identity "
                             "(?P<generation>...); `world` is the world's size in events")
        return value

    @model_validator(mode="after")
    def _clock_needs_time(self) -> LogProbe:
        if self.clock != "monotonic" and "time" not in regex.compile(self.pattern).groupindex:
            raise ValueError(f"clock: {self.clock} needs a (?P<time>...) group in pattern")
        return self

    @model_validator(mode="after")
    def _step_needs_its_number(self) -> LogProbe:
        # A step event without its number moves no step trigger and counts no step: the
        # run would fail later with "trigger step N not reached", naming no cause.
        groups = regex.compile(self.pattern).groupindex
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
#: In ``logs/``: one row per line read from a per-process file a command's ``logs:`` names,
#: ``<offset> <monotonic read time> <path>``.
TAILED_TIMES = "tailed.times"

CompiledProbes = list[tuple[LogProbe, "regex.Pattern[str]"]]

#: Each probe's time on one line, in CPU seconds of the harness process (the `regex`
#: package's clock). A linear pattern reads a 64 KiB line in about a millisecond; one that
#: needs more backtracks. A line given up costs the reader at most this, so a stray line
#: delays the step lines behind it by a fraction of a second; a job that prints many still
#: outruns the reader, which the run then says (``log_unread``). The match holds the GIL
#: (``concurrent`` left off): with it released, the harness's other threads would spend the
#: probe's budget, which is counted over the whole process.
PROBE_LINE_S = 0.25
#: Characters of one line the probes read (the launcher's pipes and the tailed files are cut
#: at 64 KiB already, harness/run/target.py's LINE_LIMIT; this holds for a re-check too). A
#: longer line is read up to here, and its events say so (``line_cut``).
PROBE_LINE_CHARS = 64 * 1024
#: The timeline event for a line a probe gave up on (docs/events.md).
PROBE_TIMEOUT = "probe_timeout"
#: The timeline event for lines the reader had not given to the probes when the run ended.
LOG_UNREAD = "log_unread"


def compile_probes(probes: Sequence[LogProbe], stream: str) -> CompiledProbes:
    """The probes that read ``stream`` (stdout, stderr, or logs: a per-process file),
    compiled."""
    return [(p, regex.compile(p.pattern)) for p in probes if p.stream in (stream, "both")]


def stream_kinds(probes: Sequence[LogProbe], stream: str) -> list[str]:
    """The event kinds the probes that read ``stream`` make: what its unread lines hide."""
    return sorted({p.event for p in probes if p.stream in (stream, "both")})


def line_events(line: str, compiled: CompiledProbes, *, read_t: float, clock_offset: float,
                started: float, defaults: dict[str, Any] | None = None,
                stamps: StreamStamps | None = None, where: str | None = None,
                cut: bool = False) -> list[Event]:
    """Every event ``line`` stands for: each match of each probe, not only the first, so
    two ranks' reports that one pipe ran together into one line are both counted.
    ``defaults``: fields the line's stream gives (a per-rank file's rank and attempt) where
    the pattern gives none. ``stamps``: the line's per-process file so far (give it every
    line of the file, matched or not): an event whose line has no time of its own gets
    ``written_after``, the newest own time of a line before it. ``where``: the line's
    ``file:number``, which a :data:`PROBE_TIMEOUT` event names: a probe that does not finish
    the line within :data:`PROBE_LINE_S` gives it up (no match), and says so. ``cut``: the
    reader kept only the line's first part (its cap); the events say so, as they do for a
    line longer than :data:`PROBE_LINE_CHARS`."""
    before = stamps.last if stamps is not None else None
    cut = cut or len(line) > PROBE_LINE_CHARS
    line = line[:PROBE_LINE_CHARS]
    events: list[Event] = []
    for spec, pattern in compiled:
        try:
            matches = list(pattern.finditer(line, timeout=PROBE_LINE_S))
        except TimeoutError:
            events.append(_timed_out(spec, line, read_t=read_t, where=where))
            continue
        events.extend(log_event(spec, match, line, read_t=read_t, clock_offset=clock_offset,
                                started=started) for match in matches)
    if cut:  # what matched, or did not, is of the line's first part only
        for event in events:
            event.fields["line_cut"] = True
    for event in events:
        for key, value in (defaults or {}).items():
            event.fields.setdefault(key, value)
        if before is not None and event.fields.get("clock") == "read":
            event.fields["written_after"] = before
    if stamps is not None:
        stamps.see(line, clock_offset=clock_offset, read_t=read_t, started=started)
    return events


class ProbeReader:
    """The live run's side of :func:`line_events`: each stream's lines are numbered (what a
    ``probe_timeout`` names), the line each stream's probes are on is known while they are
    on it, and once the run stops taking events (:meth:`close`) a reader that is still
    matching writes nothing more (the timeline is closed then; its descriptor may already
    name another file). ``write`` puts an event on the timeline."""

    def __init__(self, write: Callable[[Event], object]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._numbers: dict[str, int] = {}
        self._on: dict[str, str] = {}  # stream -> the line its probes are matching now
        self._closed = False

    def read(self, stream: str, line: str, compiled: CompiledProbes, *, read_t: float,
             clock_offset: float, started: float, defaults: dict[str, Any] | None = None,
             stamps: StreamStamps | None = None, cut: bool = False) -> None:
        """Match one line of ``stream`` (a file the harness names it by) and write its
        events; ``cut``: the reader kept only the line's first part."""
        number = self._numbers[stream] = self._numbers.get(stream, 0) + 1
        if self._closed or not compiled:
            return
        where = f"{stream}:{number}"
        self._on[stream] = where
        try:
            events = line_events(line, compiled, read_t=read_t, clock_offset=clock_offset,
                                 started=started, defaults=defaults, stamps=stamps,
                                 where=where, cut=cut)
        finally:
            self._on.pop(stream, None)
        with self._lock:
            if not self._closed:
                for event in events:
                    self._write(event)

    def close(self) -> dict[str, str]:
        """Take no more events; the streams whose probes were still on a line, and the line."""
        with self._lock:
            self._closed = True
            return dict(self._on)


def _timed_out(spec: LogProbe, line: str, *, read_t: float, where: str | None) -> Event:
    """The record of a line ``spec`` gave up on: which probe, which line, what it lost."""
    return Event(t=read_t, event=PROBE_TIMEOUT, source="log", fields={
        "pattern": spec.pattern, "kind": spec.event, "where": where or "a log line",
        "budget_s": PROBE_LINE_S, "line": line[:LINE_SHOWN], "line_chars": len(line),
        "clock": "read", "read_t": read_t})


def count_matches(compiled: CompiledProbes, line: str) -> int:
    """How many events ``line`` would make, each probe bounded as :func:`line_events` bounds
    it (a probe that gives up counts none)."""
    line = line[:PROBE_LINE_CHARS]
    found = 0
    for _, pattern in compiled:
        with contextlib.suppress(TimeoutError):
            found += len(pattern.findall(line, timeout=PROBE_LINE_S))
    return found


#: The event kinds a built-in check reads of those log probes make: a line a probe gave up
#: on, or lines the reader never got to, may have been one of them, so the check cannot
#: prove its claim. A check not named here (a plug-in's) is taken to read every kind.
_STEPS = frozenset({"step", "world_changed", "hello", "checkpoint_loaded"})
CHECK_READS: dict[str, frozenset[str]] = {
    "completes": frozenset(),
    "params_match": frozenset({"params"}),
    "outputs_match": frozenset(),
    "time_to_detect": frozenset({"failure_detected", "recovery_done"}) | _STEPS,
    "time_to_recover": frozenset({"failure_detected", "recovery_done"}) | _STEPS,
    "lost_steps": _STEPS,
    "skipped_steps": _STEPS,
    "single_history": _STEPS,
    "step_rate": _STEPS,
    "straggler_named": _STEPS,
    "checkpoint_durable": frozenset({"checkpoint_saved"}) | _STEPS,
    "xid_action": _STEPS,  # the process goes on committing steps, or it does not
    "faults_landed": frozenset(),  # the harness's own reading of the file at the fault
    "fault_free_golden": frozenset(),  # a recorded twin against a golden file
    "no_lost_requests": frozenset({"serving_ready"}),
    "no_duplicated_tokens": frozenset({"serving_ready"}),
}
_EVERY_KIND = frozenset(get_args(LogEventKind))


def _reads(check: str) -> frozenset[str]:
    if check.startswith("latency."):
        return CHECK_READS["no_lost_requests"]
    return CHECK_READS.get(check, _EVERY_KIND)


def unread(results: Sequence[CheckResult], events: Sequence[Event]) -> list[CheckResult]:
    """``results`` with every check that reads what a probe gave up on (``probe_timeout``),
    or what the reader had not read when the run ended (``log_unread``), failed as not
    observed, naming the first such line: a verdict from a timeline with a hole in it would
    be a guess. ``faults_injected`` that passed stands (the injections are the harness's
    own records); one that failed may have missed a trigger's line, so it is not observed
    either."""
    holes: list[tuple[frozenset[str], str]] = []
    for event in events:
        fields = event.fields
        if event.event == PROBE_TIMEOUT:
            holes.append((frozenset({str(fields.get("kind"))}),
                          f"probe {fields.get('pattern')!r} timed out on {fields.get('where')} "
                          f"(over {fields.get('budget_s')} s on one line), so a "
                          f"{fields.get('kind')} line may have been missed"))
        elif event.event == LOG_UNREAD:
            kinds = fields.get("kinds")
            holes.append((frozenset(map(str, kinds)) if isinstance(kinds, list) else _EVERY_KIND,
                          f"the log reader was still behind on {fields.get('stream')} when the "
                          f"run ended ({fields.get('why')})"))
    if not holes:
        return list(results)
    judged: list[CheckResult] = []
    for result in results:
        reads = _EVERY_KIND if result.name == "faults_injected" else _reads(result.name)
        hole = next((why for kinds, why in holes if kinds & reads), None)
        if hole is None or (result.name == "faults_injected" and result.passed):
            judged.append(result)
            continue
        judged.append(replace(result, passed=False,
                              message=f"not observed: {hole} (judged alone: {result.message})"))
    return judged


#: torchrun's per-process files (``--log-dir D --redirects 3``):
#: ``D/<run id>_<random>/attempt_<restart>/<local rank>/stdout.log``. Each torchrun makes its
#: own ``<run id>_<random>`` folder (a fresh temporary name), kept over its restarts.
_TORCHRUN_FILE = re.compile(r"^(.*)/attempt_(\d+)/(\d+)/(?:stdout|stderr)\.log$")


def file_fields(path: str) -> dict[str, Any]:
    """What a per-process log file's path says of the lines in it: torchrun's layout gives
    the (local) rank, the restart count of its torchrun (``attempt``) and that torchrun's own
    folder (``launcher``). The restart count is a world (``generation``) only when one
    torchrun launched the whole job, which the path cannot tell: harness/verdict/metrics.py decides
    that from every launcher the run showed (``Reading``)."""
    fields: dict[str, Any] = {"stream": path}
    found = _TORCHRUN_FILE.search(path)
    if found:
        fields["launcher"] = found.group(1)
        fields["attempt"] = int(found.group(2))
        fields["rank"] = int(found.group(3))
    return fields


#: How far a line's own time may lie past the moment it was read (rounding in print, the
#: Unix-to-monotonic offset drifting by an NTP slew) before it is taken for the wrong clock.
LINE_TIME_SLACK_S = 1.0


def log_event(spec: LogProbe, match: regex.Match[str], line: str, *, read_t: float,
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
        t, clock = _line_time(spec, raw_time, fields, read_t=read_t, clock_offset=clock_offset,
                              started=started)
    fields["clock"] = clock
    fields["read_t"] = read_t
    return Event(t=t, event=spec.event, source="log", fields=fields)


def _line_time(spec: LogProbe, raw_time: str, fields: dict[str, Any], *, read_t: float,
               clock_offset: float, started: float) -> tuple[float, str]:
    """A line's ``time`` group as the event's time and clock (``line``), or the read time
    (``read``) with the reason it was rejected noted in ``fields``."""
    wall = wall_time(raw_time, read_t + clock_offset)
    if wall is not None:
        # NaN without the run's wall-clock anchor (a timeline recorded before it was).
        value, kind = wall - clock_offset, "wall-clock"
    else:
        try:
            value = float(raw_time)
        except ValueError:
            value = math.nan
        kind = spec.clock
        if spec.clock == "unix":
            value -= clock_offset
    if not math.isfinite(value):
        fields["time_rejected"] = (
            f"a date, but the run recorded no wall-clock anchor: {raw_time!r}"
            if wall is not None else f"not a number nor a date (ISO 8601, glog): {raw_time!r}")
        return read_t, "read"
    if kind != "monotonic":
        fields["clock_offset"] = clock_offset
    if value > read_t + LINE_TIME_SLACK_S:
        fields["time_rejected"] = (f"{raw_time} is {value - read_t:.3g} s after the line "
                                   f"was read: not {kind} time?")
    elif value < started - LINE_TIME_SLACK_S:
        fields["time_rejected"] = (f"{raw_time} is {started - value:.3g} s before the run "
                                   f"began: not {kind} time?")
    else:
        return min(value, read_t), "line"
    return read_t, "read"


#: The dates log lines carry. ISO 8601 (``2026-12-06T05:27:42.123``, Python logging's
#: ``2026-12-06 05:27:42,123``, with ``Z`` or ``+01:00`` or, without a zone, this machine's
#: local time: torchft's Rust half and the lighthouse) and glog's (``I1206 05:27:42.123456``:
#: torchrun's agent, c10d; local time, no year).
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?"
                  r"\s?(Z|[+-]\d\d:?\d\d)?")
_GLOG = re.compile(r"[IWEF]?(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?")
#: A line that begins with one of them (after torchrun's ``[rank]:`` prefix): its time.
_STAMPED = re.compile(r"^(?:\[(?:default)?\d+\]:)?\s*(?P<time>"
                      r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
                      r"|[IWEF]\d{4} \d\d:\d\d:\d\d(?:\.\d+)?)\b")


def wall_time(text: str, now: float) -> float | None:
    """Seconds since the epoch that a date in a log line (ISO 8601, glog) says, or None when
    ``text`` is not one. ``now`` (seconds since the epoch, when the line was read) gives
    glog's missing year: the year that puts the date no later than a day after ``now``."""
    text = text.strip()
    found = _ISO.fullmatch(text)
    if found:
        year, month, day, hour, minute, second, fraction, zone = found.groups()
        tz: datetime.tzinfo | None = None
        if zone == "Z":
            tz = datetime.UTC
        elif zone:
            sign = 1 if zone[0] == "+" else -1
            digits = zone[1:].replace(":", "")
            tz = datetime.timezone(sign * datetime.timedelta(hours=int(digits[:2]),
                                                             minutes=int(digits[2:])))
        try:
            moment = datetime.datetime(int(year), int(month), int(day), int(hour), int(minute),
                                       int(second), tzinfo=tz)
        except ValueError:
            return None
        return moment.timestamp() + float(f"0.{fraction}" if fraction else 0)
    found = _GLOG.fullmatch(text)
    if found is None or not math.isfinite(now):
        return None
    month, day, hour, minute, second, fraction = found.groups()
    year = datetime.datetime.fromtimestamp(now).year
    for candidate in (year, year - 1):
        try:
            moment = datetime.datetime(candidate, int(month), int(day), int(hour), int(minute),
                                       int(second))
        except ValueError:
            continue  # 29 February of a year that has none
        value = moment.timestamp() + float(f"0.{fraction}" if fraction else 0)
        if value <= now + 86400:
            return value
    return None


@dataclass
class StreamStamps:
    """The newest own time among the lines of one per-process file so far (a date the line
    begins with, as most loggers write them), on the timeline's clock.

    A file's lines are written in order, so a line without a time of its own was written
    after that moment: when a framework's Rust or C++ half stamps its lines and its Python
    half does not (torchft), the stamped line just before a step line says the step was
    committed after that moment. Not for a launcher's pipe: two processes' lines reach it
    out of order."""

    last: float | None = None

    def see(self, line: str, *, clock_offset: float, read_t: float, started: float) -> None:
        found = _STAMPED.match(line)
        if found is None or not math.isfinite(clock_offset):
            return
        wall = wall_time(found.group("time"), read_t + clock_offset)
        if wall is None:
            return
        own = wall - clock_offset
        # The same sanity as a `time` group's: never after the line was read, nor before
        # the run began (a line left over from an earlier run).
        if started - LINE_TIME_SLACK_S <= own <= read_t + LINE_TIME_SLACK_S:
            self.last = min(own, read_t) if self.last is None else max(self.last,
                                                                        min(own, read_t))


