"""How each process of a run ended, and whether its restarts loop on one crash.

Pure functions over the run's timeline and the files its processes left behind: torchrun's
agent lines on the launcher's stderr (``failed (exitcode: 1) local_rank: 0 (pid: 4242)``,
``Sending process 4243 closing signal SIGTERM``, its error summary), each worker's own
stderr file and torchrun's error file (``TORCHELASTIC_ERROR_FILE``), and the launcher's
saved stderr. Every file is read from its end, at most TAIL_BYTES (the launcher's agent
lines AGENT_TAIL_BYTES): a job that logged gigabytes costs the same as one that did not.
What no evidence shows stays ``None``; nothing is guessed.

The run loop (harness/run/runner.py) writes one ``process_exited`` event per ended process
after the teardown, when every file is final; the run record's ``ends`` and ``crash_loop``
are read back from those events (:func:`ends_of`, :func:`crash_loop`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aftershock.harness.run import _files
from aftershock.harness.run.records import Event, ProcessEnd

TAIL_BYTES = 64 * 1024  # read of a process's log or error file, from its end
AGENT_TAIL_BYTES = 1 << 20  # of the launcher's stderr: torchrun's lines of every attempt
SHOWN = 200  # characters of an exception line kept
FILE_TIME_SLACK_S = 1.0  # file times' granularity and the wall clock's slew against the launch
EXITED = "process_exited"

_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION = re.compile(r"^\w[\w.]*(Error|Exception|Exit|Interrupt)\b.*")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_FAILED = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) "
                     r"\(pid: (?P<pid>\d+)\)")
_CLOSING = re.compile(r"Sending process (?P<pid>\d+) closing signal (?P<sig>SIG[A-Z0-9]+)")
_SUMMARY = re.compile(r"exitcode\s*: (?P<code>-?\d+) \(pid: (?P<pid>\d+)\)")
_ATTEMPT = re.compile(r"attempt_(?P<attempt>\d+)/(?P<local>\d+)$")  # torchrun's layout
_LOG_DIR = re.compile(r"^--log[-_]dir(?:=(?P<value>.+))?$")
_STDLIB = re.compile(r"/lib/python\d+\.\d+/")

# What says how a process ended (ProcessEnd.evidence).
CHILD = "child"  # the launcher: the harness's own child, its exit status
TORCHRUN_EXIT = "torchrun exitcode"  # torchrun's `failed (exitcode: N) ... (pid: P)` line
TORCHRUN_SIGNAL = "torchrun closing signal"  # torchrun sent it a signal to end its attempt
ERROR_FILE = "error_file"  # the JSON torchrun's @record writes (TORCHELASTIC_ERROR_FILE)
LOG = "log"  # the last traceback in its own stderr
GONE = "gone"  # the harness saw its pid disappear
LATER_ATTEMPT = "later attempt"  # torchrun started the next attempt: this one had ended
LAUNCHER_EXIT = "launcher exit"  # the launcher exited by itself: nothing it started runs


@dataclass(frozen=True, slots=True)
class Raised:
    """The exception a traceback ends with, and where in the job's own code it was."""

    exception: str  # "EOFError: Ran out of input"
    where: str | None  # "in load_snapshot (train.py:31)": the last frame outside libraries


@dataclass(frozen=True, slots=True)
class LauncherExit:
    """The launcher as the run loop saw it end: ``exit_code`` None when it did not exit by
    itself (the run timed out, or was stopped once its load was served), ``t`` then."""

    pid: int | None
    exit_code: int | None
    t: float


