"""Searchers of one exploration that run at once and share one hypothesis example database:
``aftershock explore --workers N``, side by side on this machine, or as the tasks of one
Slurm array job with ``--executor slurm`` (harness/nodes/slurm_explore.py).

Each searcher is an ordinary ``explore()`` of the scenario with a seed of its own, in a
process of its own (``python -m aftershock.harness.search.team <folder> <index>``). The first
searcher to confirm a failure claims it (a file created with O_EXCL beside the database)
and shrinks it, as a lone explore does; the others stop searching and replay what the
database then holds, read only, without shrinking: a failure is shrunk once. The harness
that started them reads each searcher's record and gives the output a lone explore gives:
the minimal failing schedule, written under ``--out``, and the counts, with each searcher's
part.

Seeds: searcher 0 searches with the user's seed, so it draws exactly the schedules a lone
``aftershock explore --seed S`` draws; searcher k with ``(S + k * 0x9E3779B9) mod 2**32``
(odd step: N searchers get N distinct seeds, and none is S + 1, which a user tries next).
The finding names the seed that found it, and a lone explore with that seed finds and
shrinks the same schedule.

Side by side, the fault-free twin is run (or read from the cache) once, before the
searchers start, and each reads it from the cache. A searcher whose harness dies takes its
searcher's runs with it (``PR_SET_PDEATHSIG``): each unwinds its faults as on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypothesis.database import ExampleDatabase

from aftershock.harness.errors import AftershockError, HarnessError
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search.explore import (
    Attempt,
    Exploration,
    ExploreObserver,
    Finding,
    NullExploreObserver,
    Searcher,
    prepare_twin,
)

#: The odd step between searchers' seeds (2**32 / golden ratio): distinct modulo 2**32.
SEED_STEP = 0x9E3779B9


def searcher_seeds(seed: int, workers: int) -> list[int]:
    """The hypothesis seed of each searcher: the user's first, then one step apart each."""
    return [(seed + k * SEED_STEP) % 2**32 for k in range(workers)]


