"""Scenario files: the typed, strict, frozen schema and the YAML loader.

The pydantic models below are the truth about what a scenario may say
(``aftershock schema`` publishes them as JSON Schema). The loader keeps every
key's line and column, so each problem is reported as
``path:line:column: where: what is wrong (what is allowed)``.
"""

from __future__ import annotations

import difflib
import re
import signal as _signal
import types
import typing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from harness._duration import Duration
from harness.errors import SpecError

SCENARIO_SUFFIXES = (".yaml", ".yml")

#: Event kinds a log probe may produce (see docs/events.md).
LogEventKind = Literal[
    "step",
    "failure_detected",
    "recovery_done",
    "checkpoint_saved",
    "checkpoint_loaded",
    "params",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class World(_Strict):
    """Shape of the reference trainer: data-parallel replicas × sharded ranks."""

    replicas: int = Field(2, ge=1, le=64, description="data-parallel replica groups")
    shards: int = Field(2, ge=1, le=64, description="tensor-parallel ranks per replica")

    @property
    def size(self) -> int:
        return self.replicas * self.shards


class TrainerSystem(_Strict):
    """The reference fault-tolerant trainer (``reference_impl.trainer``) under torchrun."""

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
        1, ge=1, description="in-memory peer snapshot interval, in steps (hot_spare)"
    )
    steps: int = Field(200, ge=1, description="optimizer steps to train")
    checkpoint_every: int = Field(20, ge=1, description="durable checkpoint interval, in steps")
    max_restarts: int = Field(3, ge=0, description="torchrun --max-restarts")
    collective_timeout: Duration = Field(
        timedelta(seconds=3), description="how long a collective may wait before it aborts"
    )
    step_sleep: Duration = Field(
        timedelta(0), description="extra time per step, to make a short run long enough to hit"
    )
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")


class LogProbe(_Strict):
    """Turns matching output lines of a system that has no probe into timeline events.

    Named groups become event fields: ``step`` (int), ``rank`` (int), ``digest``,
    ``cause``. Lines are matched after torchrun's ``[rank]:`` prefixes are kept,
    so a pattern can capture the rank from them.
    """

    pattern: str
    event: LogEventKind
    stream: Literal["stdout", "stderr", "both"] = "both"

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class CommandSystem(_Strict):
    """Any command line (a torchrun job, a user's server), observed through logs.

    ``${run_dir}`` and ``${scenario_dir}`` in ``command`` and ``env`` values are
    replaced by the run's own folder and the scenario file's folder.
    """

    command: list[str] = Field(min_length=1)
    probes: list[LogProbe] = Field(default_factory=list)
    world: int | None = Field(
        None, ge=1, description="ranks at full strength; default: ranks seen before the fault"
    )
    cwd: str | None = Field(None, description="working directory, relative to the scenario file")
    env: dict[str, str] = Field(default_factory=dict)
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")


class PromptMix(_Strict):
    """Prompt lengths, in tokens (bytes), drawn uniformly with the run's seed."""

    min: int = Field(16, ge=1)
    max: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> PromptMix:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class Load(_Strict):
    """The built-in load generator: streaming OpenAI-style completions, as real clients
    send them (Poisson arrivals, shared system-prompt prefixes, resume on a broken stream).
    Everything is drawn from the run's seed, so the fault-free twin sends the same load."""

    requests: int = Field(40, ge=1, le=100_000, description="requests in all")
    rate: float = Field(20.0, gt=0, description="arrivals per second (Poisson)")
    concurrency: int = Field(16, ge=1, le=1024, description="most requests in flight at once")
    prompt_tokens: PromptMix = PromptMix()
    shared_prefixes: int = Field(
        4, ge=0, description="distinct shared prefixes (system prompts); 0: none"
    )
    prefix_tokens: int = Field(32, ge=0, description="length of each shared prefix")
    max_tokens: int = Field(32, ge=1, le=4096, description="tokens generated per request")
    retries: int = Field(
        20, ge=0, description="times a client resumes a broken stream (same request id, "
        "offset = tokens received) before it gives the request up"
    )
    request_timeout: Duration = Field(
        timedelta(seconds=60), description="a request not finished by then is lost"
    )


