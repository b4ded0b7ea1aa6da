"""The harness's own records, which no fault may touch: one list for `validate` (a scenario
aimed at them is refused) and for the file faults at their moment (faults/storage.py's
``guarded``).

A run's evidence lives in its folder (timeline, in-process command file, process logs,
result, scenario, traceback, the fault-free twin's own run), the heal journal in the state
folder and fault-free results in the cache. A fault that damaged them would have the run
judged on evidence the fault made up, or leave a heal nothing to go by.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from aftershock import faults
from aftershock.faults.journal import state_dir
from aftershock.harness import systems
from aftershock.harness.twin._paths import cache_dir


@dataclass(frozen=True, slots=True)
class Record:
    path: Path
    what: str  # what it is, for the message that refuses a fault aimed at it
    folder: bool  # everything under it is the record too


#: In the run folder: name, what it is, whether it is a folder. The mark and the twin's
#: folder are the run's too (harness/run/runner.py writes them).
RUN_RECORDS: tuple[tuple[str, str, bool], ...] = (
    ("events.jsonl", "the run's timeline", False),
    ("commands.jsonl", "the run's command file", False),
    ("result.json", "the run's record", False),
    ("scenario.yaml", "the run's copy of its scenario", False),
    ("harness_error.txt", "the harness's traceback", False),
    (".aftershock-run", "the run folder's mark", False),
    ("logs", "the process logs", True),
    ("fault_free", "the fault-free twin's run", True),
)


def records(run_dir: Path) -> list[Record]:
    """Every record of a run in ``run_dir``, and those the runs share."""
    return [
        *(Record(run_dir / name, what, folder) for name, what, folder in RUN_RECORDS),
        Record(state_dir(), "the heal journal's state folder", True),
        Record(cache_dir(), "the cache", True),
    ]


def guarded(run_dir: Path) -> list[str]:
    """The records' paths, absolute, as the file faults take them."""
    return [str(r.path.resolve()) for r in records(run_dir)]


#: Where a scenario's ``${run_dir}`` stands while it is validated (no run exists yet).
PLACEHOLDER = Path("/${run_dir}")


def aimed_at(root: Path, pattern: str, *, whole: bool, run_dir: Path = PLACEHOLDER
             ) -> Record | None:
    """A record a fault on ``pattern`` (a glob) under ``root`` could touch, or None:
    a match that is the record or lies under it, or (``whole``: a fault that acts on a
    matched folder as a whole, or on ``root`` itself) a folder that holds it."""
    root_parts = PurePosixPath(os.path.normpath(root)).parts
    globs = [p for p in PurePosixPath(pattern).parts if p != "."]
    for record in records(run_dir):
        parts = PurePosixPath(os.path.normpath(record.path)).parts
        if parts[:len(root_parts)] == root_parts:
            if _reaches(globs, list(parts[len(root_parts):]), record.folder, whole):
                return record
        elif record.folder and root_parts[:len(parts)] == parts:
            return record  # root is inside a record folder
    return None


def _reaches(globs: list[str], rest: list[str], folder: bool, whole: bool) -> bool:
    """Whether some path matching ``globs`` is ``rest`` (the record, relative to the root),
    lies under it (a folder record), or holds it (``whole``)."""
    if not rest:
        return folder or all(g == "**" for g in globs)
    if not globs:
        return whole
    if globs[0] == "**":
        return _reaches(globs[1:], rest, folder, whole) or _reaches(globs, rest[1:], folder,
                                                                    whole)
    return fnmatchcase(rest[0], globs[0]) and _reaches(globs[1:], rest[1:], folder, whole)


def refused(spec: Any, scenario_dir: Path | None) -> list[tuple[int, str, str]]:
    """Each file fault of ``spec`` aimed at a record: (fault index, the parameter that aims
    it, why and how to fix it). A root known only at run time (a ``cwd`` relative to an
    unknown scenario folder) is left to the fault's own guard."""
    kind = systems.of(spec.system)
    found: list[tuple[int, str, str]] = []
    for index, fault in enumerate(spec.faults):
        aim = faults.hooks(faults.get(fault.kind)).aim
        if aim is None or "root" not in type(fault).model_fields:
            continue
        field, whole = aim()
        root = _root(fault.root, kind.default_root(spec.system, PLACEHOLDER), scenario_dir)
        if root is None:
            continue
        pattern = str(getattr(fault, field))
        record = aimed_at(root, pattern, whole=whole)
        if record is None:
            continue
        where = str(record.path).replace(str(PLACEHOLDER), "${run_dir}")
        under = str(root).replace(str(PLACEHOLDER), "${run_dir}")
        found.append((index, field, (
            f"{pattern!r} under {under} can reach {where}, {record.what}: one of the "
            "harness's own records (timeline, logs, result, heal journal, cache), which no "
            "fault may touch. Aim at the system's files instead: without `root`, a "
            "command's file faults are relative to the job's working folder (its `cwd`, "
            "default ${run_dir}/work) and the reference trainer's to its checkpoint folder; "
            "or give a narrower glob")))
    return found


def _root(given: str | None, default: Path, scenario_dir: Path | None) -> Path | None:
    """A fault's root as it will resolve, with ``${run_dir}`` at :data:`PLACEHOLDER`."""
    if given:
        # At run time a relative root is taken from where the harness runs.
        return Path.cwd() / given.replace("${run_dir}", str(PLACEHOLDER))
    text = str(default)
    if scenario_dir is None and ("${scenario_dir}" in text or not default.is_absolute()):
        return None
    base = (scenario_dir or Path("/")).resolve()
    return base / text.replace("${scenario_dir}", str(base))