def read_tail(path: str | Path, limit: int = TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a file, from its first whole line; "" if unreadable."""
    try:
        # The job's own file: never a FIFO waited on, a device or a link followed.
        with _files.open_regular(Path(path)) as handle:
            if handle is None:
                return ""
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - limit)
            handle.seek(start)
            data = handle.read(limit)
    except OSError:
        return ""
    if start:  # cut inside a line, whose beginning is not here
        newline = data.find(b"\n")
        data = data[newline + 1:] if newline >= 0 else b""
    return data.decode(errors="replace")


def last_exception(text: str) -> Raised | None:
    """The exception of the last Python traceback in ``text``: the first line after its
    frames that names an exception (a later line that looks like one is part of a
    multi-line message), with the last frame of the job's own code."""
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return None
    where: str | None = None
    for line in text[at + len(_TRACEBACK):].splitlines():
        frame = _FRAME.match(line)
        if frame is not None:
            if not _library(frame["path"]):
                where = f"in {frame['func']} ({os.path.basename(frame['path'])}:{frame['line']})"
            continue
        if _EXCEPTION.match(line):
            # "ChildFailedError:" with its message on the lines below: the name alone.
            text = line.strip()
            if re.fullmatch(r"[\w.]+:", text):
                text = text[:-1]
            return Raised(text[:SHOWN], where)
    return None


def _library(path: str) -> bool:
    """A frame of an installed package or the standard library, not of the job."""
    # A console script (.venv/bin/torchrun) is a package's too.
    return (path.startswith("<") or "/site-packages/" in path or "/dist-packages/" in path
            or "/bin/" in path or _STDLIB.search(path) is not None)


def error_file_exception(path: str | Path) -> Raised | None:
    """What torchrun's error file says was raised (torch's ``@record`` writes
    ``{"message": {"message": "EOFError: ...", "extraInfo": {"py_callstack": ...}}}``)."""
    try:
        if os.path.getsize(path) > TAIL_BYTES:
            return None  # a cut JSON document says nothing
    except OSError:
        return None
    try:
        data = json.loads(read_tail(path))
    except ValueError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    text, stack = message, None
    if isinstance(message, dict):
        text = message.get("message")
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    if not isinstance(text, str) or not text.strip():
        return None
    raised = last_exception(stack) if isinstance(stack, str) else None
    return Raised(text.strip().splitlines()[0][:SHOWN], raised.where if raised else None)


@dataclass
class _Agent:
    """What torchrun's agent said of its workers, by pid."""

    codes: dict[int, int] = field(default_factory=dict)  # its exit code
    first: set[int] = field(default_factory=set)  # named as its attempt's first failure
    sent: dict[int, str] = field(default_factory=dict)  # the signal torchrun sent it


def _agent_lines(text: str) -> _Agent:
    agent = _Agent()
    for line in text.splitlines():
        if (found := _FAILED.search(line)) is not None:
            agent.codes[int(found["pid"])] = int(found["code"])
            agent.first.add(int(found["pid"]))
        elif (found := _CLOSING.search(line)) is not None:
            agent.sent[int(found["pid"])] = found["sig"]
        elif (found := _SUMMARY.search(line)) is not None:
            agent.codes.setdefault(int(found["pid"]), int(found["code"]))
    return agent


@dataclass
class _Worker:
    attempt: int | None
    local_rank: int | None
    folder: str | None  # torchrun's attempt_N/<local rank> folder of it, where known
    pid: int | None = None
    rank: int | None = None
    agent: int | None = None
    stderr: str | None = None
    error_file: str | None = None
    started: float | None = None


def _folder(path: object) -> str | None:
    """The attempt_N/<local rank> folder a torchrun file of a worker lies in."""
    if not isinstance(path, str):
        return None
    folder = os.path.dirname(path)
    return folder if _ATTEMPT.search(folder) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _workers(events: Sequence[Event]) -> list[_Worker]:
    """Every worker of the run: those the harness saw start (``process_started``), and those
    torchrun's attempt folders show that died before the harness looked."""
    workers = [_started_worker(event) for event in events
               if event.event == "process_started" and event.fields.get("role") == "worker"]
    seen = {w.folder for w in workers if w.folder is not None}
    # torchrun's run folders: those of the workers seen, and any under a --log-dir that
    # this run wrote (an earlier run's, left in a reused folder, is older than its launch).
    patterns = {os.path.join(glob.escape(os.path.dirname(os.path.dirname(folder))),
                             "attempt_*", "*") for folder in seen}
    launched = _launch_folders(events, patterns)
    agents = {os.path.dirname(os.path.dirname(w.folder)): w.agent
              for w in workers if w.folder is not None}
    for pattern in sorted(patterns):
        for folder in sorted(glob.glob(pattern)):
            worker = _unseen_worker(folder, seen, agents, launched)
            if worker is not None:
                seen.add(folder)
                workers.append(worker)
    return workers


def _unseen_worker(folder: str, seen: set[str], agents: Mapping[str, int | None],
                   launched: float | None) -> _Worker | None:
    """The worker of a torchrun attempt folder the harness did not see start, if the folder
    is one and is this run's (its run folder is a seen worker's, or written since launch)."""
    found = _ATTEMPT.search(folder)
    if found is None or folder in seen or not os.path.isdir(folder):
        return None
    run = os.path.dirname(os.path.dirname(folder))
    if run not in agents and not _written_since(folder, launched):
        return None
    return _Worker(attempt=int(found["attempt"]), local_rank=int(found["local"]),
                   folder=folder, agent=agents.get(run))


def _started_worker(event: Event) -> _Worker:
    """The worker a ``process_started`` event of role ``worker`` names."""
    f = event.fields
    error_file = f.get("error_file") if isinstance(f.get("error_file"), str) else None
    stderr = f.get("stderr") if isinstance(f.get("stderr"), str) else None
    return _Worker(
        attempt=_int(f.get("generation")), local_rank=_int(f.get("local_rank")),
        folder=_folder(error_file) or _folder(stderr), pid=_int(f.get("pid")),
        rank=_int(f.get("rank")), agent=_int(f.get("agent")), stderr=stderr,
        error_file=error_file, started=event.t)


def _launch_folders(events: Sequence[Event], patterns: set[str]) -> float | None:
    """Add to ``patterns`` the attempt folders under each launch's ``--log-dir``; the
    last launch's wall-clock time, if it was recorded."""
    launched: float | None = None
    for event in events:
        if event.event == "launch":
            offset = event.fields.get("wall_offset")
            if isinstance(offset, int | float):
                launched = event.t + offset
            patterns.update(os.path.join(glob.escape(d), "*", "attempt_*", "*")
                            for d in _log_dirs(event.fields.get("argv")))
    return launched


def _written_since(folder: str, launched: float | None) -> bool:
    """Whether a folder got its files after the launch (wall clock, as file times are);
    unknown without the launch's wall-clock offset: then it is not taken for this run's."""
    if launched is None:
        return False
    try:
        return os.stat(folder).st_mtime >= launched - FILE_TIME_SLACK_S
    except OSError:
        return False


def _log_dirs(argv: object) -> list[str]:
    """torchrun's ``--log-dir`` in a launch's command line (``--log-dir=D`` or ``--log-dir
    D``): each attempt's files lie in ``D/<run id>/attempt_N/<local rank>/``."""
    if not isinstance(argv, list):
        return []
    found: list[str] = []
    for index, arg in enumerate(argv):
        match = _LOG_DIR.match(str(arg))
        if match is None:
            continue
        value = match["value"] if match["value"] is not None else (
            str(argv[index + 1]) if index + 1 < len(argv) else None)
        if value:
            found.append(value)
    return found


def process_exits(events: Sequence[Event], *, gone: Mapping[int, float],
                  launcher: LauncherExit | None, launcher_log: Path) -> list[Event]:
    """One ``process_exited`` event per process of the run that ended while it ran.

    ``gone``: worker pid -> when the harness first found it gone. Its ``t`` is the earliest
    upper bound the evidence gives on the end: the harness saw the pid gone, the next
    attempt of its launcher started, or the launcher exited. A worker of the last attempt
    with no such evidence was still running when the run ended (its teardown ended it)
    and gets none."""
    agent = _agent_lines(read_tail(launcher_log, AGENT_TAIL_BYTES))
    workers = _workers(events)
    by_group: dict[object, list[_Worker]] = {}
    for worker in workers:
        by_group.setdefault(_group(worker), []).append(worker)
    last_t = max((event.t for event in events), default=0.0)
    exits: list[Event] = []
    for group in by_group.values():
        for worker in group:
            ended = _worker_end(worker, group, agent, gone, launcher, last_t)
            if ended is not None:
                exits.append(ended)
    if launcher is not None and launcher.exit_code is not None:
        exits.append(_launcher_end(launcher, launcher_log))
    return exits


def _group(worker: _Worker) -> object:
    """The launcher whose attempts a worker belongs to: its torchrun run folder, else its
    agent's pid (each torchrun of a job counts its own restarts)."""
    if worker.folder is not None:
        return os.path.dirname(os.path.dirname(worker.folder))
    return worker.agent


def _worker_end(worker: _Worker, group: list[_Worker], agent: _Agent,
                gone: Mapping[int, float], launcher: LauncherExit | None,
                last_t: float) -> Event | None:
    evidence, times = _end_seen(worker, group, gone, launcher)
    pid = worker.pid
    code = agent.codes.get(pid) if pid is not None else None
    sent = agent.sent.get(pid) if pid is not None else None
    if code is not None:
        evidence.append(TORCHRUN_EXIT)
    elif sent is not None:
        evidence.append(TORCHRUN_SIGNAL)
    raised, log, said = _worker_exception(worker)
    evidence.extend(said)
    ended = {GONE, LATER_ATTEMPT, LAUNCHER_EXIT, TORCHRUN_EXIT, TORCHRUN_SIGNAL, ERROR_FILE}
    if not ended.intersection(evidence):
        return None  # still running when the run ended: the teardown ended it
    if not times:  # only torchrun's word or its error file: it ended before the run did
        times.append(launcher.t if launcher is not None else last_t)
    fields: dict[str, Any] = {
        "role": "worker", "pid": pid, "rank": worker.rank, "local_rank": worker.local_rank,
        "attempt": worker.attempt, "agent": worker.agent, "exit_code": code,
        # An exit code of its own outranks torchrun's closing signal: it had exited by then.
        "signal": _signal(code) if code is not None else sent,
        "exception": raised.exception if raised else None,
        "where": raised.where if raised else None, "log": log,
        "evidence": evidence, "root_cause": pid is not None and pid in agent.first}
    return Event(t=min(times), event=EXITED, source="harness",
                 fields={k: v for k, v in fields.items() if v is not None})


def _end_seen(worker: _Worker, group: list[_Worker], gone: Mapping[int, float],
              launcher: LauncherExit | None) -> tuple[list[str], list[float]]:
    """What shows, apart from torchrun's word, that ``worker`` ended, and when each did:
    its pid gone, a later attempt of its rank, the launcher's exit."""
    evidence: list[str] = []
    times: list[float] = []
    if worker.pid is not None and worker.pid in gone:
        times.append(gone[worker.pid])
        evidence.append(GONE)
    if worker.attempt is not None:
        later = [w.started for w in group if w.attempt is not None
                 and w.attempt > worker.attempt and w.started is not None]
        if later or any(w.attempt is not None and w.attempt > worker.attempt for w in group):
            times.extend(later)
            evidence.append(LATER_ATTEMPT)
    if launcher is not None and launcher.exit_code is not None:
        times.append(launcher.t)
        evidence.append(LAUNCHER_EXIT)
    return evidence, times


def _worker_exception(worker: _Worker) -> tuple[Raised | None, str | None, list[str]]:
    """The exception ``worker`` raised, the file that says so, and which evidence that is:
    torchrun's error file first, else the last traceback of its stderr."""
    error_file = worker.error_file or (os.path.join(worker.folder, "error.json")
                                       if worker.folder is not None else None)
    if error_file is not None and (raised := error_file_exception(error_file)) is not None:
        return raised, error_file, [ERROR_FILE]
    stderr = worker.stderr or (os.path.join(worker.folder, "stderr.log")
                               if worker.folder is not None else None)
    if stderr is not None:
        raised = last_exception(read_tail(stderr))
        if raised is not None:
            return raised, stderr, [LOG]
    return None, None, []


def _launcher_end(launcher: LauncherExit, log: Path) -> Event:
    raised = last_exception(read_tail(log))
    fields: dict[str, Any] = {
        "role": "launcher", "pid": launcher.pid, "exit_code": launcher.exit_code,
        "signal": _signal(launcher.exit_code),
        "exception": raised.exception if raised else None,
        "where": raised.where if raised else None,
        "log": str(log) if raised else None,
        "evidence": [CHILD, LOG] if raised else [CHILD]}
    return Event(t=launcher.t, event=EXITED, source="harness",
                 fields={k: v for k, v in fields.items() if v is not None})


def _signal(code: int | None) -> str | None:
    """The signal a negative exit status (Python's, torchrun's) stands for."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def ends_of(events: Iterable[Event]) -> tuple[ProcessEnd, ...]:
    """The run's ``process_exited`` events as records: workers by attempt and rank, then
    the launcher."""
    ends: list[ProcessEnd] = []
    for event in events:
        if event.event != EXITED:
            continue
        f = event.fields
        evidence = f.get("evidence")
        ends.append(ProcessEnd(
            role=str(f.get("role", "worker")), attempt=_int(f.get("attempt")),
            rank=_int(f.get("rank")), local_rank=_int(f.get("local_rank")),
            pid=_int(f.get("pid")), agent=_int(f.get("agent")),
            exit_code=_int(f.get("exit_code")), signal=_str(f.get("signal")),
            exception=_str(f.get("exception")), where=_str(f.get("where")),
            log=_str(f.get("log")),
            evidence=tuple(map(str, evidence)) if isinstance(evidence, list) else (),
            root_cause=f.get("root_cause") is True))
    return tuple(sorted(ends, key=_order))


def _order(end: ProcessEnd) -> tuple[int, int, int, int, int]:
    rank = end.rank if end.rank is not None else end.local_rank
    return (end.role == "launcher", end.agent or 0, -1 if end.attempt is None else end.attempt,
            -1 if rank is None else rank, end.pid or 0)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def how(end: ProcessEnd) -> str | None:
    """What ended it, as evidence shows: its exception (and where), else the signal that
    killed it, else a failing exit code; None for a clean or unexplained end, or one that
    only torchrun's closing signal explains (the consequence of another's failure)."""
    if end.exception is not None:
        return end.exception + (f", {end.where}" if end.where else "")
    if end.exit_code is not None and end.exit_code < 0:
        return end.signal
    if end.exit_code:
        return f"exit {end.exit_code}"
    return None


def describe(end: ProcessEnd) -> str:
    """``exit 1, EOFError: Ran out of input, in load (train.py:31)``."""
    parts: list[str] = []
    if end.exit_code is not None and end.exit_code >= 0:
        parts.append(f"exit {end.exit_code}")
    elif end.signal is not None and end.exit_code is None:
        parts.append(f"sent {end.signal} by torchrun")
    elif end.signal is not None:
        parts.append(f"killed by {end.signal}")
    if end.exception is not None:
        parts.append(end.exception + (f", {end.where}" if end.where else ""))
    return ", ".join(parts) or "how not observed"


def abnormal(end: ProcessEnd) -> bool:
    return (end.exception is not None or end.signal is not None
            or (end.exit_code is not None and end.exit_code != 0))


def summarize(events: Sequence[Event]) -> tuple[tuple[ProcessEnd, ...], str | None]:
    """The run record's ``ends`` and ``crash_loop``, from its timeline."""
    ends = ends_of(events)
    started = [(_int(e.fields.get("agent")), _int(e.fields.get("generation")))
               for e in events if e.event == "process_started"
               and e.fields.get("role") == "worker"]
    return ends, crash_loop(ends, started)