class ServerSystem(_Strict):
    """The reference LLM serving stack (``reference_impl.serving.server``): a router and
    worker processes, driven by the built-in load generator."""

    reference: Literal["server"]
    workers: int = Field(3, ge=1, le=32, description="worker processes behind the router")
    recovery: Literal["migrate", "fail_stop"] = Field(
        "migrate",
        description="migrate: a failed worker's in-flight requests move to healthy workers "
        "with the tokens emitted so far; fail_stop: every in-flight request is aborted and "
        "the stack restarts cold, clients retry (today's common baseline)",
    )
    model_seed: int = Field(0, ge=0, description="seed of the model's weights")
    journal: bool = Field(True, description="write-ahead journal of requests and tokens")
    checksums: bool = Field(True, description="KV block checksums")
    batch_invariant: bool = Field(True, description="batch-invariant kernels")
    max_batch: int = Field(16, ge=1, description="requests decoded together per worker")
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
        description="extra server options (python -m reference_impl.serving.server --help)",
    )
    load: Load = Load()
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")


def _system_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        if "reference" in value:
            return "server" if value["reference"] == "server" else "trainer"
        if "command" in value:
            return "command"
        return None
    if isinstance(value, TrainerSystem):
        return "trainer"
    if isinstance(value, ServerSystem):
        return "server"
    if isinstance(value, CommandSystem):
        return "command"
    return None


System = Annotated[
    Annotated[TrainerSystem, Tag("trainer")] | Annotated[ServerSystem, Tag("server")]
    | Annotated[CommandSystem, Tag("command")],
    Discriminator(
        _system_tag,
        custom_error_type="system_kind",
        custom_error_message="system needs `reference: trainer`, `reference: server` or "
        "`command: [...]`",
    ),
]


