"""A recorded run folder, read back: its record, timeline, scenario and process logs.

What `aftershock run` leaves (README, "What the report means") is all a report, a
trace or a re-check needs: ``result.json``, ``events.jsonl``, ``scenario.yaml`` and
``logs/``. Nothing here launches anything; :func:`claimed` holds a folder for the one run
that writes it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aftershock.harness.errors import RunDirBusy, SpecError
from aftershock.harness.run import _files
from aftershock.harness.run.logprobe import (
    TIMES_SUFFIX,  # X.log.times: per-line offset and capture time
)
from aftershock.harness.run.records import Event, RunResult
from aftershock.harness.run.timeline import read_events

#: Bytes of one process log kept in a report; the rest is named, not shown.
LOG_SHOWN = 256 * 1024
#: The largest ``result.json`` read (a run's record is a few KiB to a few hundred).
RESULT_LIMIT = 16 << 20
#: The largest ``scenario.yaml`` read: what the harness accepts as a scenario file.
SCENARIO_LIMIT = 256 * 1024


@dataclass(frozen=True, slots=True)
class LogLine:
    text: str
    t: float | None  # when the harness read it (monotonic), where the run recorded that


@dataclass(frozen=True, slots=True)
class ProcessLog:
    name: str  # path under the run's logs/ folder
    path: Path
    size: int
    refused: str | None = None  # why it is not read (a link out of the run folder, ...)

    def lines(self, start: int = 0) -> Iterator[LogLine]:
        """Each line from byte ``start`` on, streamed, with its capture time where
        ``<log>.times`` has one (both files are read in offset order, side by side, so
        memory does not grow with either)."""
        if self.refused is not None:
            return
        times = _capture_times(Path(str(self.path) + TIMES_SUFFIX))
        row = next(times, None)
        for offset, raw in _files.lines(self.path, start=start, line_limit=LINE_READ,
                                        total_limit=LOG_READ):
            while row is not None and row[0] < offset:
                row = next(times, None)
            t = row[1] if row is not None and row[0] == offset else None
            yield LogLine(raw.decode(errors="replace"), t)

    def tail(self, max_bytes: int, max_lines: int) -> tuple[list[LogLine], int]:
        """The last lines, at most ``max_lines`` of them within the last ``max_bytes``
        bytes (where a crash says why), and how many bytes before them are not shown."""
        start = max(0, self.size - max_bytes)
        kept: collections.deque[tuple[int, LogLine]] = collections.deque(maxlen=max_lines)
        lines = _files.lines(self.path, start=start, line_limit=LINE_READ,
                             total_limit=max_bytes) if self.refused is None else iter(())
        first = True
        for offset, raw in lines:
            if first and start > 0 and not _at_line_start(self.path, start):
                first = False
                continue  # the end of a line that began before the shown part
            first = False
            kept.append((offset, LogLine(raw.decode(errors="replace"), None)))
        if not kept:
            return [], self.size
        times = dict(_capture_times(Path(str(self.path) + TIMES_SUFFIX), since=kept[0][0]))
        shown = [LogLine(line.text, times.get(offset)) for offset, line in kept]
        return shown, kept[0][0]


#: A line of a saved log longer than this is read only up to it (as the probes saw it).
LINE_READ = 64 * 1024
#: Bytes of one saved log (or its ``.times``) read at most: the cap the run wrote it under.
LOG_READ = 1 << 30


def _at_line_start(path: Path, offset: int) -> bool:
    with _files.open_regular(path) as handle:
        if handle is None:
            return True
        handle.seek(offset - 1)
        return handle.read(1) == b"\n"


def _capture_times(path: Path, since: int = 0) -> Iterator[tuple[int, float]]:
    """``(offset, read time)`` rows of a ``.times`` file, streamed, from offset ``since``
    on; a torn or malformed row is passed over (that line has no capture time)."""
    for _, row in _files.lines(path, line_limit=256, total_limit=LOG_READ):
        parts = row.split()
        try:
            offset, t = int(parts[0]), float(parts[1])
        except (IndexError, ValueError):
            continue
        if offset >= since:
            yield offset, t


@contextlib.contextmanager
def claimed(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for one run: an exclusive lock on the folder itself (flock), which
    the kernel drops when the run's process ends however it ends, so a crashed run never
    leaves the folder held. A second run that finds it held raises RunDirBusy, before it
    cleans or writes anything there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(f"{run_dir}: another run is using this run folder; give another "
                             "--run-dir, or wait until that run has ended") from None
        yield
    finally:
        os.close(fd)


#: Where ``result.json`` is written before it is renamed into place.
RESULT_STAGED = ".result.json.partial"


def write_result(run_dir: Path, result: RunResult) -> Path:
    """Write the run's ``result.json`` whole or not at all: written beside it, then renamed
    over it, so a full disk (or a harness killed mid-write) never leaves an empty or cut
    record. Raises OSError when it could not be written."""
    path, staged = run_dir / "result.json", run_dir / RESULT_STAGED
    try:
        staged.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise
    return path


@dataclass(frozen=True, slots=True)
class RecordedRun:
    path: Path
    result: RunResult
    events: list[Event]
    scenario_text: str | None

    @property
    def launch(self) -> Event | None:
        return next((e for e in self.events if e.event == "launch"), None)

    @property
    def t0(self) -> float:
        """The run's zero: its launch (or its first event)."""
        launch = self.launch
        if launch is not None:
            return launch.t
        return self.events[0].t if self.events else 0.0

    @property
    def wall_offset(self) -> float | None:
        """Wall clock minus monotonic clock at launch; None for runs recorded before the
        launch event carried it."""
        launch = self.launch
        value = launch.fields.get("wall_offset") if launch is not None else None
        return float(value) if isinstance(value, int | float) else None

    def logs(self) -> list[ProcessLog]:
        """Each non-empty process log under ``logs/`` (the launcher's streams first), and
        each ``*.log`` there that is not read, with why: a link (out of the run folder in
        particular) is named, never followed; a FIFO or device is never opened."""
        folder = self.path / "logs"
        found: list[ProcessLog] = []
        for root, dirs, files in os.walk(folder):  # os.walk follows no linked folder
            for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(root, d)))]:
                if not name.endswith(".log"):
                    continue
                path = Path(root) / name
                why = _files.refusal(path, within=self.path)
                size = 0 if why is not None else path.lstat().st_size
                if why is not None or size > 0:
                    found.append(ProcessLog(str(path.relative_to(folder)), path, size, why))
        found.sort(key=lambda log: (not log.path.name.startswith("launcher."), str(log.path)))
        return found


