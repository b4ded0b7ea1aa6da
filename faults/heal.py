"""Undo what a run left behind: from a live run's teardown, a reaper, or `aftershock heal`.

Run as ``python -m faults.heal --journal FILE --watch PID`` this module is the
reaper: a small process in its own session that waits for the harness to exit
and then heals that harness's journal, so even a SIGKILLed harness leaves
nothing behind.
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
from dataclasses import dataclass
from pathlib import Path

from faults import _cgroup, registry
from faults._proc import kill_all, processes_with_env
from faults.journal import Journal, Pending, orphaned_journals, pending

LAUNCH_KIND = "launch"


@dataclass(frozen=True, slots=True)
class Healed:
    journal: Path
    entry: Pending
    error: str | None


def revert_entry(entry: Pending) -> None:
    if entry.op == "launch":
        # The run's cgroup first: it holds even the processes that dropped the run id.
        group = entry.undo.get("cgroup")
        if group and not _cgroup.end_run_group(Path(group), str(entry.undo["value"])):
            raise RuntimeError(f"processes of cgroup {group} survived SIGKILL")
        # Thaw first so nothing stays stopped if SIGKILL were refused, then kill.
        refs = processes_with_env(entry.undo["env"], entry.undo["value"])
        for ref in refs:
            ref.signal(signal.SIGCONT)
        kill_all(refs)
        return
    registry.get(entry.kind).revert(entry.undo)


def heal_journal(path: Path) -> list[Healed]:
    """Revert every pending entry of one journal (faults first, then launches).

    An exclusive lock on the journal keeps the reaper, `aftershock heal` and a new
    run's start from healing the same journal at the same moment.
    """
    try:
        lock = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _heal_locked(path)
    finally:
        os.close(lock)


def _heal_locked(path: Path) -> list[Healed]:
    results: list[Healed] = []
    entries = sorted(pending(path), key=lambda e: e.op == "launch")
    journal = Journal(path=path)
    for entry in entries:
        error = None
        try:
            revert_entry(entry)
        except Exception as exc:  # one failing revert must not stop the others
            error = f"{type(exc).__name__}: {exc}"
        else:
            journal.done(entry.id)
        results.append(Healed(path, entry, error))
    journal.close()
    return results


def heal_orphans(folder: Path | None = None) -> list[Healed]:
    """Heal every journal whose harness is gone."""
    results: list[Healed] = []
    for path in orphaned_journals(folder):
        results.extend(heal_journal(path))
    return results


def start_reaper(journal: Path) -> subprocess.Popen[bytes]:
    """Start a process that heals ``journal`` as soon as this process exits, however."""
    return subprocess.Popen(
        [sys.executable, "-m", "faults.heal",
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
    parser = argparse.ArgumentParser(prog="python -m faults.heal")
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--watch", type=int, required=True, help="pid of the harness")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _wait_for_exit(args.watch)
    with contextlib.suppress(Exception):
        heal_journal(args.journal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