def crash_loop(ends: Sequence[ProcessEnd],
               started: Iterable[tuple[int | None, int | None]] = ()) -> str | None:
    """One line when every restart of a launcher ended the same way: "2 restarts, each
    ended by EOFError: Ran out of input, in load (train.py:31); so did the first attempt".
    None when a restart was still running at the end (``started``: (agent, attempt) of each
    worker seen to start), or ended otherwise or unexplained."""
    groups: dict[int | None, dict[int, list[ProcessEnd]]] = {}
    for agent, attempt in started:
        if attempt is not None:
            groups.setdefault(agent, {}).setdefault(attempt, [])
    for end in ends:
        if end.role == "worker" and end.attempt is not None:
            groups.setdefault(end.agent, {}).setdefault(end.attempt, []).append(end)
    several = len([a for a in groups if a is not None]) > 1
    lines: list[str] = []
    for agent, attempts in sorted(groups.items(), key=lambda item: item[0] or 0):
        line = _loop_line(attempts)
        if line is not None:
            lines.append(f"torchrun pid {agent}: {line}" if several and agent is not None
                         else line)
    return "; ".join(lines) or None


def _loop_line(attempts: Mapping[int, Sequence[ProcessEnd]]) -> str | None:
    """One launcher's crash loop in words, when every restart ended the same way."""
    last = max(attempts)
    if last < 1:
        return None
    causes = {attempt: _cause(attempts.get(attempt, [])) for attempt in range(last + 1)}
    restarts = [causes[attempt] for attempt in range(1, last + 1)]
    cause = restarts[0]
    if cause is None or any(c != cause for c in restarts):
        return None
    line = f"{last} restart{'s' if last > 1 else ''}, each ended by {cause}"
    first = causes[0]
    if first == cause:
        line += "; so did the first attempt"
    elif first is not None:
        line += f"; the first attempt ended by {first}"
    return line


