"""``reference: trainer``: the reference fault-tolerant trainer (aftershock.reference_impl.trainer)
under torchrun, as local processes."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from aftershock.harness.run.logprobe import LogProbe
from aftershock.harness.run.target import Launch, LocalTarget, Target
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.schema import MAX_STEPS, MAX_WORLD, Duration, Strict
from aftershock.harness.systems import Driver, register
from aftershock.harness.systems._reference import fingerprint
from aftershock.reference_impl import launch


class World(Strict):
    """Shape of the reference trainer: data-parallel replicas × sharded ranks."""

    replicas: int = Field(2, ge=1, le=64, description="data-parallel replica groups")
    shards: int = Field(2, ge=1, le=64, description="tensor-parallel ranks per replica")

    @model_validator(mode="after")
    def _fits_one_host(self) -> World:
        if self.size > MAX_WORLD:
            raise ValueError(f"{self.size} processes (replicas × shards); at most {MAX_WORLD} "
                             "on one host")
        return self

    @property
    def size(self) -> int:
        return self.replicas * self.shards


class TrainerSystem(Strict):
    """The reference fault-tolerant trainer (``aftershock.reference_impl.trainer``) under
    torchrun."""

    reference: Literal["trainer"]
    world: World = World()
    backend: Literal["gloo", "nccl"] = "gloo"
    recovery: Literal["restart", "hot_spare", "elastic"] = Field(
        "restart",
        description="restart: torchrun relaunches the world from a checkpoint; hot_spare: warm "
        "standby ranks take over from in-memory peer snapshots; elastic: survivors go on with "
        "fewer replicas and a returning replica heals from a live peer",
    )
    spares: int = Field(1, ge=0, le=16, description="warm standby processes (hot_spare)")
    snapshot_every: int = Field(
        1, ge=1, le=MAX_STEPS,
        description="in-memory peer snapshot interval, in steps (hot_spare, elastic)"
    )
    steps: int = Field(200, ge=1, le=MAX_STEPS, description="optimizer steps to train")
    checkpoint_every: int = Field(20, ge=1, le=MAX_STEPS,
                                  description="durable checkpoint interval, in steps")
    max_restarts: int = Field(3, ge=0, le=1000, description="torchrun --max-restarts")
    collective_timeout: Duration = Field(
        timedelta(seconds=3), description="how long a collective may wait before it aborts"
    )
    step_sleep: Duration = Field(
        timedelta(0), description="extra time per step, to make a short run long enough to hit"
    )
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")


def trainer_argv(system: TrainerSystem, run_dir: Path, seed: int) -> list[str]:
    """torchrun running the reference trainer: the harness reaches it only by command line.
    torchrun is started warm (reference_impl/launch.py): it forks the ranks from an
    interpreter that has imported torch and the trainer once."""
    spares = system.spares if system.recovery == "hot_spare" else 0
    return [
        sys.executable,
        "-u",
        "-m",
        "aftershock.reference_impl.launch",
        "--standalone",
        f"--nproc-per-node={system.world.size + spares}",
        f"--max-restarts={system.max_restarts}",
        # Short monitor interval: the agent's reaction to a dead worker is part of
        # what `restart` recovery costs; the 0.1 s default is already fine, be explicit.
        "--monitor-interval=0.1",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "--tee=3",
        *trainer_program(system, run_dir, seed),
    ]


def trainer_program(system: TrainerSystem, run_dir: Path, seed: int) -> list[str]:
    """What torchrun starts on every rank: the reference trainer and its flags (also on the
    nodes of a multi-node run, harness/systems/nodes.py)."""
    spares = system.spares if system.recovery == "hot_spare" else 0
    extra = [f"--spares={spares}"] if spares else []
    if system.recovery in ("hot_spare", "elastic"):  # the two that keep peer-memory snapshots
        extra.append(f"--snapshot-every={system.snapshot_every}")
    return [
        "-m",
        "aftershock.reference_impl.trainer",
        f"--replicas={system.world.replicas}",
        f"--shards={system.world.shards}",
        f"--steps={system.steps}",
        f"--seed={seed}",
        f"--checkpoint-every={system.checkpoint_every}",
        f"--checkpoint-dir={run_dir / 'checkpoints'}",
        f"--collective-timeout={system.collective_timeout.total_seconds():g}",
        f"--recovery={system.recovery}",
        f"--backend={system.backend}",
        f"--step-sleep={system.step_sleep.total_seconds():g}",
        f"--device={'cuda' if system.backend == 'nccl' else 'cpu'}",
        *extra,
    ]


#: Settings that pace a run, detect failures, or keep what only recovery uses: they never
#: change a fault-free run's math. The recovery strategy stays: a different runtime.
TIMING = ("step_sleep", "timeout", "collective_timeout", "max_restarts", "checkpoint_every",
          "spares", "snapshot_every")


class Trainer:
    name = "trainer"
    model = TrainerSystem
    tag = ("reference", "trainer")
    shape = "`reference: trainer`"
    order = 10
    family: Literal["training"] = "training"
    golden: Literal["digests"] = "digests"

    def launch(self, system: TrainerSystem, *, run_dir: Path, scenario_dir: Path, seed: int,
               extra_args: tuple[str, ...] = ()) -> Launch:
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **system.env}
        argv = [*trainer_argv(system, run_dir, seed), *extra_args]
        return Launch(argv, Path.cwd(), env, system.world.size, (), warm=launch.PRELOAD)

    def target(self, launch: Launch, *, run_dir: Path, run_id: str,
               timeline: Timeline) -> Target:
        return LocalTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)

    def capabilities(self, system: TrainerSystem | None) -> frozenset[str]:
        return LocalTarget.capabilities

    def probe(self, system: TrainerSystem | None, scenario_dir: Path | None) -> str | None:
        return None  # reference_impl calls harness.probe.install() in every rank

    def world(self, system: TrainerSystem) -> int | None:
        return system.world.size

    def steps(self, system: TrainerSystem) -> int | None:
        return system.steps

    def default_root(self, system: TrainerSystem, run_dir: Path) -> Path:
        return run_dir / "checkpoints"

    def root_is_run_folder(self, system: TrainerSystem) -> bool:
        return False

    def twin(self, system: TrainerSystem) -> TrainerSystem:
        return system.model_copy(update={"step_sleep": timedelta(0)})

    def twin_key(self, system: TrainerSystem) -> dict[str, Any]:
        data: dict[str, Any] = system.model_dump(mode="json")
        for name in (*TIMING, "env"):
            data.pop(name, None)
        return data

    def fingerprint(self, system: TrainerSystem, scenario_dir: Path) -> str:
        return fingerprint(("*.py",))

    def device(self, system: TrainerSystem) -> str:
        return "cuda" if system.backend == "nccl" else "cpu"

    def driver(self, system: TrainerSystem, *, seed: int, timeline: Timeline) -> Driver | None:
        return None

    def log_probes(self, system: TrainerSystem) -> list[LogProbe]:
        return []

    def replays(self, system: TrainerSystem) -> bool:
        # Only elastic recovery writes the membership of every generation.
        return system.recovery == "elastic"

    def file_problems(self, system: TrainerSystem, scenario_dir: Path
                      ) -> list[tuple[tuple[str | int, ...], str]]:
        return []

    def problems(self, scenario: Any) -> list[str]:
        return []

    def unresolved(self, system: TrainerSystem, target: Any, probed: bool) -> str | None:
        """Why ``target`` can never name a process of the reference trainer, or None. Its
        ranks are those of ``world`` (a warm spare that took a rank over reports that rank:
        the spares add none), so are its replicas and shards; only ``hot_spare`` with spares
        has a warm spare, and a router is the server's."""
        world = system.world
        shape = f"the trainer's world ({world.replicas} replicas × {world.shards} shards)"
        for name, value, size in (("rank", target.rank, world.size),
                                  ("worker", target.worker, world.size),
                                  ("replica", target.replica, world.replicas),
                                  ("shard", target.shard, world.shards)):
            if value is not None and value >= size:
                what = "ranks" if name in ("rank", "worker") else f"{name}s"
                return (f"{shape} has {what} 0-{size - 1}; give one of them, or correct "
                        "`world`")
        if target.role == "spare" and not _spares(system):
            return ("only `recovery: hot_spare` with `spares` of 1 or more has warm spares; "
                    f"this trainer's recovery is {system.recovery}"
                    + (" with `spares: 0`" if system.recovery == "hot_spare" else ""))
        if target.role == "router":
            return "a router is the reference server's (`reference: server`); the trainer " \
                "has no router"
        return None

    def unawaited(self, system: TrainerSystem, after: Any) -> str | None:
        """Why the trainer never says the ``hello`` that ``after`` waits for, or None (any
        other event: None). Its ranks say hello as ranks of ``world``; a warm spare says it
        as role ``spare``, and a process that takes a rank over (hot_spare, elastic) as role
        ``trainer``."""
        if after.event != "hello":
            return None
        size = system.world.size
        if after.rank is not None and after.rank >= size:
            return (f"the trainer never says hello as rank {after.rank} (its ranks: "
                    f"0-{size - 1})")
        roles = (["spare"] if _spares(system) else []) + (
            ["trainer"] if system.recovery in ("hot_spare", "elastic") else [])
        if after.role is not None and after.role not in roles:
            return (f"the trainer never says hello as role {after.role} (its roles here: "
                    f"{', '.join(roles) or 'none'}); a fault waiting for it would wait for "
                    "the whole run")
        return None


def _spares(system: TrainerSystem) -> int:
    return system.spares if system.recovery == "hot_spare" else 0


TRAINER = register(Trainer())
