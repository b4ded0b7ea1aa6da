"""Where each target stands across several runs of the same code: ``python -m bench.status``.

One run's verdict rests on an interval that takes its repetitions as independent, and two
16-repetition runs of the same code, hours apart, differed by more than that interval allows
(bench/results/history-2026-12.md, "Run J"). So a target's status reads every run given:

- **not met** where any run resolved it over its limit;
- **met** only where at least two runs were given and every one of them resolved it under;
- **not resolved** otherwise, including a target met in a single run;
- **not measured** where no run had a figure for it (a row it compares with did not run).

The runs must have measured the same code: each record carries ``code`` (the commit, whether
the tree differed from it, and a digest of the Python the jobs and the bench run), and
records whose digests differ are refused, unless ``--mixed`` says the comparison is meant.
A record written before records carried ``code`` is refused too: nothing says what it ran.

Each ``make bench-targets`` run overwrites ``bench/results/partial.json`` and
``serving-partial.json``, so a run's record is kept by the commit that recorded it. A record
given as ``REV:PATH`` (no such file on disk) is read with ``git show`` from the repository of
the current directory:

    python -m bench.status bench/results/partial.json /tmp/run-k/partial.json
    python -m bench.status 5e8cdd3:bench/results/partial.json 8e633ef:bench/results/partial.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The Python a bench job runs (the reference stack, the harness and its probe, the faults)
# and the bench's own (how jobs are launched, timed and judged). Records of the bench do not
# count: they are its output, and so are the runners kept beside raw rounds in its results.
CODE_FOLDERS = ("reference_impl", "harness", "faults", "bench")
RECORDS = "bench/results"


def code_identity(root: Path = ROOT) -> dict[str, Any]:
    """What code a run measured: the commit, whether the product folders differ from it,
    and a sha256 over every ``.py`` file under :data:`CODE_FOLDERS` but :data:`RECORDS`
    (path and bytes, in path order), which is the same for the same code whatever the
    commit or the tree's state."""
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).is_relative_to(RECORDS):
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    commit: str | None = None
    dirty: bool | None = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", *CODE_FOLDERS,
                                  f":(exclude){RECORDS}"],
                                 cwd=root, capture_output=True, text=True, check=True,
                                 timeout=10).stdout
        dirty = any(line.endswith(".py") for line in changed.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout: the digest still identifies the code
    return {"commit": commit, "dirty": dirty, "digest": digest.hexdigest()}


class StatusError(Exception):
    """The records cannot be read together: what is wrong, in which file, and how to fix it."""


@dataclass(frozen=True, slots=True)
class RunVerdict:
    record: str  # the file it came from
    met: bool | None  # True: resolved under, False: resolved over, None: neither
    note: str
    measured: bool  # False: the run had no figure for it (a row it compares with did not run)


@dataclass(frozen=True, slots=True)
class TargetStatus:
    target: str
    status: str  # "met", "not met", "not resolved" or "not measured"
    why: str
    runs: tuple[RunVerdict, ...]


def _verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's target lines: the training bench's ``targets``, serving's ``verdicts``."""
    found = record.get("targets", record.get("verdicts"))
    return [v for v in found or [] if isinstance(v, dict) and "target" in v]


def _read(given: str | Path) -> str:
    """A record's text: the file, or else ``REV:PATH`` as git shows it."""
    try:
        return Path(given).read_text()
    except FileNotFoundError as exc:
        rev, colon, inside = str(given).partition(":")
        if not (colon and rev and inside):
            raise StatusError(f"{given}: cannot read it ({exc.strerror}); give a record's "
                              "file, or REV:PATH for one kept in git") from exc
    except OSError as exc:
        raise StatusError(f"{given}: cannot read it ({exc.strerror})") from exc
    try:
        shown = subprocess.run(["git", "show", f"{rev}:{inside}"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        raise StatusError(f"{given}: no such file, and git cannot show it ({err})") from err
    if shown.returncode != 0:
        said = shown.stderr.strip().splitlines()
        raise StatusError(
            f"{given}: no such file, and git cannot show it as REV:PATH "
            f"({said[-1] if said else 'git show failed'}); give a commit that keeps the "
            "record and its path from the repository's root, run from inside that "
            "repository, or a file that exists on disk")
    return shown.stdout


def load(paths: list[str] | list[Path], *, mixed: bool = False
         ) -> list[tuple[str, dict[str, Any]]]:
    """Read the records, refusing any that cannot be compared. A record is a file, or
    ``REV:PATH``: a record kept in git (see the module's docstring)."""
    records: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        try:
            record = json.loads(_read(path))
        except json.JSONDecodeError as exc:
            raise StatusError(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); give "
                              "the .json record the bench wrote, not its .md") from exc
        if not isinstance(record, dict) or not _verdicts(record):
            raise StatusError(f"{path}: no targets in it; give a record written by "
                              "`python -m bench` or `python -m bench.serving`")
        code = record.get("code")
        if not mixed and not (isinstance(code, dict) and code.get("digest")):
            raise StatusError(f"{path}: the record does not say what code it measured (written "
                              "before records carried `code`); pass --mixed to read it anyway")
        records.append((str(path), record))
    if not mixed:
        digests = {name: record["code"]["digest"] for name, record in records}
        if len(set(digests.values())) > 1:
            listed = "; ".join(f"{name}: {d[:12]} (commit {str(rec['code'].get('commit'))[:7]})"
                               for (name, rec), d in zip(records, digests.values(), strict=True))
            raise StatusError("the records measured different code, so their runs are not "
                              f"repetitions of one another: {listed}; pass --mixed to compare "
                              "them anyway")
    return records


def status(records: list[tuple[str, dict[str, Any]]]) -> list[TargetStatus]:
    """Each target's status by the rule in this module's docstring, in first-seen order."""
    by_target: dict[str, list[RunVerdict]] = {}
    for name, record in records:
        for v in _verdicts(record):
            met = v.get("met")
            note = str(v.get("note") or "")
            # A row the target needs did not run: no value ("hot_spare missing", "not
            # measured (no migrate or fail_stop runs)"), or, in the training bench, a ratio to
            # a peer row that did not run, left without a limit ("a peer row missing").
            measured = (v.get("value") is not None and not note.startswith("not measured")
                        and not ("limit" in v and v["limit"] is None))
            by_target.setdefault(v["target"], []).append(
                RunVerdict(name, met if isinstance(met, bool) else None, note, measured))
    out = []
    for target, runs in by_target.items():
        counted = [r for r in runs if r.measured]
        n = len(counted)
        over = [r for r in counted if r.met is False]
        under = [r for r in counted if r.met is True]
        if not counted:
            state, why = "not measured", "no run given measured it"
        elif over:
            state, why = "not met", f"{len(over)} of {n} run(s) resolved it over the limit"
        elif len(under) == n >= 2:
            state, why = "met", f"every one of {n} runs resolved it under the limit"
        elif len(under) == n:
            state = "not resolved"
            why = "met in the one run that measured it; met needs two or more"
        else:
            state = "not resolved"
            why = f"{len(under)} of {n} run(s) resolved it under the limit, none over"
        out.append(TargetStatus(target, state, why, tuple(runs)))
    return out


def _names(statuses: list[TargetStatus]) -> dict[str, str]:
    """How the table names each record: its file name where that tells them apart, else
    the record as given (two runs' ``partial.json``, from two commits or two folders)."""
    given = list(dict.fromkeys(r.record for s in statuses for r in s.runs))
    short = {g: Path(g).name for g in given}
    unique = len(set(short.values())) == len(given) and not any(":" in g for g in given)
    return short if unique else {g: g for g in given}


def render(statuses: list[TargetStatus]) -> str:
    lines = ["| target | status | why | each run |", "| --- | --- | --- | --- |"]
    names = _names(statuses)
    for s in statuses:
        each = "; ".join(f"{names[r.record]}: "
                         + ({True: "under", False: "over", None: "neither"}[r.met]
                            if r.measured else "not measured") for r in s.runs)
        shown = f"**{s.status}**" if s.status != "not resolved" else s.status
        lines.append(f"| {s.target} | {shown} | {s.why} | {each} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", metavar="RECORD.json",
                        help="a record's file, or REV:PATH for one kept in git")
    parser.add_argument("--mixed", action="store_true",
                        help="read records of different (or unknown) code together")
    args = parser.parse_args(argv)
    try:
        records = load(args.records, mixed=args.mixed)
    except StatusError as exc:
        print(f"bench.status: {exc}", file=sys.stderr)
        return 2
    print(render(status(records)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
