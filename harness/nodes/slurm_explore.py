"""Explorations fanned out over a Slurm cluster: ``aftershock explore --executor slurm``.

N searchers (harness/search/team.py) run at once, each a task of one array job (submitted,
waited for, cancelled and journalled by harness/nodes/slurm_campaign.py's ``run_array``),
and all of them share ONE hypothesis example database, a DirectoryBasedExampleDatabase on
the storage every node mounts. The submitting harness reads each searcher's record and
gives the output a local explore gives.
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

from aftershock.faults import slurm_cli as slurm
from aftershock.harness.errors import HarnessError
from aftershock.harness.nodes.slurm_campaign import run_array, task_output, task_script
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.search.explore import Exploration, ExploreObserver, NullExploreObserver
from aftershock.harness.search.team import (
    Plan,
    gather,
    most_faults,
    searcher_line,
    searcher_seeds,
)


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
        ([sys.executable, "-m", "aftershock.harness.search.team", str(root), str(k)],
         root / f"searcher-{k}") for k in range(workers)]))
    team = Exploration(loaded.spec.name, str(loaded.path), seed, runs,
                       most_faults(loaded, max_faults), workers=workers)
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
            gather(team, root, seeds, out=out, strict=False,
                   output_of=lambda k: task_output(root, job_id, k))
        team.stopped = "interrupted"
        raise
    gather(team, root, seeds, out=out, strict=True,
           output_of=lambda k: task_output(root, job_id, k))
    for searcher in team.searchers:
        observer.note(searcher_line(searcher))
        for attempt in team.attempts:
            if attempt.searcher == searcher.index:
                observer.finished_run(attempt)
    observer.done(team)
    return team
