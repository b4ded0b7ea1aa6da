"""Ranks by ``RANK`` in a job's environment: the launched command is rank 0 only in a job
that never shows a ``RANK`` at all.

`aftershock explore` once "found" a schedule that failed 2 runs of 2: two kills of rank 0,
the second while rank 0 was down for its restart and rank 1 had already finished. With no
live process saying ``RANK``, the harness took the launcher for rank 0 and killed it, and
the job's supervisor, which survives that schedule, was blamed for the harness's mistake.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from aftershock.harness.run import target
from aftershock.harness.run.timeline import Timeline

# A launcher that waits a second, starts one rank (RANK=0) which lives half a second, then
# waits on: a supervisor restarting its rank.
LAUNCHER = """
import os, subprocess, sys, time
time.sleep(1)
env = {**os.environ, "RANK": "0"}
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], env=env).wait()
time.sleep(30)
"""


@contextlib.contextmanager
def started(tmp_path: Path, code: str, world: int | None) -> Iterator[target.LocalTarget]:
    timeline = Timeline(tmp_path / "events.jsonl")
    launch = target.Launch([sys.executable, "-c", code], tmp_path, {}, world, ())
    job = target.LocalTarget(launch, run_dir=tmp_path / "run", run_id="env-ranks",
                             timeline=timeline)
    job.start()
    try:
        yield job
    finally:
        job.stop()
        timeline.close()


def wait_for(predicate: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_a_job_that_showed_ranks_has_no_rank_0_while_its_ranks_are_down(tmp_path: Path) -> None:
    with started(tmp_path, LAUNCHER, None) as job:
        wait_for(lambda: 0 in job.rank_processes() and job.rank_processes()[0].pid != job.pid)
        wait_for(lambda: len(job.processes()) == 1)  # the rank ended; the launcher waits on
        assert job.rank_processes() == {}


def test_a_job_of_two_ranks_has_no_rank_0_before_its_ranks_start(tmp_path: Path) -> None:
    with started(tmp_path, LAUNCHER, 2) as job:
        assert job.rank_processes() == {}
        wait_for(lambda: 0 in job.rank_processes())
        assert job.rank_processes()[0].pid != job.pid


def test_a_job_that_never_shows_a_rank_is_its_own_rank_0(tmp_path: Path) -> None:
    with started(tmp_path, "import time; time.sleep(30)", None) as job:
        ranks = job.rank_processes()
        assert list(ranks) == [0]
        assert ranks[0].pid == job.pid


def test_a_hello_that_names_no_rank_leaves_a_one_process_job_its_rank_0(
        tmp_path: Path) -> None:
    """A plain one-process job says hello(world=1) without a rank (no RANK in its
    environment): that tells the harness nothing about ranks, so its process stays rank 0.
    It once lost it, and every `rank`/`pick` fault on such a job was never injected."""
    with started(tmp_path, "import time; time.sleep(30)", None) as job:
        wait_for(lambda: 0 in job.rank_processes())
        assert job.pid is not None
        job.note_hello(job.pid, None, None)
        assert job.rank_processes()[0].pid == job.pid
        # A process that names its rank still outranks the environment.
        job.note_hello(job.pid, 3, None)
        assert list(job.rank_processes()) == [3]
