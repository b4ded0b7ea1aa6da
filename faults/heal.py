"""Undo what a run left behind: from a live run's teardown, a reaper, or `aftershock heal`.

Run as ``python -m aftershock.faults.heal --journal FILE --watch PID`` this module is the
reaper: a small process in its own session that waits for the harness to exit
and then heals that harness's journal, so even a SIGKILLed harness leaves
nothing behind.

A heal trusts nothing it did not write (docs/security.md). Each item it looks
at ends as one :class:`Healed`: ``undone``; ``refused`` (a journal file that is
not ours or sits in a folder others can write, a malformed record, an undo
record its kind's ``validate`` does not accept, or a place that changed since the
fault acted, such as a run folder moved or swapped for a link (the revert raised
:class:`UndoRefused`): nothing of it was touched); ``failed`` (the undo raised
otherwise, or the kind is unknown: the fault may still be applied); or ``skipped``
(a line cut short by a crash: harmless). Only ``undone`` entries are marked done,
and the journal goes only when nothing else is left.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aftershock.faults import _cgroup, registry
from aftershock.faults._proc import kill_all, processes_with_env
from aftershock.faults.journal import (
    RUN_ID_ENV,
    RUN_ID_PATTERN,
    Journal,
    Pending,
    UndoContext,
    UndoRefused,
    UntrustedJournal,
    journal_dir,
    open_trusted,
    parse,
    read_fd,
    unsafe_folder,
)

LAUNCH_KIND = "launch"
# The launch record of a run's containers (faults/_docker.py LAUNCH_KIND): its undo removes
# every container and network labelled with the run id.
NODES_KIND = "nodes"
Outcome = Literal["undone", "refused", "failed", "skipped"]
# `aftershock heal` exits with the worst: an undo failed (a fault may still be applied),
# else something was refused (not proven ours: untouched), else 0.
EXIT_FAILED, EXIT_REFUSED = 1, 2


@dataclass(frozen=True, slots=True)
class Healed:
    """What became of one journal entry, or of a journal file (``entry`` None)."""

    journal: Path
    entry: Pending | None
    outcome: Outcome
    reason: str | None = None

    @property
    def error(self) -> str | None:
        """None only when undone: anything else is worth a look."""
        return None if self.outcome == "undone" else f"{self.outcome}: {self.reason}"

    def describe(self) -> str:
        what = f"{self.entry.kind} {self.entry.undo}" if self.entry else "journal"
        text = f"{self.outcome:<8} {what} ({self.journal})"
        return text + (f": {self.reason}" if self.reason else "")


class UnknownKind(Exception):
    """A record of a kind this installation does not know (a plugin not installed)."""


def exit_code(results: list[Healed]) -> int:
    if any(r.outcome == "failed" for r in results):
        return EXIT_FAILED
    if any(r.outcome == "refused" for r in results):
        return EXIT_REFUSED
    return 0


def validate_launch(undo: Mapping[str, Any], context: UndoContext) -> None:
    """Only this run's own mark: ``AFTERSHOCK_RUN_ID=<the journal's run id>``."""
    if undo.get("env") != RUN_ID_ENV:
        raise UndoRefused(f"env {undo.get('env')!r} is not {RUN_ID_ENV}")
    if undo.get("value") != context.run_id:
        raise UndoRefused(
            f"value {undo.get('value')!r} is not this journal's run id {context.run_id!r}"
        )
    # The run's cgroup (harness/run/target.py): named for this run id, inside the mounted cgroup2
    # hierarchy, no `..` to climb out of it; anything else is not provably the run's.
    group = undo.get("cgroup")
    if group is not None and not (
        isinstance(group, str) and _cgroup.is_run_group(Path(group), context.run_id)
    ):
        raise UndoRefused(f"cgroup {group!r} is not the cgroup of run {context.run_id}")
    # A run on nodes (harness/nodes/target.py) names its containers' label too: whatever
    # carries it with this run id goes first.
    if "label" in undo:
        validate_nodes(undo, context)
    # A run submitted to Slurm (harness/nodes/slurm_target.py) names its jobs: only the
    # name made of this run id.
    if "slurm_job_name" in undo:
        from aftershock.faults import slurm_cli as _slurm

        if undo["slurm_job_name"] != _slurm.job_name(context.run_id):
            raise UndoRefused(f"slurm_job_name {undo['slurm_job_name']!r} is not this "
                              f"journal's run's {_slurm.job_name(context.run_id)!r}")


def validate_nodes(undo: Mapping[str, Any], context: UndoContext) -> None:
    """A run's containers (faults/_docker.py): only those labelled with this journal's own
    run id, which the engine filters on; no container id or name is taken from the record."""
    from aftershock.faults import _docker

    if undo.get("label") != _docker.RUN_LABEL:
        raise UndoRefused(f"label {undo.get('label')!r} is not {_docker.RUN_LABEL}")
    if undo.get("value") != context.run_id:
        raise UndoRefused(
            f"value {undo.get('value')!r} is not this journal's run id {context.run_id!r}"
        )


def validate_entry(entry: Pending, context: UndoContext) -> None:
    """Raise UndoRefused unless ``entry`` names only what its run made."""
    if entry.op == "launch":
        if entry.kind == NODES_KIND:
            validate_nodes(entry.undo, context)
        else:
            validate_launch(entry.undo, context)
        return
    try:
        kind = registry.get(entry.kind)
    except KeyError as exc:
        raise UnknownKind(
            f"{exc.args[0]}: install what provides it, then run `aftershock heal` again"
        ) from None
    check = registry.validator(kind)
    if check is None:
        raise UndoRefused(
            f"kind {entry.kind} gives no validate(undo, context): its undo cannot be checked"
        )
    try:
        check(entry.undo, context)
    except UndoRefused:
        raise
    except Exception as exc:  # a malformed record: a missing key, a wrong type
        raise UndoRefused(f"malformed undo ({type(exc).__name__}: {exc})") from None


def revert_entry(entry: Pending) -> None:
    if entry.op == "launch" and entry.kind == NODES_KIND:
        from aftershock.faults import _docker

        _docker.remove_run(str(entry.undo["value"]))
        return
    if entry.op == "launch":
        if "label" in entry.undo:
            # The run's containers first: removing them thaws and ends their processes
            # (a paused node's cannot be signalled) and stops their restart policy.
            from aftershock.faults import _docker

            _docker.remove_run(str(entry.undo["value"]))
        if "slurm_job_name" in entry.undo:  # the run's Slurm jobs: cancelled, waited for
            from aftershock.faults import slurm_cli as _slurm

            _slurm.cancel_named(str(entry.undo["slurm_job_name"]))
        # The run's cgroup first: it holds even the processes that dropped the run id.
        group = entry.undo.get("cgroup")
        if group and not _cgroup.end_run_group(Path(group), str(entry.undo["value"])):
            raise RuntimeError(f"processes of cgroup {group} survived SIGKILL")
        _end_run(str(entry.undo["env"]), str(entry.undo["value"]))
        return
    registry.get(entry.kind).revert(entry.undo)


def _end_run(env: str, value: str, patience_s: float = 10.0) -> None:
    """Thaw and SIGKILL every process marked ``env=value``, again until none is left:
    a process forking while we looked has a child we did not see, and a big process
    (a CUDA context, gigabytes to unmap) takes a while to be gone after SIGKILL."""
    deadline = time.monotonic() + patience_s
    while True:
        refs = processes_with_env(env, value)
        if not refs:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"processes {[r.pid for r in refs]} of the run outlived SIGKILL by "
                f"{patience_s:g}s"
            )
        # Thaw first so nothing stays stopped if SIGKILL were refused, then kill.
        for ref in refs:
            ref.signal(signal.SIGCONT)
        kill_all(refs)
        time.sleep(0.05)


def heal_journal(path: Path, *, orphans_only: bool = False) -> list[Healed]:
    """Revert every pending entry of one journal (faults first, then launches).

    With ``orphans_only`` a journal whose harness is still running is left alone.
    An exclusive lock on the journal keeps the reaper, `aftershock heal` and a new
    run's start from healing the same journal at the same moment.
    """
    problem = unsafe_folder(path.parent)
    if problem is not None:
        return [Healed(path, None, "refused", problem)]
    if not RUN_ID_PATTERN.fullmatch(path.stem):
        return [Healed(path, None, "refused", "its name is not a run id")]
    try:
        fd = open_trusted(path)
    except UntrustedJournal as exc:
        return [Healed(path, None, "refused", exc.reason)]
    except FileNotFoundError:
        return []  # healed meanwhile by someone else
    except OSError as exc:
        return [Healed(path, None, "failed", f"cannot open: {exc.strerror}")]
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _heal_locked(path, fd, orphans_only)
    except OSError as exc:
        return [Healed(path, None, "failed", f"cannot read: {exc.strerror}")]
    finally:
        os.close(fd)


def _heal_locked(path: Path, fd: int, orphans_only: bool) -> list[Healed]:
    contents = parse(read_fd(fd))
    if orphans_only and contents.owner is not None and contents.owner.alive():
        return []
    context = UndoContext.of(path, contents)
    results = [Healed(path, None, "skipped", f"line {n} is cut short (a write interrupted "
                      "by a crash)") for n in contents.torn]
    results += [Healed(path, None, "refused", f"unreadable record, {why}")
                for why in contents.malformed]
    journal = Journal(path=path)
    left = False
    # Faults first, then the run's containers (removing them thaws and ends their processes,
    # which a signal cannot while a node is paused), then its processes on this host.
    for entry in sorted(contents.pending,
                        key=lambda e: (e.op == "launch", e.kind != NODES_KIND)):
        outcome: Outcome = "undone"
        reason = None
        try:
            validate_entry(entry, context)
            revert_entry(entry)
        except UndoRefused as exc:
            outcome, reason = "refused", str(exc)
        except UnknownKind as exc:  # may well still be applied: we cannot tell
            outcome, reason = "failed", str(exc)
        except Exception as exc:  # one failing revert must not stop the others
            outcome, reason = "failed", f"{type(exc).__name__}: {exc}"
        if outcome == "undone":
            journal.done(entry.id)
        else:
            left = True  # stays pending: the next heal reports it again
        results.append(Healed(path, entry, outcome, reason))
    if not left and not contents.malformed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return results


def heal_orphans(folder: Path | None = None) -> list[Healed]:
    """Heal every journal whose harness is gone; report what cannot be trusted or read."""
    folder = folder or journal_dir()
    if not folder.is_dir():
        return []
    problem = unsafe_folder(folder)
    if problem is not None:
        return [Healed(folder, None, "refused", problem)]
    results: list[Healed] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            results.extend(heal_journal(folder / name, orphans_only=True))
    return results


def start_reaper(journal: Path) -> subprocess.Popen[bytes]:
    """Start a process that heals ``journal`` as soon as this process exits, however."""
    return subprocess.Popen(
        [sys.executable, "-m", "aftershock.faults.heal",
         "--journal", str(journal), "--watch", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in our process group: Ctrl-C must not reach it
        close_fds=True,
    )


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aftershock.faults.heal")
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--watch", type=int, required=True, help="pid of the harness")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _wait_for_exit(args.watch)
    # Whatever is left (refused, failed) stays in the journal for `aftershock heal`.
    with contextlib.suppress(Exception):
        heal_journal(args.journal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