def _cause(ends: Sequence[ProcessEnd]) -> str | None:
    """What ended an attempt: torchrun's first failure's end, else the first explained."""
    for end in sorted(ends, key=lambda e: (not e.root_cause, _order(e))):
        found = how(end)
        if found is not None:
            return found
    return None


def report_lines(ends: Sequence[ProcessEnd]) -> list[str]:
    """Per attempt that ended abnormally, how each of its processes ended; the launcher
    when it did not exit 0. A clean run gets none."""
    attempts: dict[tuple[int | None, int | None], list[ProcessEnd]] = {}
    for end in ends:
        if end.role == "worker":
            attempts.setdefault((end.agent, end.attempt), []).append(end)
    agents = {agent for agent, _ in attempts if agent is not None}
    lines: list[str] = []
    for (agent, attempt), members in attempts.items():
        if not any(abnormal(e) for e in members):
            continue
        label = f"attempt {attempt}" if attempt is not None else "worker"
        if len(agents) > 1 and agent is not None:  # several torchruns: say whose
            label += f" (torchrun pid {agent})"
        lines.append(f"{label}: {_alike(members)}")
    for end in ends:
        if end.role != "worker" and abnormal(end):
            pid = f" (pid {end.pid})" if end.pid is not None else ""
            lines.append(f"{end.role}{pid}: {describe(end)}")
    return lines


