"""``nodes: N``: a multi-node job, one container per node on the local Docker engine
(docs/nodes.md), each node running torchrun with c10d rendezvous at node 0: of the reference
trainer (``trainer:``) or of any program (``program:``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from aftershock.harness.nodes.cluster import torchrun_argv
from aftershock.harness.nodes.image import PROJECT_ROOT
from aftershock.harness.run.logprobe import LogProbe
from aftershock.harness.run.target import Launch, Target
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.schema import MAX_STEPS, MAX_WORLD, Duration, Strict
from aftershock.harness.systems import Driver, register
from aftershock.harness.systems._reference import fingerprint
from aftershock.harness.systems.trainer import Trainer, TrainerSystem, World, trainer_program

MAX_NODES = 8  # containers of one run; each costs a torchrun agent and its ranks' start-up
#: torchrun's rendezvous id: one per run is enough, since every run's nodes are on a network
#: of their own.
RDZV_ID = "aftershock"
#: hot_spare: how long node 0's agent, its ranks done, waits for the lost node's agent (which
#: never comes) in torchrun's exit barrier, instead of torchrun's 300 s.
EXIT_BARRIER_S = 10.0


class NodeTrainer(Strict):
    """The reference trainer on every rank of every node (``aftershock.reference_impl.trainer``),
    its
    world the nodes' ranks: ``nodes × per_node`` = replicas × ``shards``; under ``hot_spare``
    node 0 runs ``spares`` more processes."""

    shards: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per replica")
    recovery: Literal["restart", "hot_spare", "elastic"] = Field(
        "restart", description="restart: every node's torchrun relaunches its ranks, which "
        "resume from the shared checkpoint; hot_spare: warm spares on node 0 take over a lost "
        "node's ranks from a live peer, nothing restarts; elastic: not across nodes "
        "(docs/nodes.md says why)")
    spares: int = Field(1, ge=1, le=16, description="hot_spare: warm standby processes, all "
                        "on node 0 (which hosts the rendezvous and the controller): at least "
                        "per_node, to replace every rank of a lost node")
    steps: int = Field(200, ge=1, le=MAX_STEPS, description="optimizer steps to train")
    checkpoint_every: int = Field(20, ge=1, le=MAX_STEPS,
                                  description="durable checkpoint interval, in steps")
    collective_timeout: Duration = Field(
        timedelta(seconds=5), description="how long a collective may wait before it aborts")
    step_sleep: Duration = Field(
        timedelta(0), description="extra time per step, to make a short run long enough to hit")


class NodesSystem(Strict):
    """N nodes (containers), each running torchrun with ``per_node`` ranks."""

    nodes: int = Field(ge=2, le=MAX_NODES, description="containers, one per node")
    per_node: int = Field(1, ge=1, le=MAX_WORLD, description="ranks per node "
                          "(torchrun --nproc-per-node)")
    trainer: NodeTrainer | None = Field(None, description="run the reference trainer")
    program: list[str] | None = Field(
        None, min_length=1, description="run this program on every rank instead (what torchrun "
        "starts: `-m module` or a script, and its arguments), from the scenario's folder; it "
        "reports through the in-process probe")
    world: int | None = Field(None, ge=1, le=MAX_WORLD, description="with `program`: ranks at "
                              "full strength; default: nodes × per_node")
    restart: Literal["no", "on-failure", "always"] = Field(
        "on-failure", description="the engine's restart policy for a node whose launcher "
        "ended (a killed node comes back, as a cluster's supervisor brings a host back)")
    node_restarts: int = Field(2, ge=0, le=100, description="restarts of one node "
                               "(`restart: on-failure`)")
    max_restarts: int = Field(3, ge=0, le=1000, description="torchrun --max-restarts")
    rdzv_conf: str = Field("", pattern=r"^[A-Za-z0-9_=,.]*$", description="torchrun "
                           "--rdzv-conf, e.g. keep_alive_interval=1,keep_alive_max_attempt=2")
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")

    @model_validator(mode="after")
    def _one_program(self) -> NodesSystem:
        if (self.trainer is None) == (self.program is None):
            raise ValueError("give exactly one of `trainer:` (the reference trainer) or "
                             "`program: [...]` as what each node runs")
        size = self.nodes * self.per_node
        if size > MAX_WORLD:
            raise ValueError(f"{size} ranks (nodes × per_node); at most {MAX_WORLD}")
        if self.trainer is not None and size % self.trainer.shards:
            raise ValueError(f"{size} ranks (nodes × per_node) are not a multiple of "
                             f"trainer.shards {self.trainer.shards}")
        if self.trainer is not None and self.world is not None:
            raise ValueError("`world` is for `program`: the trainer's is nodes × per_node")
        if self.trainer is not None and self.trainer.recovery == "elastic":
            raise ValueError(
                "trainer.recovery elastic is not offered across nodes: a lost node's replica "
                "could only come back on a fresh torchrun agent, and torchrun answers any new "
                "agent by restarting every rank of the job (docs/nodes.md); use hot_spare or "
                "restart")
        if self.trainer is not None and self.trainer.recovery == "hot_spare":
            spares = self.trainer.spares
            if spares < self.per_node:
                raise ValueError(
                    f"hot_spare: trainer.spares {spares} cannot replace the {self.per_node} "
                    f"ranks of a lost node (per_node); set trainer.spares: {self.per_node} or "
                    "more")
            if size + spares > MAX_WORLD:
                raise ValueError(f"{size + spares} processes (nodes × per_node + "
                                 f"trainer.spares); at most {MAX_WORLD}")
            if self.restart != "no":
                raise ValueError(
                    f'hot_spare: restart {self.restart!r} would bring a lost node back as a new '
                    "torchrun agent, which node 0's agent answers by restarting every rank "
                    "(torchrun's membership change), throwing the spares' recovery away; set "
                    'restart: "no" (the spares replace the node for good)')
        return self

    @property
    def spares(self) -> int:
        """Processes on node 0 beyond its ranks: the trainer's spares under hot_spare."""
        t = self.trainer
        return t.spares if t is not None and t.recovery == "hot_spare" else 0

    def as_trainer(self) -> TrainerSystem:
        """The reference trainer these nodes run, as one host would run it (its flags, and
        what the oracle recomputes)."""
        assert self.trainer is not None
        t = self.trainer
        size = self.nodes * self.per_node
        return TrainerSystem(
            reference="trainer", world=World(replicas=size // t.shards, shards=t.shards),
            recovery=t.recovery, spares=t.spares, steps=t.steps,
            checkpoint_every=t.checkpoint_every,
            collective_timeout=t.collective_timeout, step_sleep=t.step_sleep,
            max_restarts=self.max_restarts, timeout=self.timeout)


@dataclass(frozen=True, slots=True)
class NodesLaunch(Launch):
    """What each node runs, and how the nodes are made."""

    nodes: int = 2
    restart: str = "on-failure"
    max_restarts: int = 0  # the engine's, per node
    mounts: tuple[str, ...] = ()
    #: Node 0's command when it differs from the others' (``argv``): hot_spare's spares.
    node0_argv: tuple[str, ...] = ()
    #: A node that died and stays down is a lost host, not a failed job (Cluster.poll).
    node_loss_ok: bool = False


#: Settings that pace a run, detect or recover failures: never the math of a fault-free run.
TIMING = ("restart", "node_restarts", "max_restarts", "rdzv_conf", "timeout", "env")
TRAINER_TIMING = ("collective_timeout", "step_sleep", "checkpoint_every", "spares")
#: The reference trainer's rules for what a target or an awaited hello can name.
_TRAINER = Trainer()


class Nodes:
    name = "nodes"
    model = NodesSystem
    tag = ("nodes", None)
    shape = "`nodes: N`"
    order = 40
    family: Literal["training"] = "training"
    golden: Literal["digests"] = "digests"

    def launch(self, system: NodesSystem, *, run_dir: Path, scenario_dir: Path, seed: int,
               extra_args: tuple[str, ...] = ()) -> Launch:
        # Mounted at the same path in every node, whose processes run from another folder.
        run_dir = run_dir.absolute()
        mounts: tuple[str, ...] = ()
        spares = system.spares
        if system.trainer is not None:
            program, cwd = trainer_program(system.as_trainer(), run_dir, seed), PROJECT_ROOT
            if spares:  # node 0's slots come first: its ranks, then the spares
                program.append(f"--first-spare={system.per_node}")
        else:
            assert system.program is not None
            program, cwd = list(system.program), scenario_dir.resolve()
            if not cwd.is_relative_to(PROJECT_ROOT):  # the project is every node's already
                mounts = (f"{cwd}:{cwd}:ro",)

        def node_argv(nproc: int) -> list[str]:
            return torchrun_argv(
                nodes=system.nodes, nproc=nproc, rdzv_host="node0", run_id=RDZV_ID,
                max_restarts=system.max_restarts, log_dir=run_dir / "logs" / "torchrun",
                program=[*program, *extra_args], rdzv_conf=system.rdzv_conf,
                exit_barrier_s=EXIT_BARRIER_S if spares else None)

        node0 = tuple(node_argv(system.per_node + spares)) if spares else ()
        return NodesLaunch(node_argv(system.per_node), cwd, dict(system.env),
                           self.world(system), (), nodes=system.nodes, restart=system.restart,
                           max_restarts=system.node_restarts, mounts=mounts,
                           node0_argv=node0, node_loss_ok=bool(spares))

    def target(self, launch: Launch, *, run_dir: Path, run_id: str,
               timeline: Timeline) -> Target:
        from aftershock.harness.nodes.target import NodesTarget

        assert isinstance(launch, NodesLaunch), "a nodes system's launch comes from launch()"
        return NodesTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline,
                           nodes=launch.nodes, restart=launch.restart,
                           max_restarts=launch.max_restarts, mounts=launch.mounts,
                           node0_argv=launch.node0_argv, node_loss_ok=launch.node_loss_ok)

    def capabilities(self, system: NodesSystem | None) -> frozenset[str]:
        from aftershock.harness.nodes.target import NodesTarget

        return NodesTarget.capabilities

    def probe(self, system: NodesSystem | None, scenario_dir: Path | None) -> str | None:
        if system is None or system.trainer is not None:
            return None  # reference_impl calls harness.probe.install() in every rank
        return "a `program` on nodes is not known to call it"

    def world(self, system: NodesSystem) -> int | None:
        return system.world or system.nodes * system.per_node

    def steps(self, system: NodesSystem) -> int | None:
        return system.trainer.steps if system.trainer is not None else None

    def default_root(self, system: NodesSystem, run_dir: Path) -> Path:
        return run_dir / "checkpoints" if system.trainer is not None else run_dir

    def root_is_run_folder(self, system: NodesSystem) -> bool:
        return system.trainer is None

    def twin(self, system: NodesSystem) -> NodesSystem:
        if system.trainer is None:
            return system
        paced = system.trainer.model_copy(update={"step_sleep": timedelta(0)})
        return system.model_copy(update={"trainer": paced})

    def twin_key(self, system: NodesSystem) -> dict[str, Any]:
        data: dict[str, Any] = system.model_dump(mode="json", exclude_none=True)
        for name in TIMING:
            data.pop(name, None)
        for name in TRAINER_TIMING:
            data.get("trainer", {}).pop(name, None)
        return data

    def fingerprint(self, system: NodesSystem, scenario_dir: Path) -> str:
        if system.trainer is not None:
            return fingerprint(("*.py",))
        return hashlib.sha256(json.dumps(system.program).encode()).hexdigest()

    def device(self, system: NodesSystem) -> str:
        return "cpu"

    def driver(self, system: NodesSystem, *, seed: int, timeline: Timeline) -> Driver | None:
        return None

    def log_probes(self, system: NodesSystem) -> list[LogProbe]:
        return []  # a node's output is kept (logs/node<i>.log), not read while it runs

    def replays(self, system: NodesSystem) -> bool:
        return False

    def file_problems(self, system: NodesSystem, scenario_dir: Path
                      ) -> list[tuple[tuple[str | int, ...], str]]:
        return []

    def problems(self, scenario: Any) -> list[str]:
        nodes = scenario.system.nodes
        return [f"fault {index}: target {{node: {fault.target.node}}}, but the system has "
                f"{nodes} nodes (0..{nodes - 1})"
                for index, fault in enumerate(scenario.faults)
                if fault.target.node is not None and fault.target.node >= nodes]

    def unresolved(self, system: NodesSystem, target: Any, probed: bool) -> str | None:
        """Why ``target`` can never name a process on these nodes, or None: the reference
        trainer's as on one host (its world is nodes × per_node ranks); a program's ranks
        are those of its world."""
        if system.trainer is not None:
            why = _TRAINER.unresolved(system.as_trainer(), target, probed)
            return why.replace("correct `world`", "correct `nodes` or `per_node`") if why \
                else None
        world = self.world(system)
        if target.rank is not None and world is not None and target.rank >= world:
            return (f"the nodes' world ({world} ranks) has ranks 0-{world - 1}; give a rank "
                    "of the world, or correct `world`, `nodes` or `per_node`")
        return None

    def unawaited(self, system: NodesSystem, after: Any) -> str | None:
        """The reference trainer's hellos, as on one host; a program's: None (only the job
        says what it reports)."""
        if system.trainer is None:
            return None
        return _TRAINER.unawaited(system.as_trainer(), after)


NODES = register(Nodes())
