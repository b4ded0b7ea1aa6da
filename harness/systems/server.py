"""``reference: server``: the reference LLM serving stack
(aftershock.reference_impl.serving.server),
a router and worker processes, driven by the built-in load generator."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from aftershock.harness.run.loadgen import Load, LoadDriver
from aftershock.harness.run.loadgen import twin_key as load_key
from aftershock.harness.run.logprobe import LogProbe
from aftershock.harness.run.target import Launch, LocalTarget, Target
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario.schema import MAX_SEED, Duration, Strict
from aftershock.harness.systems import Driver, register
from aftershock.harness.systems._reference import fingerprint


class ServerSystem(Strict):
    """The reference LLM serving stack (``aftershock.reference_impl.serving.server``): a router and
    worker processes, driven by the built-in load generator."""

    reference: Literal["server"]
    workers: int = Field(3, ge=1, le=32, description="worker processes behind the router")
    recovery: Literal["migrate", "fail_stop"] = Field(
        "migrate",
        description="migrate: a failed worker's in-flight requests move to healthy workers "
        "with the tokens emitted so far; fail_stop: every in-flight request is aborted and "
        "the stack restarts cold, clients retry (today's common baseline)",
    )
    model_seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the model's weights")
    journal: bool = Field(True, description="write-ahead journal of requests and tokens")
    checksums: bool = Field(True, description="KV block checksums")
    batch_invariant: bool = Field(True, description="batch-invariant kernels")
    max_batch: int = Field(16, ge=1, le=4096, description="requests decoded together per worker")
    heartbeat: Duration = Field(timedelta(milliseconds=100), description="worker heartbeat")
    dead_after: Duration = Field(
        timedelta(seconds=1), description="no heartbeat for this long: the worker is dead"
    )
    wedged_after: Duration = Field(
        timedelta(seconds=2), description="busy without progress for this long: wedged"
    )
    step_sleep: Duration = Field(
        timedelta(0), description="extra time per engine step, to make a short run long enough"
    )
    args: list[str] = Field(
        default_factory=list,
        description="extra server options "
        "(python -m aftershock.reference_impl.serving.server --help)",
    )
    load: Load = Load()
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")


def server_argv(system: ServerSystem) -> list[str]:
    """The reference server's launcher (router + workers); it says where it listens
    through the probe's ``serving_ready`` event."""

    def seconds(value: timedelta) -> str:
        return f"{value.total_seconds():g}"

    flags = [
        ("--no-journal", not system.journal),
        ("--no-checksums", not system.checksums),
        ("--no-batch-invariant", not system.batch_invariant),
    ]
    return [
        sys.executable,
        "-m",
        "aftershock.reference_impl.serving.server",
        f"--workers={system.workers}",
        f"--seed={system.model_seed}",
        f"--max-batch={system.max_batch}",
        f"--recovery={system.recovery}",
        f"--heartbeat={seconds(system.heartbeat)}",
        f"--dead-after={seconds(system.dead_after)}",
        f"--wedged-after={seconds(system.wedged_after)}",
        f"--step-sleep={seconds(system.step_sleep)}",
        *[flag for flag, on in flags if on],
        *system.args,
    ]


#: Settings that never change a fault-free run's tokens (the model, the kernels and the load
#: do; of the load, harness.run.loadgen.LOAD_TIMING says what does not).
TIMING = (
    "step_sleep",
    "timeout",
    "heartbeat",
    "dead_after",
    "wedged_after",
    "recovery",
    "journal",
    "checksums",
)


class Server:
    name = "server"
    model = ServerSystem
    tag = ("reference", "server")
    shape = "`reference: server`"
    order = 20
    family: Literal["serving"] = "serving"
    golden: Literal["outputs"] = "outputs"

    def launch(
        self,
        system: ServerSystem,
        *,
        run_dir: Path,
        scenario_dir: Path,
        seed: int,
        extra_args: tuple[str, ...] = (),
    ) -> Launch:
        return Launch(
            [*server_argv(system), *extra_args], Path.cwd(), dict(system.env), system.workers, ()
        )

    def target(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline) -> Target:
        return LocalTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)

    def capabilities(self, system: ServerSystem | None) -> frozenset[str]:
        return LocalTarget.capabilities

    def probe(self, system: ServerSystem | None, scenario_dir: Path | None) -> str | None:
        return None  # every worker calls harness.probe.install()

    def world(self, system: ServerSystem) -> int | None:
        return system.workers

    def steps(self, system: ServerSystem) -> int | None:
        return None

    def default_root(self, system: ServerSystem, run_dir: Path) -> Path:
        return run_dir

    def root_is_run_folder(self, system: ServerSystem) -> bool:
        return True

    def twin(self, system: ServerSystem) -> ServerSystem:
        return system.model_copy(update={"step_sleep": timedelta(0)})

    def twin_key(self, system: ServerSystem) -> dict[str, Any]:
        data: dict[str, Any] = system.model_dump(mode="json")
        for name in (*TIMING, "env"):
            data.pop(name, None)
        data["load"] = load_key(system.load)
        return data

    def fingerprint(self, system: ServerSystem, scenario_dir: Path) -> str:
        return fingerprint(("*.py", "serving/*.py"))

    def device(self, system: ServerSystem) -> str:
        args = " ".join(system.args)
        return "cuda" if "--device=cuda" in args or "--device cuda" in args else "cpu"

    def driver(self, system: ServerSystem, *, seed: int, timeline: Timeline) -> Driver | None:
        # The server runs until its load is served: the load generator starts when the
        # server says where it listens and the run ends when the last request has.
        # Where the server keeps its journal (reference_impl/serving/server.py's default,
        # under the run's output folder): read after the load, against what clients saw.
        journal = (
            timeline.path.parent / "output" / "journal" / "journal.wal" if system.journal else None
        )
        return LoadDriver(system.load, seed=seed, timeline=timeline, journal=journal)

    def log_probes(self, system: ServerSystem) -> list[LogProbe]:
        return []

    def replays(self, system: ServerSystem) -> bool:
        return False

    def file_problems(
        self, system: ServerSystem, scenario_dir: Path
    ) -> list[tuple[tuple[str | int, ...], str]]:
        return []

    def problems(self, scenario: Any) -> list[str]:
        return []

    def unresolved(self, system: ServerSystem, target: Any, probed: bool) -> str | None:
        """Why ``target`` can never name a process of the reference server, or None: its
        workers (which report their index as their rank) are ``workers`` many, and it has
        no warm spare and no replicas or shards."""
        index = target.index
        if index is not None and index >= system.workers:
            return (f"the server's {system.workers} workers are workers "
                    f"0-{system.workers - 1}; give one of them, or correct `workers`")
        if target.role == "spare":
            return "the server has no warm spare (a spare is the hot_spare trainer's)"
        if target.replica is not None or target.shard is not None:
            return "the server's workers have no replica or shard: name one with `worker: N`"
        return None

    def unawaited(self, system: ServerSystem, after: Any) -> str | None:
        """Why the server never says the ``hello`` that ``after`` waits for, or None (any
        other event: None): its router says it as role ``router``, its workers as role
        ``worker``."""
        roles = ("router", "worker")
        if after.event == "hello" and after.role is not None and after.role not in roles:
            return (f"the server never says hello as role {after.role} (its roles here: "
                    f"{', '.join(roles)}); a fault waiting for it would wait for the whole "
                    "run")
        return None


SERVER = register(Server())