def _alike(members: Sequence[ProcessEnd]) -> str:
    """How an attempt's processes ended; those that ended alike share one entry: "ranks 0,
    1 (pids 7, 8) exit 1, ..."."""
    alike: dict[str, list[ProcessEnd]] = {}
    for end in members:
        alike.setdefault(describe(end), []).append(end)
    return "; ".join(f"{_whom(same)} {said}" for said, same in alike.items())


def _whom(ends: Sequence[ProcessEnd]) -> str:
    if len(ends) == 1:
        return _who(ends[0])
    ranks = [e.rank if e.rank is not None else e.local_rank for e in ends]
    pids = [e.pid for e in ends if e.pid is not None]
    who = (f"ranks {', '.join(map(str, ranks))}" if None not in ranks else f"{len(ends)} workers")
    return who + (f" (pids {', '.join(map(str, pids))})" if pids else "")


def _who(end: ProcessEnd) -> str:
    if end.role != "worker":
        who = end.role
    else:
        who = (f"rank {end.rank}" if end.rank is not None else
               f"local rank {end.local_rank}" if end.local_rank is not None else "a worker")
    return who + (f" (pid {end.pid})" if end.pid is not None else "")


def line(event: Event) -> str:
    """A ``process_exited`` event as the live view's line: "rank 1 (pid 4243) of attempt 2
    ended: exit 1, EOFError: Ran out of input, in load (train.py:31)"."""
    end = ends_of([event])[0]
    attempt = f" of attempt {end.attempt}" if end.attempt is not None else ""
    return f"{_who(end)}{attempt} ended: {describe(end)}"