@dataclass(frozen=True, slots=True)
class Plan:
    """What each searcher of one exploration is to do (``plan.json`` in its folder)."""

    scenario: str  # absolute: the path the database's folder is keyed by, on every node
    seeds: tuple[int, ...]
    runs: int
    time_limit_s: float | None
    max_faults: int | None
    database: str
    shrink_runs: int
    confirm: int
    use_cache: bool

    @classmethod
    def read(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        return cls(**{**data, "seeds": tuple(data["seeds"])})


def _value_name(value: bytes) -> str:
    """A database value's file name in a DirectoryBasedExampleDatabase (its ``_hash``)."""
    return hashlib.sha384(value).hexdigest()[:16]


class _Ledger(ExampleDatabase):
    """The shared database, noting which values this searcher saved and which it read
    (another searcher's): the evidence of what was shared. It does not read back what it
    saved itself: hypothesis saves the example under way when a BaseException ends its run
    (_FoundElsewhere), and a replay is of the others' failures, not of its own."""

    def __init__(self, db: ExampleDatabase) -> None:
        super().__init__()
        self._db = db
        self.saved: list[str] = []
        self.read: list[str] = []

    def fetch(self, key: bytes) -> Iterable[bytes]:
        for value in self._db.fetch(key):
            name = _value_name(value)
            if name in self.saved:
                continue
            if name not in self.read:
                self.read.append(name)
            yield value

    def save(self, key: bytes, value: bytes) -> None:
        self._db.save(key, value)
        if _value_name(value) not in self.saved:
            self.saved.append(_value_name(value))

    def delete(self, key: bytes, value: bytes) -> None:
        self._db.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._db.move(src, dest, value)


class FileTeam:
    """A searcher's place in its team, through files in a folder every searcher sees."""

    def __init__(self, folder: Path, index: int) -> None:
        self.claim_file = folder / "claim"
        self.index = index
        self.ledger: _Ledger | None = None
        self.claimed = False

    def share(self, database: ExampleDatabase) -> ExampleDatabase:
        self.ledger = _Ledger(database)
        return self.ledger

    def claim(self) -> bool:
        try:
            # O_EXCL: one creator, however many confirm a failure at once (NFSv3 and later
            # keep it atomic, as a local filesystem does).
            fd = os.open(self.claim_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{self.index}\n")
        self.claimed = True
        return True

    def claimed_elsewhere(self) -> bool:
        return not self.claimed and self.claim_file.exists()


def _worker_record(root: Path, index: int) -> Path:
    return root / f"searcher-{index}.json"


def progress_file(root: Path, index: int) -> Path:
    """Where searcher ``index`` adds a line of JSON (an Attempt) as each of its runs ends."""
    return root / f"searcher-{index}.runs.jsonl"


class _Progress(NullExploreObserver):
    """A searcher's observer: its plain lines on stdout, and each finished run as a line of
    JSON in its progress file, which the harness that started it shows as it comes."""

    def __init__(self, plain: ExploreObserver, path: Path) -> None:
        self.plain = plain
        self.path = path

    def started(self, exploration: Exploration, *, time_limit_s: float | None,
                shrink_runs: int) -> None:
        self.plain.started(exploration, time_limit_s=time_limit_s, shrink_runs=shrink_runs)

    def finished_run(self, attempt: Attempt) -> None:
        self.plain.finished_run(attempt)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(asdict(attempt)) + "\n")

    def note(self, text: str) -> None:
        self.plain.note(text)

    def done(self, exploration: Exploration) -> None:
        self.plain.done(exploration)


def _die_with(parent: int) -> None:
    """SIGTERM this searcher when ``parent`` (the harness that started it) ends, whatever
    ends it: the searcher unwinds its run's faults as on Ctrl-C."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str]) -> int:
    """One searcher: ``python -m aftershock.harness.search.team <exploration folder> <index>
    [<pid of the harness it dies with>]``."""
    from rich.console import Console

    from aftershock.harness.reporting.report import ExplorePlainObserver
    from aftershock.harness.scenario.load import load_scenario
    from aftershock.harness.search.explore import explore, sigterm_unwinds

    root, index = Path(argv[0]), int(argv[1])
    plan = Plan.read(root / "plan.json")
    team = FileTeam(root, index)
    done: list[Exploration] = []
    error, code = "", 0
    try:
        with sigterm_unwinds():
            if len(argv) > 2:
                _die_with(int(argv[2]))
            explore(load_scenario(Path(plan.scenario)), runs=plan.runs,
                    time_limit_s=plan.time_limit_s, seed=plan.seeds[index],
                    max_faults=plan.max_faults, out=root / f"searcher-{index}",
                    database=Path(plan.database), shrink_runs=plan.shrink_runs,
                    confirm=plan.confirm, use_cache=plan.use_cache,
                    observer=_Progress(ExplorePlainObserver(Console(width=200)),
                                       progress_file(root, index)),
                    sink=done, team=team)
    except KeyboardInterrupt:
        code = 130
    except AftershockError as exc:
        error, code = f"{type(exc).__name__}: {exc}", 3
    finally:
        ledger = team.ledger
        record = {"exploration": done[0].to_json() if done else None,
                  "search_s": done[0].search_s if done else 0.0, "shrank": team.claimed,
                  "saved": ledger.saved if ledger else [], "read": ledger.read if ledger else [],
                  "error": error}
        path = _worker_record(root, index)
        path.with_suffix(".tmp").write_text(json.dumps(record, indent=1) + "\n")
        path.with_suffix(".tmp").replace(path)  # whole or absent, for the harness
    return code


def most_faults(loaded: LoadedScenario, max_faults: int | None) -> int:
    """The most faults a schedule of the search has (each searcher says it again)."""
    from aftershock.harness.search import strategies

    try:
        return strategies.space_of(loaded.spec, max_faults=max_faults).faults[1]
    except ValueError:
        return max_faults or 0  # the searchers refuse the space, each naming why


def searcher_line(s: Searcher) -> str:
    part = ("shrank the failure" if s.shrank else
            f"replayed another's failure ({s.replays_failed} failed, {s.replays_passed} "
            "passed)" if s.stopped == "replayed" else f"stopped: {s.stopped}")
    return f"searcher {s.index} (seed {s.seed}): {s.runs} runs, {part}" + (
        f"; error: {s.error}" if s.error else "")


def gather(team: Exploration, root: Path, seeds: Sequence[int], *, out: Path,
           output_of: Callable[[int], Path], strict: bool) -> None:
    """Fill ``team`` from each searcher's record: every attempt, the finding of the one that
    shrank (its scenario copied under ``out`` as a local explore writes it), the counts.
    ``strict``: a missing record or a searcher's error is a HarnessError."""
    findings: list[tuple[bool, int, Finding]] = []
    slowest = 0.0
    for index, record in _records(root, seeds, output_of=output_of, strict=strict):
        findings += _add_searcher(team, index, seeds[index], record)
        slowest = max(slowest, float(record.get("search_s", 0.0)))
    team.search_s = slowest  # runs per minute of the team: its runs over the slowest's time
    team.elapsed_s = time.monotonic() - team.started
    errors = [s for s in team.searchers if s.error]
    if strict and errors:
        raise HarnessError("; ".join(f"searcher {s.index} (seed {s.seed}): {s.error}"
                                     for s in errors))
    # The finding of the searcher that shrank; else (none confirmed a failure) the
    # smallest flaky one, as a local explore reports the smallest that failed once.
    findings.sort(key=lambda item: (not item[0], item[2].faults, item[1]))
    if findings:
        finding = findings[0][2]
        written = out / Path(finding.file).name
        written.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(finding.file, written)
        team.findings.append(dataclasses.replace(finding, file=str(written)))
    stops = {s.stopped for s in team.searchers}
    team.stopped = ("found" if findings and findings[0][0] else "interrupted"
                    if "interrupted" in stops else "time" if "time" in stops else "budget")


def _records(root: Path, seeds: Sequence[int], *, output_of: Callable[[int], Path],
             strict: bool) -> list[tuple[int, dict[str, Any]]]:
    """Each searcher's record, by index; one that left none is skipped (an error if
    ``strict``, with the searcher's output)."""
    records: list[tuple[int, dict[str, Any]]] = []
    for index in range(len(seeds)):
        path = _worker_record(root, index)
        try:
            records.append((index, json.loads(path.read_text())))
        except (OSError, ValueError) as exc:
            if strict:
                raise HarnessError(
                    f"searcher {index} (seed {seeds[index]}) left no record at {path} ({exc});"
                    f" its output: {output_of(index)}") from None
    return records


def _add_searcher(team: Exploration, index: int, seed: int,
                  record: dict[str, Any]) -> list[tuple[bool, int, Finding]]:
    """Add one searcher's attempts and its :class:`Searcher` line to ``team``; returns its
    findings, each with whether it shrank and its index."""
    data = record["exploration"] or {}
    attempts = [dataclasses.replace(_attempt(a), searcher=index)
                for a in data.get("attempts", [])]
    team.attempts.extend(attempts)
    if index == 0 or not team.twin:
        team.twin = data.get("twin", team.twin)
        team.max_faults = data.get("max_faults", team.max_faults)
    replays = [a for a in attempts if a.stage == "replay"]
    team.searchers.append(Searcher(
        index=index, seed=seed, runs=len(attempts),
        stopped=data.get("stopped", "") or ("error" if record["error"] else ""),
        shrank=bool(record["shrank"]),
        replays_failed=sum(a.verdict == "fail" for a in replays),
        replays_passed=sum(a.verdict == "pass" for a in replays),
        saved=tuple(record["saved"]), read=tuple(record["read"]), error=record["error"]))
    return [(bool(record["shrank"]), index, _finding(f)) for f in data.get("findings", [])]


def _attempt(data: dict[str, Any]) -> Attempt:
    return Attempt(**{**data, "failed": tuple(data["failed"])})


def _finding(data: dict[str, Any]) -> Finding:
    return Finding(**{**data, "failed_checks": tuple(data["failed_checks"])})


#: How long searchers told to stop (SIGTERM) may take to unwind their runs' faults and
#: write their records before they are killed (their reapers then undo what is left).
STOP_GRACE_S = 60.0
#: How often the harness looks for searchers' finished runs and ends.
POLL_S = 0.2


def explore_side_by_side(
    loaded: LoadedScenario,
    *,
    workers: int,
    runs: int = 30,
    time_limit_s: float | None = None,
    seed: int = 0,
    max_faults: int | None = None,
    out: Path = Path(".aftershock") / "explore",
    database: Path | None = Path(".aftershock") / "hypothesis",
    shrink_runs: int = 20,
    confirm: int = 1,
    use_cache: bool = True,
    observer: ExploreObserver | None = None,
    sink: list[Exploration] | None = None,
) -> Exploration:
    """Explore ``loaded`` with ``workers`` searchers as processes of this machine sharing
    ``database`` (None: one of their own, removed after); the Exploration a lone explore()
    returns, with every searcher's runs and ``searchers`` filled. ``runs``,
    ``time_limit_s`` and ``shrink_runs`` are each searcher's. On Ctrl-C or SIGTERM the
    searchers are stopped and waited for, and what they found so far is gathered."""
    observer = observer or NullExploreObserver()
    exploration_id = uuid.uuid4().hex
    root = (out / "team" / f"{loaded.spec.name[:60]}-{exploration_id[:12]}").absolute()
    root.mkdir(parents=True, exist_ok=True)
    shared = database.absolute() if database is not None else root / "hypothesis"
    seeds = searcher_seeds(seed, workers)
    team = Exploration(loaded.spec.name, str(loaded.path), seed, runs,
                       most_faults(loaded, max_faults), workers=workers)
    if sink is not None:
        sink.append(team)
    observer.started(team, time_limit_s=time_limit_s, shrink_runs=shrink_runs)
    observer.note(f"{workers} searchers side by side, seeds {', '.join(map(str, seeds))}, "
                  "sharing " + (str(database) if database is not None else
                                "an example database of their own (removed after)"))
    # Once for the team: each searcher then reads it from the cache.
    team.twin = prepare_twin(loaded, out=out, use_cache=use_cache, observer=observer)
    plan = Plan(str(loaded.path.absolute()), tuple(seeds), runs, time_limit_s, max_faults,
                str(shared), shrink_runs, confirm, True)
    (root / "plan.json").write_text(json.dumps(asdict(plan), indent=1) + "\n")

    def output_of(index: int) -> Path:
        return root / f"searcher-{index}.out"

    searchers: list[subprocess.Popen[bytes]] = []
    try:
        for k in range(workers):
            with open(output_of(k), "wb") as output:
                searchers.append(subprocess.Popen(
                    [sys.executable, "-m", "aftershock.harness.search.team", str(root), str(k),
                     str(os.getpid())], stdin=subprocess.DEVNULL, stdout=output,
                    # A group of its own: a terminal's Ctrl-C reaches this harness only,
                    # which then tells each searcher once (a second signal would land in
                    # the searcher's unwinding).
                    stderr=subprocess.STDOUT, process_group=0))
        _follow(searchers, root, team, observer)
    except BaseException:
        _stop(searchers)
        team.attempts.clear()  # each searcher's record holds them all
        with contextlib.suppress(HarnessError, OSError, ValueError, KeyError, TypeError):
            gather(team, root, seeds, out=out, output_of=output_of, strict=False)
        team.stopped = "interrupted"
        raise
    finally:
        if database is None:
            shutil.rmtree(shared, ignore_errors=True)
    twin = team.twin
    team.attempts.clear()  # each searcher's record holds them all, in its order
    gather(team, root, seeds, out=out, output_of=output_of, strict=True)
    team.twin = twin
    for searcher in team.searchers:
        observer.note(searcher_line(searcher))
    observer.done(team)
    return team


def _follow(searchers: Sequence[subprocess.Popen[bytes]], root: Path, team: Exploration,
            observer: ExploreObserver) -> None:
    """Show each searcher's runs as they end, until every searcher has ended."""
    seen = [0] * len(searchers)
    while True:
        alive = [p.poll() is None for p in searchers]
        for index in range(len(searchers)):
            for attempt in _new_attempts(progress_file(root, index), seen, index):
                team.attempts.append(attempt)
                observer.finished_run(attempt)
        if not any(alive):
            return
        time.sleep(POLL_S)


def _new_attempts(path: Path, seen: list[int], index: int) -> list[Attempt]:
    """The runs searcher ``index`` finished since the last look (whole lines only)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(seen[index])
            chunk = handle.read()
    except FileNotFoundError:
        return []
    whole = chunk[:chunk.rfind(b"\n") + 1]
    seen[index] += len(whole)
    found = []
    for line in whole.splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            found.append(dataclasses.replace(_attempt(json.loads(line)), searcher=index))
    return found


def _stop(searchers: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every searcher still running and wait for it (it unwinds its run's faults
    and writes its record); one still running after STOP_GRACE_S is killed."""
    for process in searchers:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in searchers:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
