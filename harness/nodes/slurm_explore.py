"""Explorations fanned out over a Slurm cluster: ``aftershock explore --executor slurm``.

N searchers run at once, each a task of one array job (submitted, waited for, cancelled and
journalled by harness/nodes/slurm_campaign.py's ``run_array``), each an ordinary
``explore()`` of the scenario with a seed of its own, and all of them share ONE hypothesis
example database (a DirectoryBasedExampleDatabase on the storage every node mounts). The
first searcher to confirm a failure claims it (a file created with O_EXCL beside the
database) and shrinks it, as a local explore does; the others stop searching and replay
what the database then holds, read only, without shrinking: a failure is shrunk once, and
re-run on other nodes. The submitting harness reads each searcher's record and gives the
output a local explore gives: the minimal failing schedule, written under ``--out``, and
the counts, with each searcher's part.

Seeds: searcher 0 searches with the user's seed, so it draws exactly the schedules a local
``aftershock explore --seed S`` draws; searcher k with ``(S + k * 0x9E3779B9) mod 2**32``
(odd step: N searchers get N distinct seeds, and none is S + 1, which a user tries next).
The finding names the seed that found it, and a local explore with that seed finds and
shrinks the same schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypothesis.database import ExampleDatabase

from aftershock.faults import slurm_cli as slurm
from aftershock.harness.errors import AftershockError, HarnessError
from aftershock.harness.nodes.slurm_campaign import run_array, task_output, task_script
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search.explore import (
    Attempt,
    Exploration,
    ExploreObserver,
    Finding,
    NullExploreObserver,
    Searcher,
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


def main(argv: Sequence[str]) -> int:
    """One searcher, as an array task runs it: ``python -m
    aftershock.harness.nodes.slurm_explore <exploration folder> <index>``."""
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
            explore(load_scenario(Path(plan.scenario)), runs=plan.runs,
                    time_limit_s=plan.time_limit_s, seed=plan.seeds[index],
                    max_faults=plan.max_faults, out=root / f"searcher-{index}",
                    database=Path(plan.database), shrink_runs=plan.shrink_runs,
                    confirm=plan.confirm, use_cache=plan.use_cache,
                    observer=ExplorePlainObserver(Console(width=200)), sink=done, team=team)
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
        path.with_suffix(".tmp").replace(path)  # whole or absent, for the submitter
    return code


def explore_on_slurm(
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
    """Explore ``loaded`` with ``workers`` searchers as one Slurm array job sharing
    ``database``; the Exploration a local explore() returns, with every searcher's runs and
    ``searchers`` filled. ``runs``, ``time_limit_s`` and ``shrink_runs`` are each
    searcher's. ``out`` and ``database`` must be on storage every node mounts (the scenario
    file too). HarnessError when Slurm cannot take the job or a searcher left no record."""
    problem = slurm.problem()
    if problem is not None:
        raise HarnessError(f"--executor slurm: {problem}")
    if database is None:
        raise HarnessError("--executor slurm: the searchers share failures through the "
                           "example database; run without --no-db")
    observer = observer or NullExploreObserver()
    exploration_id = uuid.uuid4().hex
    root = (out / "slurm" / f"{loaded.spec.name[:60]}-{exploration_id[:12]}").absolute()
    root.mkdir(parents=True, exist_ok=True)
    seeds = searcher_seeds(seed, workers)
    plan = Plan(str(loaded.path.absolute()), tuple(seeds), runs, time_limit_s, max_faults,
                str(database.absolute()), shrink_runs, confirm, use_cache)
    (root / "plan.json").write_text(json.dumps(asdict(plan), indent=1) + "\n")
    script = root / "explore.sh"
    script.write_text(task_script([
        ([sys.executable, "-m", "aftershock.harness.nodes.slurm_explore", str(root), str(k)],
         root / f"searcher-{k}") for k in range(workers)]))
    team = Exploration(loaded.spec.name, str(loaded.path), seed, runs,
                       _most_faults(loaded, max_faults))
    if sink is not None:
        sink.append(team)
    observer.started(team, time_limit_s=time_limit_s, shrink_runs=shrink_runs)
    observer.note(f"{workers} searcher(s), seeds {', '.join(map(str, seeds))}, sharing "
                  f"{database}")
    job_id = ""

    def say(line: str) -> None:
        nonlocal job_id
        observer.note(line)
        if " array job " in line:
            job_id = line.split(" array job ", 1)[1].split()[0]

    try:
        run_array(exploration_id, root=root, script=script, tasks=workers, say=say,
                  what="searcher(s)")
    except KeyboardInterrupt:
        # Cancelled: each searcher wrote what it found so far on Slurm's SIGTERM.
        with contextlib.suppress(HarnessError):
            _gather(team, root, seeds, out=out, job_id=job_id, strict=False)
        team.stopped = "interrupted"
        raise
    _gather(team, root, seeds, out=out, job_id=job_id, strict=True)
    for searcher in team.searchers:
        observer.note(_searcher_line(searcher))
        for attempt in team.attempts:
            if attempt.searcher == searcher.index:
                observer.finished_run(attempt)
    observer.done(team)
    return team


def _most_faults(loaded: LoadedScenario, max_faults: int | None) -> int:
    """The most faults a schedule of the search has (each searcher says it again)."""
    from aftershock.harness.search import strategies

    try:
        return strategies.space_of(loaded.spec, max_faults=max_faults).faults[1]
    except ValueError:
        return max_faults or 0  # the searchers refuse the space, each naming why


def _searcher_line(s: Searcher) -> str:
    part = ("shrank the failure" if s.shrank else
            f"replayed another's failure ({s.replays_failed} failed, {s.replays_passed} "
            "passed)" if s.stopped == "replayed" else f"stopped: {s.stopped}")
    return f"searcher {s.index} (seed {s.seed}): {s.runs} runs, {part}" + (
        f"; error: {s.error}" if s.error else "")


def _gather(team: Exploration, root: Path, seeds: Sequence[int], *, out: Path, job_id: str,
            strict: bool) -> None:
    """Fill ``team`` from each searcher's record: every attempt, the finding of the one that
    shrank (its scenario copied under ``out`` as a local explore writes it), the counts.
    ``strict``: a missing record or a searcher's error is a HarnessError."""
    findings: list[tuple[bool, int, Finding]] = []
    slowest = 0.0
    for index, record in _records(root, seeds, job_id=job_id, strict=strict):
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


def _records(root: Path, seeds: Sequence[int], *, job_id: str,
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
                    f" its output: {task_output(root, job_id, index)}") from None
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
