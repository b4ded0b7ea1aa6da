"""The shipped scenarios, run as a user runs them: through the CLI and through pytest.

Every scenario under scenarios/ runs exactly once here and must pass. A scenario whose point
is a specific reaction of the system (a checkpoint skipped for its checksum, a warm spare
taking a rank over, survivors training on alone) also has its timeline checked for that
reaction, so it cannot pass for the wrong reason: these runs are the reference trainer's
end-to-end tests too. The deliberately broken variants that show each check failing live in
test_trainer_broken.py, test_hot_spare.py, test_replay_check.py, test_e2e_command.py and
test_cli.py.

Slow by nature: each run launches the reference trainer under torchrun (tens of CPU-seconds
for 4 ranks, about half that for the 2-rank world of most fault scenarios), and a scenario
that compares against a fault-free run needs that run too. The fault-free run is cached per
session (``shared_cache``) and shared by every scenario whose system differs only in what
never changes the math (runner.baseline_key), which is why the shipped scenarios keep their
systems aligned.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli, read_events

from aftershock.faults import docker_engine
from aftershock.harness import oracle
from aftershock.harness.errors import PreflightError
from aftershock.harness.run.runner import preflight
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import TrainerSystem
from aftershock.harness.systems.nodes import NodesSystem

# The scenario that goes through the pytest plugin instead of the CLI: a cheap one.
VIA_PYTEST = ROOT / "scenarios" / "faults" / "process_term_restart.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(600)]


@dataclass(frozen=True, slots=True)
class Run:
    """A finished scenario run: its record (``--json``) and its run folder."""

    scenario: Path
    record: dict[str, Any]

    @property
    def dir(self) -> Path:
        return Path(self.record["run_dir"])

    @property
    def system(self) -> TrainerSystem:
        system = load_scenario(self.scenario).spec.system
        assert isinstance(system, TrainerSystem)
        return system

    @property
    def ranks(self) -> list[int]:
        """Every rank of the world (training/ runs 2 replicas x 2 shards, most of faults/
        a 2-rank data-parallel world)."""
        return list(range(self.system.world.size))

    def events(self, kind: str | None = None, folder: str = ".") -> list[dict[str, Any]]:
        return read_events(self.dir / folder / "events.jsonl", kind)

    def injection(self, fault: int = 0) -> dict[str, Any]:
        """The moment fault ``fault`` of the scenario landed (its fault_injected event)."""
        (hit,) = [e for e in self.events("fault_injected") if e.get("fault") == fault]
        return hit

    def detected(self, after: float = float("-inf")) -> list[dict[str, Any]]:
        return [e for e in self.events("failure_detected") if e["t"] >= after]

    def digests(self) -> dict[int, str]:
        return {e["rank"]: e["digest"] for e in self.events("params")}


# --- what each scenario's timeline must show besides its checks ---------------------------


def _killed_before_params(run: Run) -> None:
    """Rank 0 died after the last step, before it reported its final parameters: no new
    generation followed, and every other rank's final parameters equal what the independent
    oracle computes for the one generation (the proof params_match cannot give: rank 0
    reported nothing)."""
    assert [e["generation"] for e in run.events("membership")] == [0]
    assert not [e for e in run.events("hello") if e.get("generation", 0) > 0]
    digests = run.digests()
    assert sorted(digests) == [1, 2, 3], digests
    expected = oracle.trainer_digests(run.system, seed=0,
                                      schedule=oracle.full_membership(run.system))
    assert expected.digests is not None, expected.note
    assert digests == {rank: expected.digests[rank] for rank in digests}


def _left_before_killed(run: Run) -> None:
    """Killed on its way out, after every rank reported its final parameters: the launcher
    never restarted the group (one world), and no rank was re-forked or replaced."""
    assert not [e for e in run.events("process_started") if e.get("generation", 0) > 0]
    assert [e["generation"] for e in run.events("membership")] == [0]
    assert not run.events("failure_detected")
    assert sorted(run.digests()) == run.ranks


def _fault_free(run: Run) -> None:
    """The golden trajectory: complete, regular, and shaped like hybrid parallelism."""
    steps, every = run.system.steps, run.system.checkpoint_every
    assert len(run.events("hello")) == len(run.ranks)
    committed: dict[int, list[int]] = {}
    for e in run.events("step"):
        committed.setdefault(e["rank"], []).append(e["step"])
    assert committed == {rank: list(range(1, steps + 1)) for rank in run.ranks}
    assert not run.events("failure_detected")
    # Shards of one replica differ; replicas of one shard are identical (pure data parallel).
    digests = run.digests()
    assert len(digests) == len(run.ranks)
    assert digests[0] == digests[2]
    assert digests[1] == digests[3]
    assert digests[0] != digests[1]
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert saved == list(range(every, steps + 1, every))
    # Only the newest 3 committed checkpoints are kept; every rank wrote its final state.
    kept = sorted(p.name for p in (run.dir / "checkpoints").iterdir())
    assert kept == [f"step_{s:06d}" for s in (steps - 2 * every, steps - every, steps)]
    assert all((run.dir / "output" / "final" / f"rank_{r}.pt").exists() for r in run.ranks)


def _step_at(run: Run, t: float) -> int:
    """The newest step any rank had committed before ``t``."""
    return max(e["step"] for e in run.events("step") if e["t"] < t)


def _kill_rank_restart(run: Run) -> None:
    """One torchrun restart; every rank resumes from the newest checkpoint (at most one
    interval old, since a save that the kill interrupted never commits) and goes on."""
    for metric in ("time_to_detect_s", "time_to_recover_s", "lost_steps"):
        assert isinstance(run.record["metrics"][metric], int | float), metric
    assert run.record["metrics"]["generations"] == 1
    killed = run.injection()["t"]
    assert run.detected(after=killed), "no rank reported the failure"
    loaded = run.events("checkpoint_loaded")
    assert sorted(e["rank"] for e in loaded) == run.ranks
    (resumed_from,) = {e["step"] for e in loaded}
    assert resumed_from in [e["step"] for e in run.events("checkpoint_saved")]
    assert resumed_from >= _step_at(run, killed) - run.system.checkpoint_every
    # Survivors of the old world may still log a step or two between the kill and torchrun
    # tearing them down; the new world's steps are those after its first load.
    reloaded = min(e["t"] for e in loaded)
    first = [e for e in run.events("step") if e["t"] > reloaded and e["step"] == resumed_from + 1]
    assert sorted(e["rank"] for e in first) == run.ranks


def _kill_during_restart_recovery(run: Run) -> None:
    """The relaunched rank 1 died inside the recovery, holding the newest checkpoint's step in
    view before the ranks agreed on it; the second world never trained. torchrun relaunched
    once more and every rank of the third world resumed from that same checkpoint."""
    first, second = run.injection(0), run.injection(1)
    assert (second["rank"], second["phase"]) == (1, "restore")
    restored = second["step"]
    assert restored in [e["step"] for e in run.events("checkpoint_saved") if e["t"] < first["t"]]
    hellos = run.events("hello")
    assert {e["generation"] for e in hellos} == {0, 1, 2}
    second_world = min(e["t"] for e in hellos if e["generation"] == 1)
    assert first["t"] < second_world < second["t"]
    assert not [e for e in run.events("step") if second_world < e["t"] < second["t"]]
    loaded = run.events("checkpoint_loaded")
    assert sorted(e["rank"] for e in loaded) == run.ranks
    assert {e["step"] for e in loaded} == {restored}
    assert all(e["t"] > second["t"] for e in loaded)


def _freeze_rank_restart(run: Run) -> None:
    """Nothing errors: only the collective timeout can see the hang, then the world restarts."""
    frozen = run.injection()["t"]
    assert any(e["cause"] == "collective_timeout" for e in run.detected(after=frozen))
    assert {e["generation"] for e in run.events("hello")} == {0, 1}


def _kill_rank_hot_spare(run: Run) -> None:
    """The spare claims rank 1; no survivor restarts (none says hello twice)."""
    killed = run.injection()["t"]
    assert any(e["cause"] == "process_exit" and e.get("rank") == 1
               for e in run.detected(after=killed))
    hellos = [e for e in run.events("hello") if e.get("role") == "trainer"]
    assert [e["rank"] for e in hellos].count(1) == 2
    assert sorted(e["rank"] for e in hellos if e["t"] < killed) == run.ranks
    survivors = [e for e in hellos if e["rank"] != 1]
    assert len(survivors) == len(run.ranks) - 1


def _kill_shard_hot_spare(run: Run) -> None:
    """Both holders of shard 0 died together, so no live peer had its state: every rank,
    the survivors of shard 1 too, loaded the controller's snapshot of one common step, and
    two spares took ranks 0 and 2 over; the survivors never restarted."""
    kills = [e for e in run.events("fault_injected") if e.get("fault") == 0]
    assert sorted(e["rank"] for e in kills) == [0, 2]
    killed = min(e["t"] for e in kills)
    loaded = run.events("checkpoint_loaded")
    assert sorted(e["rank"] for e in loaded) == run.ranks
    assert all(e["path"].startswith("peer-memory snapshot") for e in loaded), loaded
    (resumed,) = {e["step"] for e in loaded}
    assert 0 < resumed <= _step_at(run, killed)
    hellos = [e["rank"] for e in run.events("hello") if e.get("role") == "trainer"]
    assert sorted(hellos) == [0, 0, 1, 2, 2, 3]


def _nan_gradient_rollback(run: Run) -> None:
    """The NaN reaches rank 3's data-parallel peer (rank 1) through the gradient average;
    both report it for the poisoned step, and nothing else goes wrong."""
    step = run.injection()["step"]
    detected = [(e["cause"], e["step"]) for e in run.events("failure_detected")]
    assert detected == [("non_finite", step), ("non_finite", step)]


def _nan_on_every_rank(run: Run) -> None:
    """Every rank raised "not finite" in the same vote and read it as that: every rank
    reports the NaN for the poisoned step, and nobody rolls back."""
    step = run.injection()["step"]
    detected = sorted((e["rank"], e["cause"], e["step"]) for e in run.events("failure_detected"))
    assert detected == [(r, "non_finite", step) for r in run.ranks], detected
    assert not run.events("recovery_done"), "a rollback, not a skipped step"


def _rolled_back_everywhere(run: Run) -> None:
    """Both shards' replicas disagreed at one fingerprint step and every rank held the flag
    at the retry of the step after it: every rank rolled back to the last agreed state, once,
    before anyone committed that step."""
    (judged,) = {e["step"] for e in run.events("failure_detected")
                 if e["cause"] == "fingerprint_mismatch"}
    back = run.events("recovery_done")
    assert sorted(e["rank"] for e in back) == run.ranks, back
    assert {e["step"] for e in back} == {judged - 10}, back
    first = min(e["t"] for e in back)
    assert not [e for e in run.events("step") if e["step"] == judged + 1 and e["t"] < first]


def _snapshot_restored(step: int) -> Callable[[Run], None]:
    """Both holders of shard 0 died; every rank, the survivors of shard 1 too, loaded the
    snapshot of ``step`` (the newest that every shard has), which is older than the step
    the survivors had committed."""

    def check(run: Run) -> None:
        loaded = run.events("checkpoint_loaded")
        assert sorted(e["rank"] for e in loaded) == run.ranks, loaded
        assert all(e["path"].startswith("peer-memory snapshot") for e in loaded), loaded
        assert {e["step"] for e in loaded} == {step}, loaded
        first = min(e["t"] for e in loaded)
        assert _step_at(run, first) > step

    return check


def _repaired(rank: int, source: int) -> Callable[[Run], None]:
    """``_vote({rank})``, and ``rank`` alone skipped the step, after every rank's own
    gradients were finite: it commits the step once, after every other rank did, with the
    state it took from ``source`` (``state_repaired``), before anyone commits the next."""
    vote = _vote({rank})

    def check(run: Run) -> None:
        vote(run)
        step = run.injection()["step"]
        repaired = [(e["rank"], e["step"], e["source"]) for e in run.events("state_repaired")]
        assert repaired == [(rank, step, source)]
        t = {(e["rank"], e["step"]): e["t"] for e in run.events("step")}
        others = [r for r in run.ranks if r != rank]
        assert max(t[(r, step)] for r in others) < t[(rank, step)]
        assert t[(rank, step)] < min(t[(r, step + 1)] for r in run.ranks)

    return check


def _vote(poisoned: set[int]) -> Callable[[Run], None]:
    """Non-finite gradients on the ``poisoned`` ranks only (the others' stay finite, so each
    of those would apply the step if it decided alone): exactly those report the step, and
    the vote keeps the world in lockstep, every rank committing each step once and no rank
    committing a step before every rank committed the one before it."""

    def check(run: Run) -> None:
        step = run.injection()["step"]
        detected = sorted((e["rank"], e["cause"], e["step"])
                          for e in run.events("failure_detected"))
        assert detected == [(rank, "non_finite", step) for rank in sorted(poisoned)]
        first: dict[tuple[int, int], float] = {}
        for e in run.events("step"):
            assert (e["rank"], e["step"]) not in first, e
            first[(e["rank"], e["step"])] = e["t"]
        steps = range(1, run.system.steps + 1)
        assert set(first) == {(rank, k) for rank in run.ranks for k in steps}
        for k in steps[:-1]:
            assert max(first[(r, k)] for r in run.ranks) < min(first[(r, k + 1)] for r in run.ranks)

    return check


def _regrouped(cause: str) -> Callable[[Run], None]:
    """A collective fault on the process group the trainer built itself (hot_spare and
    elastic never call torch.distributed's functions): it landed on the named collective,
    the first detection after it has ``cause``, and the controller regrouped the very same
    members. No spare took a rank over, no survivor restarted, and no rank committed a step
    twice or skipped one."""

    def check(run: Run) -> None:
        hit = run.injection()
        assert hit["op"] == "all_reduce", hit
        found = run.detected(after=hit["t"])
        assert found, "nobody reported the failed collective"
        assert found[0]["cause"] == cause, found[0]
        plans = run.events("membership")
        assert len(plans) >= 2, "the controller never regrouped"
        assert all(e["members"] == plans[0]["members"] for e in plans), plans
        hellos = [e["rank"] for e in run.events("hello") if e.get("role") == "trainer"]
        assert sorted(hellos) == run.ranks
        committed = sorted((e["rank"], e["step"]) for e in run.events("step"))
        steps = range(1, run.system.steps + 1)
        assert committed == [(rank, k) for rank in run.ranks for k in steps]

    return check


def _elastic(run: Run) -> None:
    """Replica 0 drops out, replica 1 trains alone, replica 0 heals and rejoins; the
    params_match check recomputed that membership with the independent oracle."""
    log = run.dir / "output" / "membership.jsonl"
    generations = [json.loads(line)["replicas"] for line in log.read_text().splitlines()]
    assert generations[0] == [0, 1]
    assert [1] in generations
    assert generations[-1] == [0, 1]
    killed = run.injection()["t"]
    alone = [e for e in run.events("step") if e["t"] > killed and e.get("replicas") == 1]
    assert alone, "survivors never committed a step on their own"
    assert {e["rank"] for e in alone} == {2, 3}
    (check,) = [c for c in run.record["checks"] if c["name"] == "params_match"]
    assert "independent replay" in check["message"], check


def _survivors_left_the_wedged_generation(run: Run) -> None:
    """Rank 3 died while rank 2 was wedged inside step 25 (alive, beating), so ranks 0 and 1
    waited on a live peer that would answer nothing for 3 s, in collectives with a 20 s
    timeout. Both must have left that generation on the controller's plan: resumed in
    the generation without replica 1 within a second of the kill, long before rank 2's
    release. Rank 3's slot was back at once, but replica 1 is asked back only once rank 2
    is out of its old generation: until then ranks 0 and 1 train on alone instead of
    waiting for it at a start line. Then the full world trained on together."""
    hang, kill = run.injection(0), run.injection(1)
    assert (hang["rank"], kill["rank"]) == (2, 3)
    (released,) = run.events("fault_healed")
    assert released["t"] - hang["t"] > 2.5, released
    (dropped,) = [e for e in run.events("membership") if e["replicas"] == [0]]
    resumed = {e["rank"]: e["t"] for e in run.events("recovery_done")
               if e["generation"] == dropped["generation"]}
    assert sorted(resumed) == [0, 1], resumed
    waited = max(resumed.values()) - kill["t"]
    assert waited < 1.0, f"survivors left the old generation {waited:.2f} s after the kill"
    alone = [e for e in run.events("step") if e["rank"] == 0
             and e["generation"] == dropped["generation"] and e["t"] < released["t"]]
    assert len(alone) >= 20, f"replica 0 committed {len(alone)} steps alone in 3 s"
    rejoin = run.events("membership")[-1]
    assert rejoin["replicas"] == [0, 1]
    assert rejoin["t"] > released["t"] - 0.1, "replica 1 was asked back while rank 2 was stuck"


def _left_out_member_fenced(run: Run) -> None:
    """As above, but rank 2 stays wedged for good. Left out of the generation without
    replica 1, it is never asked back while inside generation 0; the controller fences that
    very process once it has been there a collective timeout (3 s) past the plan that
    superseded it (``leave_timeout``, never ``join_timeout``: it was never asked to join),
    ranks 0 and 1 training alone meanwhile, and the slot's fresh process rejoins."""
    hang, kill = run.injection(0), run.injection(1)
    assert (hang["rank"], kill["rank"]) == (2, 3)
    fenced = [e for e in run.detected(after=hang["t"])
              if e["cause"] in ("leave_timeout", "join_timeout", "heartbeat_timeout")]
    assert [(e["cause"], e["rank"], e["pid"], e["generation"]) for e in fenced] == [
        ("leave_timeout", 2, hang["pid"], 0)], fenced
    assert 3.0 <= fenced[0]["waited_s"] < 4.5, fenced[0]
    log = run.dir / "output" / "membership.jsonl"
    generations = [json.loads(line)["replicas"] for line in log.read_text().splitlines()]
    assert generations == [[0, 1], [0], [0, 1]]
    (dropped,) = [e for e in run.events("membership") if e["replicas"] == [0]]
    alone = [e for e in run.events("step") if e["rank"] == 0
             and e["generation"] == dropped["generation"]]
    assert len(alone) >= 20, f"replica 0 committed {len(alone)} steps alone"
    after = [e for e in run.events("step") if e["t"] > hang["t"]]
    assert hang["pid"] not in {e["pid"] for e in after}
    assert {e["rank"] for e in after if e["t"] > fenced[0]["t"]} == {0, 1, 2, 3}


def _kill_during_elastic_recovery(run: Run) -> None:
    """The returning rank 1 died inside its recovery, after the rejoining generation agreed
    on the step and before any state moved; replica 0 was dropped twice and rejoined, and
    every generation's state came from live members: no snapshot was needed, although one
    survivor's sync had failed with the dying receiver on its other end."""
    first, second = run.injection(0), run.injection(1)
    assert (second["rank"], second["phase"]) == (1, "restore")
    assert second["t"] > first["t"]
    rejoins = [e for e in run.events("membership") if e["replicas"] == [0, 1]]
    assert any(first["t"] < e["t"] < second["t"] for e in rejoins), "killed outside a rejoin"
    log = run.dir / "output" / "membership.jsonl"
    generations = [json.loads(line)["replicas"] for line in log.read_text().splitlines()]
    assert generations.count([1]) >= 2
    assert generations[-1] == [0, 1]
    assert not run.events("checkpoint_loaded"), "a state came from the snapshots"
    (check,) = [c for c in run.record["checks"] if c["name"] == "params_match"]
    assert "independent replay" in check["message"], check


def _wedged_member_fenced(run: Run) -> None:
    """Rank 1 wedged for good in its gradient all_reduce and kept beating: only its absence
    from the regrouped generation's start line gave it away. The controller fenced that very
    process there (``join_timeout``, never a heartbeat), dropped its replica while rank 0
    trained on alone, and a fresh process of the slot rejoined; the wedged one committed
    nothing after the fault."""
    hit = run.injection()
    found = run.detected(after=hit["t"])
    assert found, "nobody reported the wedged collective"
    assert found[0]["cause"] == "collective_timeout", found[0]
    fenced = [e for e in found if e["cause"] in ("join_timeout", "heartbeat_timeout")]
    assert [(e["cause"], e["rank"], e["pid"]) for e in fenced] == [
        ("join_timeout", 1, hit["pid"])], fenced
    log = run.dir / "output" / "membership.jsonl"
    generations = [json.loads(line)["replicas"] for line in log.read_text().splitlines()]
    assert generations == [[0, 1], [0], [0, 1]]
    after = [e for e in run.events("step") if e["t"] > hit["t"]]
    assert {e["rank"] for e in after if e.get("replicas") == 1} == {0}
    assert hit["pid"] not in {e["pid"] for e in after}
    assert {e["rank"] for e in after if e["t"] > fenced[0]["t"]} == {0, 1}
    (check,) = [c for c in run.record["checks"] if c["name"] == "params_match"]
    assert "independent replay" in check["message"], check


def _fingerprints(run: Run) -> None:
    """The flipped weight is caught by the next cross-replica fingerprint (every 10 steps,
    the trainer's default), on the flipped rank's shard only, and the run rolls back to the
    last agreed step."""
    flipped_at = _step_at(run, run.injection()["t"])
    shard = run.injection()["rank"] % run.system.world.shards
    found = [e for e in run.events("failure_detected") if e["cause"] == "fingerprint_mismatch"]
    assert [e.get("shard") for e in found] == [shard], found
    assert found[0]["step"] % 10 == 0
    # (one step more when the flip lands while a step's fingerprint is being taken)
    assert flipped_at < found[0]["step"] <= flipped_at + 11, (flipped_at, found)
    assert 0 < run.record["metrics"]["lost_steps"] <= 10


def _skips_newest(reason: str) -> Callable[[Run], None]:
    """Rank 1's newest checkpoint was damaged and rank 0 killed at the same moment: after the
    restart, rank 1 (only) rejects that checkpoint for ``reason`` and every rank resumes
    from the one before it."""

    def check(run: Run) -> None:
        saved = [e["step"] for e in run.events("checkpoint_saved")]
        skipped = run.events("checkpoint_skipped")
        assert [e["rank"] for e in skipped] == [1], skipped
        damaged = skipped[0]["step"]
        assert re.match(reason, skipped[0]["reason"]), skipped
        assert damaged in saved[2:]  # the third save, or a later one if the fault came late
        loaded = run.events("checkpoint_loaded")
        assert sorted(e["rank"] for e in loaded) == run.ranks
        assert {e["step"] for e in loaded} == {saved[saved.index(damaged) - 1]}

    return check


def _crash_during_save(run: Run) -> None:
    """Rank 0 died inside the save of step 30, between the shard writes and the commit: every
    rank's shard of that step was durable and the step never committed. The restarted world
    skipped the uncommitted folder (not even a candidate, so nothing is reported skipped),
    resumed from the previous committed step, and saved step 30 again later."""
    kill = run.injection()
    torn = run.system.checkpoint_every * 3
    assert (kill["rank"], kill["step"], kill["phase"]) == (0, torn, "save")
    written = {e["rank"] for e in run.events("checkpoint_written")
               if e["step"] == torn and e["t"] < kill["t"]}
    assert written == set(run.ranks), "the kill did not wait for every shard of the step"
    saved = [(e["step"], e["t"]) for e in run.events("checkpoint_saved")]
    assert all(step != torn for step, t in saved if t < kill["t"]), "the step was committed"
    loaded = run.events("checkpoint_loaded")
    assert sorted(e["rank"] for e in loaded) == run.ranks
    assert {e["step"] for e in loaded} == {torn - run.system.checkpoint_every}
    assert not run.events("checkpoint_skipped")
    assert any(step == torn and t > kill["t"] for step, t in saved)


def _full_disk(run: Run) -> None:
    """Saves failed with ENOSPC while the disk was full; the run never restarted."""
    failed = run.events("checkpoint_failed")
    assert failed
    assert all(e["error"].startswith("ENOSPC") for e in failed)
    assert {e["generation"] for e in run.events("hello")} == {0}


def _straggler(run: Run) -> None:
    """The slowed rank is named while it is slowed (or by the window that ends just after),
    not merely at some moment of the run."""
    slowed = run.injection()
    (healed,) = run.events("fault_healed")
    named = [e["t"] for e in run.events("straggler_detected")
             if e["slow_rank"] == slowed["rank"] and slowed["t"] <= e["t"] <= healed["t"] + 5]
    assert named, run.events("straggler_detected")


def _resumed_from_the_last_save(run: Run, fault_t: float) -> None:
    """Every rank resumed from the newest checkpoint saved before ``fault_t``, and nothing
    had to be rejected on the way."""
    saved = [e["step"] for e in run.events("checkpoint_saved") if e["t"] < fault_t]
    loaded = [e for e in run.events("checkpoint_loaded") if e["t"] > fault_t]
    assert sorted(e["rank"] for e in loaded) == run.ranks
    assert {e["step"] for e in loaded} == {max(saved)}
    assert not run.events("checkpoint_skipped")


def _power_loss(run: Run) -> None:
    """The lazy filesystem was under the checkpoint folder from launch to the end; the power
    loss landed inside the save after the last committed one (its payload's name had just
    appeared), really lost something, and took every rank down at once."""
    (prepared,) = run.events("fault_prepared")
    hit = run.injection()
    assert prepared["t"] < min(e["t"] for e in run.events("hello"))
    inside = re.fullmatch(r"step_(\d{6})/rank_0\.pt", hit["file"])
    assert inside is not None, hit["file"]
    saved = [e["step"] for e in run.events("checkpoint_saved") if e["t"] < hit["t"]]
    assert int(inside.group(1)) == max(saved) + run.system.checkpoint_every
    lost = re.search(r"\((\d+) bytes\) and (\d+) dir", hit["detail"])
    assert lost is not None, hit["detail"]
    assert int(lost.group(1)) > 0  # the payload it was writing
    assert int(lost.group(2)) > 0  # the new step folder's name
    assert hit["ranks"] == run.ranks
    _resumed_from_the_last_save(run, hit["t"])
    (healed,) = run.events("fault_healed")
    assert healed["t"] > max(e["t"] for e in run.events("params"))
    # Unmounted, the folder itself holds what survived: committed steps only.
    folders = sorted((run.dir / "checkpoints").iterdir())
    assert folders
    assert all((f / "COMMIT").is_file() for f in folders), folders


def _kill_on_file(run: Run) -> None:
    """Rank 0 was killed inside the third save (seen on the disk, not reported by the
    trainer): a rank's first open of or in that step folder waited for the kill, so the
    save could not commit."""
    hit = run.injection()
    third = 3 * run.system.checkpoint_every
    assert hit["file"] == f"step_{third:06d}"
    assert hit["file_held"] is True, hit.get("file_held_why")
    assert hit["held_open"].split("/")[0] == hit["file"]
    assert not [e for e in run.events("checkpoint_saved") if e["t"] < hit["t"]
                and e["step"] == third]
    _resumed_from_the_last_save(run, hit["t"])


def _router_restarted(run: Run) -> None:
    """The launcher saw the router die and started generation 1, which resumed requests
    from the journal; clients resumed their broken streams by request id and offset."""
    killed = run.injection()["t"]
    assert [(e["cause"], e["role"]) for e in run.detected(after=killed)][:1] == [
        ("router_exit", "router")]
    routers = [e for e in run.events("hello") if e.get("role") == "router"]
    assert [e["generation"] for e in routers] == [0, 1]
    assert run.injection()["pid"] == routers[0]["pid"]
    (recovered,) = [e for e in run.events("recovery_done") if e.get("role") == "router"]
    assert recovered["resumed"] > 0
    assert any(e["resumes"] for e in run.events("request_done"))


def _caught_on_a_hit(run: Run) -> None:
    """The poisoned block was idle: only a prefix-cache hit read it, and was caught there."""
    injected = run.injection()
    assert injected["tensor"] == "kv:idle_prefix"
    found = [e for e in run.detected(after=injected["t"]) if e["cause"] == "kv_checksum"]
    assert found
    assert {(e["on"], e["worker"]) for e in found} == {("hit", 0)}


def _clients_resumed_after_fail_stop(run: Run) -> None:
    """Fail-stop errored the in-flight requests; their clients re-POSTed them (resumes) and
    the server started them again (retried), streaming each from the client's offset."""
    killed = run.injection()["t"]
    assert any(e["cause"] == "worker_exit" and e["worker"] == 0
               for e in run.detected(after=killed))
    assert [e.get("recovery") for e in run.events("recovery_done")] == ["fail_stop"]
    assert not run.events("request_migrated")
    assert any(e["resumes"] for e in run.events("request_done"))
    (stats,) = [e for e in run.events("serving_stats") if e["source"] == "process"]
    assert stats["requests"]["retried"] > 0


def _nodes_in_one_world(restarts: list[int]) -> Callable[[Run], None]:
    """A node scenario: every rank said hello again after the fault, from its node, all
    naming one generation (the trainer's newest restart count over the world, though
    torchrun counts per node); the engine restarted the nodes ``restarts`` times."""

    def check(run: Run) -> None:
        hit = run.injection()
        before = [e for e in run.events("hello") if e["t"] < hit["t"]]
        after = [e for e in run.events("hello") if e["t"] > hit["t"]]
        assert {(e["rank"], e["node"]) for e in before} == {(0, 0), (1, 1)}, before
        assert {(e["rank"], e["node"]) for e in after} == {(0, 0), (1, 1)}, after
        assert {e["generation"] for e in before} == {0}
        assert len({e["generation"] for e in after}) == 1, after
        assert run.record["metrics"]["generations"] >= 1
        (ended,) = run.events("nodes_ended")
        assert ended["restarts"] == restarts, ended

    return check


def _rank_in_node(run: Run) -> None:
    """The fault hit the host's process of rank 1, which said hello from node 1 with its
    pid inside the node's PID namespace; the node itself lived on."""
    hit = run.injection()
    (hello,) = [e for e in run.events("hello") if e["rank"] == 1 and e["t"] < hit["t"]]
    assert hello["node"] == 1
    assert hit["rank"] == 1
    assert hit["pid"] != hello["pid"], "the node's own pid, not the host's"
    _nodes_in_one_world([0, 0])(run)


def _timed_out(run: Run) -> None:
    """A silent node (no packets, or frozen): its peer's collective aborted on its timeout,
    not on a closed connection."""
    hit = run.injection()
    first = run.detected(after=hit["t"])[0]
    assert first["cause"] == "collective_timeout", first
    assert first["t"] - hit["t"] >= 4.0  # the 5 s collective timeout, less clock slack
    _nodes_in_one_world([0, 0])(run)


def _timed_out_while_held(run: Run) -> None:
    """As `_timed_out`, and the timeout came while node 1 was frozen or cut off (the fault
    holds until it, `duration: {until}`): a collective that completed after the heal proves
    nothing."""
    (healed,) = run.events("fault_healed")
    assert healed.get("until_seen") is True, \
        f"not observed: rank 0 detected nothing while the fault held node 1 ({healed})"
    _timed_out(run)


def _node_replaced_by_spare(run: Run) -> None:
    """Node 1 died and stayed down; nobody was left there to report it, so the controller
    learnt it from the silent heartbeat, and node 0's warm spare (said hello as a spare
    before the fault) took rank 1 over from its live peer: no checkpoint was loaded, no
    torchrun restart (rank 0 said hello once), and the engine restarted no node."""
    hit = run.injection()
    hellos = run.events("hello")
    before = {(e["rank"], e["node"], e.get("role")) for e in hellos if e["t"] < hit["t"]}
    assert before == {(0, 0, "trainer"), (1, 1, "trainer"), (None, 0, "spare")}, before
    (spare,) = [e for e in hellos if e.get("role") == "spare"]
    after = [e for e in hellos if e["t"] > hit["t"]]
    assert [(e["rank"], e["node"], e["pid"]) for e in after] == [(1, 0, spare["pid"])], after
    causes = [(e["cause"], e.get("rank")) for e in run.detected(after=hit["t"])]
    assert ("heartbeat_timeout", 1) in causes, causes
    assert "process_exit" not in {cause for cause, _ in causes}, causes
    assert not run.events("checkpoint_loaded")
    (ended,) = run.events("nodes_ended")
    assert ended["restarts"] == [0, 0], ended


def _frozen_node_fenced_from_afar(run: Run) -> None:
    """Node 1 froze: the controller, on node 0, fenced its rank through the heartbeat
    counter and node 0's spare took rank 1 over. When node 1 thawed its old rank never
    committed again (it read the fence and killed itself), and its supervisor's fresh
    process there waited as a spare to the end."""
    hit = run.injection()
    (healed,) = run.events("fault_healed")
    # The freeze holds until the spare's hello for rank 1 (`duration: {until}`), so the
    # take-over falls inside it however loaded the machine; without that hello it proves nothing.
    assert healed.get("until_seen") is True, \
        f"not observed: no take-over of rank 1 while node 1 was frozen ({healed})"
    hellos = run.events("hello")
    (old,) = [e for e in hellos if e["rank"] == 1 and e["t"] < hit["t"]]
    assert old["node"] == 1
    took = [e for e in hellos if e["rank"] == 1 and e["t"] > hit["t"]]
    assert [(e["node"], e["t"] < healed["t"]) for e in took] == [(0, True)], took
    back = [e for e in hellos if e["t"] > healed["t"]]
    assert [(e["role"], e["node"], e["slot"]) for e in back] == [("spare", 1, old["slot"])]
    assert back[0]["pid"] != old["pid"]
    # The old rank could only commit in generation 0; the spare's steps are generation 1's.
    late = [e for e in run.events("step") if e["rank"] == 1 and e["t"] > healed["t"]]
    assert late
    assert {e["generation"] for e in late} == {1}, late
    causes = [e["cause"] for e in run.detected(after=hit["t"])]
    assert causes[0] == "heartbeat_timeout", causes
    (ended,) = run.events("nodes_ended")
    assert ended["restarts"] == [0, 0], ended


EVIDENCE: dict[str, Callable[[Run], None]] = {
    "nodes/freeze_node_hot_spare": _frozen_node_fenced_from_afar,
    "nodes/kill_node_hot_spare": _node_replaced_by_spare,
    "nodes/kill_node_restart": _nodes_in_one_world([0, 1]),
    "nodes/kill_rank_in_node_restart": _rank_in_node,
    "nodes/partition_node_restart": _timed_out_while_held,
    "nodes/freeze_node_restart": _timed_out_while_held,
    "training/fault_free": _fault_free,
    "training/kill_rank_restart": _kill_rank_restart,
    "training/freeze_rank_restart": _freeze_rank_restart,
    "training/kill_during_recovery_restart": _kill_during_restart_recovery,
    "training/kill_rank_hot_spare": _kill_rank_hot_spare,
    "training/nan_gradient_rollback": _nan_gradient_rollback,
    "training/kill_shard_hot_spare": _kill_shard_hot_spare,
    "training/nan_every_rank_hot_spare": _nan_on_every_rank,
    "training/fingerprint_mismatch_every_rank_hot_spare": _rolled_back_everywhere,
    # Snapshots every 10 steps, the shard lost at step 25: back to step 20.
    "training/kill_shard_between_snapshots_hot_spare": _snapshot_restored(20),
    # Snapshots every 4; shard 0 lost inside step 28, shard 1's snapshot of 28 sent: 24.
    "training/kill_shard_mid_snapshot_hot_spare": _snapshot_restored(24),
    "training/kill_rank_elastic": _elastic,
    "training/kill_during_recovery_elastic": _kill_during_elastic_recovery,
    "training/kill_rank_peer_hung_elastic": _survivors_left_the_wedged_generation,
    "training/kill_rank_peer_hung_forever_elastic": _left_out_member_fenced,
    "faults/memory_bitflip_param_fingerprint": _fingerprints,
    "faults/storage_corrupt_checkpoint": _skips_newest("sha256 mismatch"),
    "faults/storage_truncate_checkpoint": _skips_newest("size mismatch"),
    "faults/storage_delete_checkpoint": _skips_newest("unreadable: FileNotFoundError"),
    "faults/storage_crash_during_save": _crash_during_save,
    "faults/storage_full_checkpoint": _full_disk,
    "faults/straggle_rank": _straggler,
    "faults/storage_lose_unsynced": _power_loss,
    "faults/storage_kill_on_file": _kill_on_file,
    "serving/kill_router": _router_restarted,
    "serving/poison_idle_prefix_block": _caught_on_a_hit,
    "serving/fail_stop_resume": _clients_resumed_after_fail_stop,
    # The NaN of rank 1 spreads to rank 3 (shard 1) through the average, not to shard 0.
    "faults/memory_nan_gradient": _vote({1, 3}),
    # Every rank's own: the vote's count reaches the world's size.
    "faults/memory_nan_every_rank": _vote({0, 1, 2, 3}),
    # Corrupted after the average, on rank 1 alone: it takes rank 3's state (its shard's
    # other replica) at the next step.
    "faults/collective_corrupt_nan": _repaired(1, source=3),
    "faults/collective_error_hot_spare": _regrouped("collective_error"),
    # The same on 2 x 2: shard 0 averages step 25, shard 1 does not, and nobody commits it.
    "training/collective_error_one_shard_hot_spare": _regrouped("collective_error"),
    "faults/collective_hang_elastic": _regrouped("collective_timeout"),
    "faults/collective_hang_elastic_forever": _wedged_member_fenced,
    "found/kill_before_params_elastic": _killed_before_params,
    "found/kill_on_exit_hot_spare": _left_before_killed,
}


def key(scenario: Path) -> str:
    return f"{scenario.parent.name}/{scenario.stem}"


def assert_passed_and_healed(run: Run) -> None:
    assert run.record["passed"] is True, run.record["checks"]
    # Every fault was undone: the heal journal of this test's state folder is empty.
    journal = Path(os.environ["AFTERSHOCK_STATE_DIR"]) / "journal"
    assert not list(journal.glob("*.jsonl")), "a fault was left unhealed"
    EVIDENCE.get(key(run.scenario), lambda run: None)(run)


def test_pytest_runs_a_shipped_scenario_as_one_test(tmp_path: Path, shared_cache: Path) -> None:
    """One shipped scenario goes through the pytest plugin (the README's way), and only there."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(VIA_PYTEST), "-p", "no:cacheprovider", "-q",
         f"--aftershock-run-dir={tmp_path / 'r'}"],
        capture_output=True, text=True, timeout=580, cwd=ROOT,
        env={**os.environ, "AFTERSHOCK_CACHE_DIR": str(shared_cache)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    name = load_scenario(VIA_PYTEST).spec.name
    record = json.loads((tmp_path / "r" / name / "result.json").read_text())
    assert_passed_and_healed(Run(VIA_PYTEST, record))


# scenarios/slurm/ need a Slurm cluster: tests/slurm/test_slurm_scenarios.py (make test-slurm).
SCENARIOS = sorted(p for p in (ROOT / "scenarios").rglob("*.yaml")
                   if p != VIA_PYTEST and "slurm" not in p.relative_to(ROOT).parts)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[key(p) for p in SCENARIOS])
def test_shipped_scenario_passes(scenario: Path, tmp_path: Path, shared_cache: Path) -> None:
    loaded = load_scenario(scenario)
    try:
        preflight(loaded)
    except PreflightError as exc:  # a machine without nftables, root, ...: say what is missing
        pytest.skip(str(exc))
    if isinstance(loaded.spec.system, NodesSystem):
        problem = docker_engine.engine_problem()
        if problem is not None and os.environ.get("AFTERSHOCK_REQUIRE_DOCKER") == "1":
            pytest.fail(f"AFTERSHOCK_REQUIRE_DOCKER=1 but {problem}")
        if problem is not None:  # a laptop without an engine: say what is missing
            pytest.skip(problem)
    out = tmp_path / "out.json"
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(tmp_path / "r"),
               cache=shared_cache, timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    (record,) = json.loads(out.read_text())
    assert_passed_and_healed(Run(scenario, record))


def test_every_evidence_names_a_shipped_scenario() -> None:
    assert set(EVIDENCE) <= {key(p) for p in [*SCENARIOS, VIA_PYTEST]}