class Target(_Strict):
    """Which process a fault hits: a rank, a role, or a seeded pick among the ranks.

    Ranks are the ranks the system reports through the probe's ``hello`` (a warm
    spare that took over rank 1 *is* rank 1), else the ``RANK`` environment
    variable of each process.
    """

    rank: int | None = Field(None, ge=0)
    worker: int | None = Field(None, ge=0, description="a worker of the reference server "
                               "(its index, which the worker reports as its rank)")
    replica: int | None = Field(None, ge=0, description="every rank of this replica")
    shard: int | None = Field(None, ge=0, description="every rank holding this shard "
                              "(with `replica`: the one rank at both)")
    role: Literal["launcher", "spare"] | None = Field(
        None, description="launcher: the launched command itself (e.g. torchrun's agent); "
        "spare: a warm standby process"
    )
    pick: Literal["random", "all"] | None = Field(
        None, description="random: one rank chosen with the run's seed; all: every rank"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Target:
        coordinates = self.replica is not None or self.shard is not None
        given = [x for x in (self.rank, self.worker, self.role, self.pick) if x is not None]
        if len(given) + coordinates != 1:
            raise ValueError("give exactly one of `rank: N`, `worker: N`, `replica`/`shard`, "
                             "`role: launcher|spare` or `pick: random|all`")
        return self

    @property
    def index(self) -> int | None:
        """The rank this target names: `worker: N` is the server's rank N."""
        return self.rank if self.rank is not None else self.worker

    def describe(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank}"
        if self.worker is not None:
            return f"worker {self.worker}"
        if self.replica is not None or self.shard is not None:
            parts = [f"replica {self.replica}" if self.replica is not None else "",
                     f"shard {self.shard}" if self.shard is not None else ""]
            return " ".join(p for p in parts if p)
        return f"role {self.role}" if self.role is not None else f"pick {self.pick}"


#: Fault points of the reference systems (``harness.probe.fault_point``): a training step's
#: forward, backward and optimizer; ``save``: every rank's checkpoint shard is durable and the
#: step is not committed yet; ``restore``: a rank rejoining after a failure, before it trains
#: again (the step it restores); ``decode``: a serving engine step.
Phase = Literal["forward", "backward", "optimizer", "save", "restore", "decode"]


class At(_Strict):
    """When a fault fires: once step N is committed (optionally at a phase of that step,
    for in-process faults), at a time after launch, or on the k-th timeline event of a kind."""

    step: int | None = Field(None, ge=0)
    phase: Phase | None = Field(
        None, description="with `step`: the fault point (forward, backward, optimizer, save, "
        "restore, decode) of that step or a later one (in-process faults only)"
    )
    time: Duration | None = None
    event: str | None = Field(
        None, pattern=r"^[a-z_]+$", description="a timeline event, e.g. checkpoint_started"
    )
    count: int = Field(1, ge=1, description="with `event`: fire on its k-th occurrence")

    @model_validator(mode="after")
    def _exactly_one(self) -> At:
        given = [x for x in (self.step, self.time, self.event) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `step: N`, `time: DURATION` or `event: NAME`")
        if self.phase is not None and self.step is None:
            raise ValueError("`phase` needs `step`")
        return self

    def describe(self) -> str:
        if self.step is not None:
            return f"step {self.step}" + (f" {self.phase}" if self.phase else "")
        if self.event is not None:
            return f"event {self.event}" + (f" #{self.count}" if self.count > 1 else "")
        assert self.time is not None
        return f"t+{self.time.total_seconds():g}s"


_SIGNALS = sorted(s.name for s in _signal.Signals if not s.name.startswith("SIG_"))


class Every(_Strict):
    """Repeat a fault: every N committed steps or every DURATION after it first fired."""

    steps: int | None = Field(None, ge=1)
    time: Duration | None = None
    times: int = Field(2, ge=2, le=1000, description="how many times in all, the first included")

    @model_validator(mode="after")
    def _exactly_one(self) -> Every:
        if (self.steps is None) == (self.time is None):
            raise ValueError("give exactly one of `steps: N` or `time: DURATION`")
        return self


#: Kinds outside collective.* and memory.* that the probe applies at a fault point.
_PHASED = ("process.kill", "process.hang")


class _FaultBase(_Strict):
    target: Target
    at: At
    every: Every | None = Field(None, description="repeat the fault")

    @model_validator(mode="after")
    def _phase_in_process(self) -> _FaultBase:
        kind = str(getattr(self, "kind", ""))
        if self.at.phase is not None and not (
            kind in _PHASED or kind.startswith(("collective.", "memory."))
        ):
            raise ValueError(f"`at.phase` is for faults applied inside the target "
                             f"({', '.join(_PHASED)}, collective.*, memory.* with `tensor`), "
                             f"not {kind}")
        return self

    @model_validator(mode="after")
    def _repeatable(self) -> _FaultBase:
        if self.every is not None and self.every.steps is not None and self.at.step is None \
                and self.at.event is None and self.at.time is None:
            raise ValueError("`every` needs `at`")
        return self


class ProcessKill(_FaultBase):
    """Send a signal (SIGKILL by default) to the target process; with `at.phase`, the
    process signals itself at that fault point (e.g. between a checkpoint's shard writes
    and its commit: `at: {step: 30, phase: save}`)."""

    kind: Literal["process.kill"]
    signal: str = "SIGKILL"

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name not in _SIGNALS:
            raise ValueError(f"unknown signal {value!r} (allowed: {', '.join(_SIGNALS)})")
        return name


class ProcessTerm(_FaultBase):
    """SIGTERM, then SIGKILL if the process is still alive after the grace period."""

    kind: Literal["process.term"]
    grace: Duration = timedelta(seconds=5)


class ProcessFreeze(_FaultBase):
    """SIGSTOP; SIGCONT after `duration`, or when the run ends if no duration is given."""

    kind: Literal["process.freeze"]
    duration: Duration | None = None


class GpuXid(_FaultBase):
    """A simulated NVIDIA Xid error with its real effect (``aftershock faults xid``)."""

    kind: Literal["gpu.xid"]
    code: int
    gpu: int | None = Field(None, ge=0, description="GPU index; default the rank's LOCAL_RANK")
    bitflips: int | None = Field(None, ge=1, description="memory Xids: bits flipped in the heap")
    seed: int = 0

    @field_validator("code")
    @classmethod
    def _known_xid(cls, value: int) -> int:
        from faults.xid import CATALOG

        if value not in CATALOG:
            raise ValueError(f"unknown Xid {value} (allowed: {', '.join(map(str, CATALOG))})")
        return value


MemoryTensor = Annotated[
    str,
    Field(
        pattern=r"^(param|grad|optim|[a-z_]+):.+$",
        description="param:NAME, grad:NAME, optim:NAME.STATE (globs allowed), in a process "
        "that called harness.probe.install()",
    ),
]


class _MemoryBase(_FaultBase):
    tensor: MemoryTensor | None = None
    address: int | None = Field(None, ge=0, description="from outside: a virtual address")
    index: int | None = Field(None, ge=0, description="with tensor: flat element index")
    seed: int = 0
    restore: bool = False

    @model_validator(mode="after")
    def _where(self) -> _MemoryBase:
        region = getattr(self, "region", None)
        address_of = getattr(self, "address_of", None)
        given = [x for x in (self.tensor, self.address, region, address_of) if x is not None]
        if len(given) != 1:
            allowed = ("`tensor`, `address`, `address_of` or `region: heap`"
                       if hasattr(self, "region") else "`tensor` or `address`")
            raise ValueError(f"give exactly one of {allowed}")
        if self.at.phase is not None and self.tensor is None:
            raise ValueError("`at.phase` needs `tensor` (an in-process fault)")
        return self


class MemoryBitflip(_MemoryBase):
    """Flip bits: in a named tensor (in process), at an address or in the heap (from outside)."""

    kind: Literal["memory.bitflip"]
    region: Literal["heap"] | None = None
    address_of: str | None = Field(
        None, pattern=r"^param:.+$",
        description="from outside: the address of this CPU parameter (param:NAME, element "
        "`index`), as the probe published it at start-up; written through /proc/PID/mem",
    )
    bit: int | None = Field(None, ge=0, description="default: the top exponent bit")
    count: int = Field(1, ge=1)


class MemoryFill(_MemoryBase):
    """Write NaN, Inf or zeros into a named tensor (in process) or at an address."""

    kind: Literal["memory.nan", "memory.inf", "memory.zero"]
    nbytes: int | None = Field(None, ge=1, description="with address: bytes to overwrite")
    dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"


Collective = Literal[
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "gather", "scatter", "any",
]


class _CollectiveBase(_FaultBase):
    op: Collective = "all_reduce"
    call: int = Field(1, ge=1, description="the k-th matching call at or after the trigger")


class CollectiveError(_CollectiveBase):
    """The chosen collective call raises, as a backend error would."""

    kind: Literal["collective.error"]


class CollectiveHang(_CollectiveBase):
    """The chosen collective call never returns until healed."""

    kind: Literal["collective.hang"]
    duration: Duration | None = None


class CollectiveDelay(_CollectiveBase):
    """The chosen collective call starts `delay` late."""

    kind: Literal["collective.delay"]
    delay: Duration = timedelta(seconds=1)


class CollectiveCorrupt(_CollectiveBase):
    """The chosen collective completes, then its result is poisoned on the target rank."""

    kind: Literal["collective.corrupt"]
    mode: Literal["nan", "inf", "zero", "bitflip"] = "nan"
    index: int | None = Field(None, ge=0)
    bit: int | None = Field(None, ge=0)
    seed: int = 0


class NetReset(_FaultBase):
    """Reset the target's TCP connections for real (`ss -K`)."""

    kind: Literal["net.reset"]
    port: int | None = Field(None, ge=1, le=65535, description="only connections on this port")


class NetPartition(_FaultBase):
    """Cut the target off from every peer, both ways, with nftables rules on loopback."""

    kind: Literal["net.partition"]
    duration: Duration | None = Field(None, description="heal after this long; default: end")
    new_connections: bool = Field(True, description="also block sockets it opens later")


_LAUNCHER = Target(role="launcher")


class _StorageBase(_FaultBase):
    target: Target = Field(_LAUNCHER, description="storage faults act on files, not a rank")
    root: str | None = Field(
        None, description="folder the path is relative to; default the trainer's checkpoint "
        "folder (reference trainer) or the run folder; ${run_dir} is expanded"
    )
    restore: bool = False


class StorageDamage(_StorageBase):
    """Corrupt, truncate or delete the newest file (or folder) matching a glob."""

    kind: Literal["storage.corrupt", "storage.truncate", "storage.delete"]
    path: str = Field(description="glob under root; the newest match is hit")
    offset: int | None = Field(None, ge=0, description="corrupt: first byte (default seeded)")
    bytes: int = Field(16, ge=1, description="corrupt: how many bytes")
    size: int | None = Field(None, ge=0, description="truncate: new size (default half)")
    seed: int = 0


class StorageFull(_StorageBase):
    """A real ENOSPC: a size-limited tmpfs over a folder, removed when healed."""

    kind: Literal["storage.full"]
    dir: str = Field(".", description="folder under root to fill")
    free: int = Field(0, ge=0, description="bytes left free")
    write_back: bool = Field(True, description="copy what was written meanwhile back at heal")
    duration: Duration | None = None


class ProcessHang(_FaultBase):
    """Block the target's loop at a fault point until healed; its other threads run on."""

    kind: Literal["process.hang"]
    duration: Duration | None = Field(None, description="release after this long; default: end")


class ProcessStraggle(_FaultBase):
    """Slow one process by a factor (cgroup CPU quota, or duty-cycled SIGSTOP/SIGCONT)."""

    kind: Literal["process.straggle"]
    factor: float = Field(4.0, gt=1.0)
    cpus: float = Field(1.0, gt=0)
    method: Literal["auto", "cgroup", "signal"] = "auto"
    duration: Duration | None = None


Fault = Annotated[
    ProcessKill | ProcessTerm | ProcessFreeze | ProcessStraggle | ProcessHang | GpuXid
    | MemoryBitflip
    | MemoryFill | CollectiveError | CollectiveHang | CollectiveDelay | CollectiveCorrupt
    | NetReset | NetPartition | StorageDamage | StorageFull,
    Field(discriminator="kind"),
]
FAULT_MODELS: dict[str, type[_FaultBase]] = {
    "process.kill": ProcessKill,
    "process.term": ProcessTerm,
    "process.freeze": ProcessFreeze,
    "process.straggle": ProcessStraggle,
    "process.hang": ProcessHang,
    "net.reset": NetReset,
    "net.partition": NetPartition,
    "storage.corrupt": StorageDamage,
    "storage.truncate": StorageDamage,
    "storage.delete": StorageDamage,
    "storage.full": StorageFull,
    "gpu.xid": GpuXid,
    "memory.bitflip": MemoryBitflip,
    "memory.nan": MemoryFill,
    "memory.inf": MemoryFill,
    "memory.zero": MemoryFill,
    "collective.error": CollectiveError,
    "collective.hang": CollectiveHang,
    "collective.delay": CollectiveDelay,
    "collective.corrupt": CollectiveCorrupt,
}


def in_process(fault: _FaultBase) -> bool:
    """Faults the probe applies inside the target, at an exact step and phase."""
    kind = str(getattr(fault, "kind", ""))
    at = getattr(fault, "at", None)
    return kind.startswith("collective.") or kind == "process.hang" or (
        kind.startswith("memory.") and getattr(fault, "tensor", None) is not None
    ) or (kind == "process.kill" and at is not None and at.phase is not None)


class Budget(_Strict):
    max: Duration


class CountBudget(_Strict):
    max: int = Field(ge=0)


class RateFloor(_Strict):
    min: float = Field(gt=0, description="steps per second, over any 2 s window")


class Latency(_Strict):
    """Latency budgets over every request of the run, the fault included (client-side)."""

    ttft_p50: Budget | None = Field(None, description="time to first token, median")
    ttft_p99: Budget | None = Field(None, description="time to first token, 99th percentile")
    tpot_p50: Budget | None = Field(None, description="time between tokens, median")
    tpot_p99: Budget | None = Field(None, description="time between tokens, 99th percentile")


class Expect(_Strict):
    """What must hold after the run. Each field is one named check in the report."""

    completes: bool = Field(True, description="the system exits 0 within its timeout")
    params_match: Literal["fault_free", "replay"] | None = Field(
        None, description="fault_free: final parameters bitwise equal to a fault-free run "
        "(same seed); replay: equal to a deterministic replay of the membership the run "
        "recorded (elastic recovery changes the math while a replica is missing)"
    )
    time_to_detect: Budget | None = None
    time_to_recover: Budget | None = None
    lost_steps: CountBudget | None = None
    step_rate: RateFloor | None = Field(
        None, description="the slowest 2 s of the run commits at least this many steps/s"
    )
    xid_action: bool = Field(
        False, description="for every gpu.xid fault, the system reports an xid_action event "
        "with the action NVIDIA recommends for that Xid (aftershock faults xid)"
    )
    straggler_named: bool = Field(
        False, description="the system reports a straggler_detected event naming the rank "
        "the process.straggle fault slowed"
    )
    no_lost_requests: bool = Field(
        False, description="server: every request the load generator sent completed with all "
        "its tokens"
    )
    no_duplicated_tokens: bool = Field(
        False, description="server: no client received a token index twice"
    )
    outputs_match: Literal["fault_free"] | None = Field(
        None, description="server: every request's tokens equal those of a fault-free run "
        "of the same load"
    )
    latency: Latency | None = None

    #: Checks that only mean something for the reference server's load.
    SERVING: typing.ClassVar[tuple[str, ...]] = (
        "no_lost_requests", "no_duplicated_tokens", "outputs_match", "latency")
    #: Checks that read training steps or parameters.
    TRAINING: typing.ClassVar[tuple[str, ...]] = (
        "params_match", "lost_steps", "step_rate", "straggler_named")


class Scenario(_Strict):
    """One scenario: what to launch, which faults to inject when, what must hold."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=100)
    description: str = ""
    seed: int = Field(0, ge=0)
    system: System
    faults: list[Fault] = Field(default_factory=list)
    expect: Expect = Expect()

    @model_validator(mode="after")
    def _checks_are_possible(self) -> Scenario:
        if not self.faults:
            for name in ("time_to_detect", "time_to_recover"):
                if getattr(self.expect, name) is not None:
                    raise ValueError(f"expect.{name} needs at least one fault")
        serving = isinstance(self.system, ServerSystem)
        for name in Expect.SERVING if not serving else Expect.TRAINING:
            if getattr(self.expect, name) not in (None, False):
                needs = "`reference: server`" if name in Expect.SERVING else \
                    "a training system (`reference: trainer` or `command:`)"
                raise ValueError(f"expect.{name} needs {needs}")
        if self.expect.params_match == "replay" and not (
            isinstance(self.system, TrainerSystem) and self.system.recovery == "elastic"
        ):
            raise ValueError("expect.params_match: replay needs the reference trainer with "
                             "`recovery: elastic` (the only system that records membership)")
        if (
            self.expect.params_match
            and isinstance(self.system, CommandSystem)
            and not any(p.event == "params" for p in self.system.probes)
        ):
                raise ValueError(
                    "expect.params_match on a command needs a log probe with `event: params` "
                    "and a `(?P<digest>...)` group"
                )
        return self

    def without_faults(self) -> Scenario:
        """The fault-free twin of this scenario, used as the golden reference.

        Test hooks that inject faults through the environment (``AFTERSHOCK_INJECT_*``)
        are faults too, so the twin goes without them.
        """
        system = self.system
        clean = {k: v for k, v in system.env.items() if not k.startswith("AFTERSHOCK_INJECT_")}
        if clean != system.env:
            system = system.model_copy(update={"env": clean})
        return self.model_copy(update={"faults": [], "expect": Expect(), "system": system})


@dataclass(frozen=True, slots=True)
class LoadedScenario:
    spec: Scenario
    path: Path
    text: str


# --------------------------------------------------------------------------- loading


@dataclass(slots=True)
class _Marks:
    keys: dict[tuple[Any, ...], tuple[int, int]]
    values: dict[tuple[Any, ...], tuple[int, int]]


def _collect_marks(
    node: yaml.Node, path: tuple[Any, ...], marks: _Marks, problems: list[str], file: str
) -> None:
    marks.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            where = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if key in seen:
                problems.append(f"{file}:{where[0]}:{where[1]}: duplicate key {key!r}")
            seen.add(key)
            marks.keys[(*path, key)] = where
            _collect_marks(value_node, (*path, key), marks, problems, file)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_marks(item, (*path, index), marks, problems, file)


def _data_path(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Pydantic's error location without union tags: the path into the YAML data.

    A tag such as ``reference`` can also be a key, so both readings are tried
    and the one that follows the data furthest wins.
    """

    def walk(index: int, current: Any, path: tuple[Any, ...]) -> tuple[int, tuple[Any, ...]]:
        """(how many parts of ``loc`` this reading explains, the data path)."""
        if index == len(loc):
            return index, path
        part = loc[index]
        options: list[tuple[int, tuple[Any, ...]]] = []
        in_dict = isinstance(current, dict) and part in current
        in_list = isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        if in_dict or in_list:
            options.append(walk(index + 1, current[part], (*path, part)))
        if isinstance(part, str) and path_is_tag(part):
            options.append(walk(index + 1, current, path))
        if not options:
            # A missing or unknown key is the subject of the error: keep it.
            if isinstance(current, dict) and isinstance(part, str):
                return index + 1, (*path, part)
            return index, path
        return max(options, key=lambda option: option[0])

    return walk(0, data, ())[1]


def path_is_tag(part: str) -> bool:
    return (part in FAULT_MODELS or part in ("reference", "trainer", "server", "command")
            or "[" in part)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, dict):
        found: list[type[BaseModel]] = []
        for arg in typing.get_args(annotation):
            found.extend(_models_in(arg))
        return found
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _model_at(path: tuple[Any, ...], data: Any) -> type[BaseModel] | None:
    """The model that owns the mapping at ``path`` (to list its allowed keys)."""
    model: type[BaseModel] | None = Scenario
    current = data
    for part in path:
        if isinstance(part, int):
            current = current[part] if isinstance(current, list) else None
            continue
        if model is None or part not in model.model_fields:
            return None
        candidates = _models_in(model.model_fields[part].annotation)
        current = current.get(part) if isinstance(current, dict) else None
        if isinstance(current, list):
            pass
        model = _pick(candidates, current)
    if isinstance(current, list):
        return None
    return model


def _pick(candidates: list[type[BaseModel]], value: Any) -> type[BaseModel] | None:
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    sample = value[0] if isinstance(value, list) and value else value
    if isinstance(sample, dict):
        if "kind" in sample and sample["kind"] in FAULT_MODELS:
            return FAULT_MODELS[sample["kind"]]
        tag = _system_tag(sample)
        if tag == "trainer":
            return TrainerSystem
        if tag == "server":
            return ServerSystem
        if tag == "command":
            return CommandSystem
    return None


def _describe(error: Any, path: tuple[Any, ...], data: Any) -> str:
    where = ".".join(str(p) for p in path) or "scenario"
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else "?"
        owner = _model_at(path[:-1], data)
        allowed = sorted(owner.model_fields) if owner else []
        hint = ""
        close = difflib.get_close_matches(str(key), allowed, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        listing = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{where}: unknown key {key!r}{listing}{hint}"
    if kind == "missing":
        return f"{where}: required key is missing"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        message = (
            f"unknown kind {ctx.get('tag')!r} (allowed: {ctx.get('expected_tags')})"
        )
    return f"{where}: {message}"


def parse_scenario(text: str, file: str = "<string>") -> Scenario:
    """Parse and validate scenario YAML; raise SpecError with every problem found."""
    problems: list[str] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise SpecError([f"{file}:{line}:{col}: invalid YAML: {exc.problem}"]) from None
    if node is None or not isinstance(data, dict):
        raise SpecError(
            [f"{file}:1:1: a scenario must be a mapping with `name`, `system`, `faults`, `expect`"]
        )
    marks = _Marks(keys={}, values={})
    _collect_marks(node, (), marks, problems, file)
    if problems:
        raise SpecError(problems)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            path = _data_path(tuple(error["loc"]), data)
            lookup = marks.keys if error["type"] == "extra_forbidden" else marks.values
            position = None
            probe = path
            while position is None:
                position = lookup.get(probe) or marks.keys.get(probe)
                if position is None:
                    if not probe:
                        position = (1, 1)
                    probe = probe[:-1]
            problems.append(f"{file}:{position[0]}:{position[1]}: {_describe(error, path, data)}")
        raise SpecError(problems) from None


def load_scenario(path: str | Path) -> LoadedScenario:
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([f"{file}:1:1: cannot read scenario: {exc.strerror}"]) from None
    return LoadedScenario(spec=parse_scenario(text, str(file)), path=file, text=text)


def discover(paths: list[str | Path]) -> list[Path]:
    """Scenario files under the given files and folders, sorted, each once."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(
                sorted(p for p in path.rglob("*") if p.suffix in SCENARIO_SUFFIXES and p.is_file())
            )
        elif path.exists():
            found.append(path)
        else:
            raise SpecError([f"{path}:1:1: no such file or folder"])
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique


def json_schema() -> dict[str, Any]:
    schema = Scenario.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Aftershock scenario"
    return schema