def read_result(path: Path) -> RunResult:
    """``result.json`` as a RunResult, typed like the record's dataclasses, so a damaged field
    is an error here, not a traceback halfway through a table; a key this version does not know
    is left out (a newer harness may record more)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        data = _files.read_capped(path, RESULT_LIMIT, what="a run record")
        return TypeAdapter(RunResult).validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "record"
        raise ValueError(f"{exc.error_count()} problem(s); {where}: {first['msg']}") from None


def load_run(path: Path) -> RecordedRun:
    """Read a run folder; a folder that is not one is a SpecError naming what is missing."""
    record = path / "result.json"
    try:
        result = read_result(record)
    except FileNotFoundError:
        raise SpecError([f"{path}:1:1: not a run folder (no result.json)"]) from None
    except _files.Refused as exc:
        raise SpecError([f"{record}:1:1: not read ({exc})"]) from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SpecError([f"{record}:1:1: not a recorded run ({exc})"]) from None
    timeline = path / "events.jsonl"
    events = read_events(timeline) if os.path.lexists(timeline) else []
    scenario = path / "scenario.yaml"
    try:
        text = (_files.read_capped(scenario, SCENARIO_LIMIT, what="a scenario file")
                .decode(errors="replace") if os.path.lexists(scenario) else None)
    except (_files.Refused, OSError) as exc:
        raise SpecError([f"{scenario}:1:1: not read ({exc})"]) from None
    return RecordedRun(path=path, result=result, events=events, scenario_text=text)


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders among ``paths``: each given folder that has ``result.json``, else the
    folders below it that do (``--run-dir`` of a ``--repeat`` holds one per attempt)."""
    found: list[Path] = []
    for path in paths:
        if (path / "result.json").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.glob("*/result.json")) if path.is_dir() else []
        if not below:
            raise SpecError([f"{path}:1:1: not a run folder (no result.json in it or in the "
                             "folders below it)"])
        found.extend(below)
    return found
