"""A recorded run folder, read back: its record, timeline, scenario and process logs.

What `aftershock run` leaves (README, "What the report means") is all a report, a
trace or a re-check needs: ``result.json``, ``events.jsonl``, ``scenario.yaml`` and
``logs/``. Nothing here launches anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.errors import SpecError
from harness.logprobe import TIMES_SUFFIX  # X.log.times: per-line offset and capture time
from harness.records import Event, RunResult
from harness.timeline import read_events

#: Bytes of one process log kept in a report; the rest is named, not shown.
LOG_SHOWN = 256 * 1024


@dataclass(frozen=True, slots=True)
class LogLine:
    text: str
    t: float | None  # when the harness read it (monotonic), where the run recorded that


@dataclass(frozen=True, slots=True)
class ProcessLog:
    name: str  # path under the run's logs/ folder
    path: Path
    size: int

    def lines(self) -> list[LogLine]:
        """Every line, with its capture time where ``<log>.times`` has one."""
        raw = self.path.read_bytes()
        times = _capture_times(Path(str(self.path) + TIMES_SUFFIX))
        lines: list[LogLine] = []
        offset = 0
        for chunk in raw.split(b"\n"):
            if offset < len(raw) or chunk:
                lines.append(LogLine(chunk.decode(errors="replace"), times.get(offset)))
            offset += len(chunk) + 1
        return lines


def _capture_times(path: Path) -> dict[int, float]:
    times: dict[int, float] = {}
    try:
        text = path.read_text()
    except OSError:
        return times
    for row in text.splitlines():
        parts = row.split()
        try:
            times[int(parts[0])] = float(parts[1])
        except (IndexError, ValueError):
            continue  # a torn last row: that line has no capture time
    return times


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
        """Each non-empty process log under ``logs/`` (the launcher's streams first)."""
        folder = self.path / "logs"
        found = [p for p in folder.rglob("*.log") if p.is_file()] if folder.is_dir() else []
        found.sort(key=lambda p: (not p.name.startswith("launcher."), str(p)))
        return [ProcessLog(str(p.relative_to(folder)), p, p.stat().st_size)
                for p in found if p.stat().st_size > 0]


def read_result(path: Path) -> RunResult:
    """``result.json`` as a RunResult, typed like the record's dataclasses, so a damaged field
    is an error here, not a traceback halfway through a table; a key this version does not know
    is left out (a newer harness may record more)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(RunResult).validate_json(path.read_bytes())
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
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SpecError([f"{record}:1:1: not a recorded run ({exc})"]) from None
    timeline = path / "events.jsonl"
    events = read_events(timeline) if timeline.exists() else []
    scenario = path / "scenario.yaml"
    text = scenario.read_text(errors="replace") if scenario.exists() else None
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
