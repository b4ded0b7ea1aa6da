"""Local target: launch the system under test as real processes, find its ranks, end it.

Everything launched carries ``AFTERSHOCK_RUN_ID`` in its environment. That is
how the harness finds every process of the run, including torchrun's workers,
which start their own sessions and so escape process-group signals, and how a
later ``aftershock heal`` finds them after a crashed harness.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from faults._proc import ProcessRef, environ, kill_all, processes_with_env
from harness import probe
from harness.errors import TargetError
from harness.records import Event
from harness.spec import CommandSystem, LogProbe, ServerSystem, TrainerSystem
from harness.timeline import Timeline

_RANK_PREFIX = re.compile(r"^\[(?:default)?(\d+)\]:")


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    world: int | None
    probes: tuple[LogProbe, ...]


def trainer_argv(system: TrainerSystem, run_dir: Path, seed: int) -> list[str]:
    """torchrun running the reference trainer: the harness reaches it only by command line."""
    spares = system.spares if system.recovery == "hot_spare" else 0
    extra = [f"--spares={spares}", f"--snapshot-every={system.snapshot_every}"] if spares else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={system.world.size + spares}",
        f"--max-restarts={system.max_restarts}",
        # Short monitor interval: the agent's reaction to a dead worker is part of
        # what `restart` recovery costs; the 0.1 s default is already fine, be explicit.
        "--monitor-interval=0.1",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "--tee=3",
        "-m",
        "reference_impl.trainer",
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


def server_argv(system: ServerSystem) -> list[str]:
    """The reference server's launcher (router + workers); it says where it listens
    through the probe's ``serving_ready`` event."""
    def seconds(value: timedelta) -> str:
        return f"{value.total_seconds():g}"

    flags = [("--no-journal", not system.journal), ("--no-checksums", not system.checksums),
             ("--no-batch-invariant", not system.batch_invariant)]
    return [
        sys.executable, "-m", "reference_impl.serving.server",
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


def plan_launch(
    system: TrainerSystem | ServerSystem | CommandSystem, *, run_dir: Path, scenario_dir: Path,
    seed: int, extra_args: tuple[str, ...] = (),
) -> Launch:
    if isinstance(system, ServerSystem):
        return Launch([*server_argv(system), *extra_args], Path.cwd(), dict(system.env),
                      system.workers, ())
    if isinstance(system, TrainerSystem):
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **system.env}
        argv = [*trainer_argv(system, run_dir, seed), *extra_args]
        return Launch(argv, Path.cwd(), env, system.world.size, ())
    cwd = (scenario_dir / system.cwd).resolve() if system.cwd else scenario_dir.resolve()
    variables = {"run_dir": str(run_dir), "scenario_dir": str(scenario_dir.resolve())}

    def expand(text: str) -> str:
        # Only ${run_dir} and ${scenario_dir}: a fresh folder per run keeps a job's
        # checkpoints from leaking from the fault-free baseline into the faulted run.
        return re.sub(r"\$\{(run_dir|scenario_dir)\}", lambda m: variables[m.group(1)], text)

    return Launch(
        [expand(arg) for arg in system.command],
        cwd,
        {key: expand(value) for key, value in system.env.items()},
        system.world,
        tuple(system.probes),
    )


class LocalTarget:
    """The system under test as a local process tree."""

    def __init__(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline) -> None:
        self.launch = launch
        self.run_dir = run_dir
        self.run_id = run_id
        self.timeline = timeline
        self.proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._logs = run_dir / "logs"
        self._reported: dict[int, tuple[int | None, str | None]] = {}
        self.coordinates: dict[int, tuple[int, int]] = {}  # rank -> (replica, shard)
        # Log lines' own times (LogProbe.clock): nothing the run prints can be older than
        # this, and Unix times convert with this one offset, fixed for the whole run.
        self._started = time.monotonic()
        self._clock_offset = time.time() - self._started

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.launch.env)
        env[probe.EVENTS_ENV] = str(self.timeline.path)
        env[probe.OUTPUT_ENV] = str(self.run_dir / "output")
        env[probe.RUN_ID_ENV] = self.run_id
        env[probe.COMMANDS_ENV] = str(self.run_dir / "commands.jsonl")
        # The simulated NVML (faults/nvml_sim.py) a rank opts into when it has no real GPU.
        env.setdefault("AFTERSHOCK_NVML_DIR", str(self.run_dir / "nvml"))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> None:
        self._logs.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "output").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "nvml").mkdir(parents=True, exist_ok=True)
        try:
            self.proc = subprocess.Popen(
                self.launch.argv,
                cwd=self.launch.cwd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Own session: Ctrl-C in the harness's terminal reaches the harness,
                # which then tears the target down in order, not the target directly.
                start_new_session=True,
            )
        except OSError as exc:
            raise TargetError(f"cannot launch {self.launch.argv[0]!r}: {exc.strerror}") from exc
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            thread = threading.Thread(
                target=self._pump, args=(name, stream), name=f"log-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        probes = [p for p in self.launch.probes if p.stream in (name, "both")]
        compiled = [(p, re.compile(p.pattern)) for p in probes]
        with open(self._logs / f"launcher.{name}.log", "wb") as log:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                if not compiled:
                    continue
                line = raw.decode(errors="replace").rstrip("\n")
                for spec, pattern in compiled:
                    match = pattern.search(line)
                    if match:
                        self._emit_from_log(spec, match, line)

    def _emit_from_log(self, spec: LogProbe, match: re.Match[str], line: str) -> None:
        self.timeline.write(log_event(spec, match, line, read_t=time.monotonic(),
                                      clock_offset=self._clock_offset, started=self._started))

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def processes(self) -> list[ProcessRef]:
        return processes_with_env(probe.RUN_ID_ENV, self.run_id)

    def note_hello(self, pid: int, rank: int | None, role: str | None,
                   replica: int | None = None, shard: int | None = None) -> None:
        """What a process said about itself through the probe outranks its environment."""
        self._reported[pid] = (rank, role)
        if rank is not None and replica is not None and shard is not None:
            self.coordinates[rank] = (replica, shard)

    def role_processes(self, role: str) -> list[ProcessRef]:
        if role == "launcher":
            root = ProcessRef.of(self.proc.pid) if self.proc is not None else None
            return [root] if root is not None and root.alive() else []
        return [
            ref for ref in self.processes()
            if self._reported.get(ref.pid, (None, None))[1] == role
        ]

    def rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> process. Once any process of the run has said who it is through the
        probe's ``hello``, only those reports count: a supervisor or a re-forked spare
        inherits ``RANK`` from torchrun but is not that rank."""
        if not self._reported:
            return self._env_rank_processes()
        live = {ref.pid: ref for ref in self.processes()}
        ranks: dict[int, ProcessRef] = {}
        for pid, (rank, role) in self._reported.items():
            if pid in live and rank is not None and role in (None, "trainer", "worker"):
                ranks[rank] = live[pid]
        return ranks

    def _env_rank_processes(self) -> dict[int, ProcessRef]:
        """Rank -> the topmost live process whose environment says ``RANK=rank``.

        A rank's own children (data loader workers) inherit ``RANK`` too; the
        topmost one is the rank. A target without ``RANK`` anywhere is one
        process: its root is rank 0.
        """
        by_rank: dict[int, list[ProcessRef]] = {}
        for ref in self.processes():
            value = environ(ref.pid).get("RANK")
            if value is not None and value.isdigit():
                by_rank.setdefault(int(value), []).append(ref)
        result: dict[int, ProcessRef] = {}
        for rank, refs in by_rank.items():
            pids = {r.pid for r in refs}
            top = [r for r in refs if _parent(r.pid) not in pids]
            result[rank] = top[0] if top else refs[0]
        if not result and self.proc is not None and self.proc.poll() is None:
            root = ProcessRef.of(self.proc.pid)
            if root is not None:
                result[0] = root
        return result

    def stop(self, grace: float = 3.0) -> None:
        """End every process of the run: SIGTERM to the launcher, then SIGKILL to all.

        Stopped processes are thawed first so none is left behind in state T.
        """
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        for _ in range(3):
            refs = self.processes()
            if not refs:
                break
            for ref in refs:
                ref.signal(signal.SIGCONT)
            kill_all(refs)
            time.sleep(0.05)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self.proc is not None:
            # Close our ends of the pipes: under pytest's warnings-as-errors an unclosed
            # pipe is a ResourceWarning that fails the user's scenario item.
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


#: How far a line's own time may lie past the moment it was read (rounding in print, the
#: Unix-to-monotonic offset drifting by an NTP slew) before it is taken for the wrong clock.
LINE_TIME_SLACK_S = 1.0


def log_event(spec: LogProbe, match: re.Match[str], line: str, *, read_t: float,
              clock_offset: float, started: float) -> Event:
    """The event a matching log line stands for.

    Its time is the line's own ``time`` group when there is one that makes sense (not
    after the line was read, not before the run began), capped at the read time, which
    no line can postdate: ``clock: line``. Otherwise it is the read time, only an upper
    bound on when the line was written: ``clock: read`` (docs/metrics.md)."""
    fields: dict[str, Any] = {"line": line[:300]}
    raw_time: str | None = None
    for key, value in match.groupdict().items():
        if value is None:
            continue
        if key == "time":
            raw_time = value
            continue
        integral = key in ("step", "rank", "generation") and value.isdigit()
        fields[key] = int(value) if integral else value
    if "rank" not in fields:
        prefix = _RANK_PREFIX.match(line)
        if prefix:
            fields["rank"] = int(prefix.group(1))
    t, clock = read_t, "read"
    if raw_time is not None:
        try:
            value = float(raw_time)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            fields["time_rejected"] = f"not a number: {raw_time!r}"
        else:
            own = value - clock_offset if spec.clock == "unix" else value
            if spec.clock == "unix":
                fields["clock_offset"] = clock_offset
            if own > read_t + LINE_TIME_SLACK_S:
                fields["time_rejected"] = (f"{raw_time} is {own - read_t:.3g} s after the line "
                                           f"was read: not {spec.clock} time?")
            elif own < started - LINE_TIME_SLACK_S:
                fields["time_rejected"] = (f"{raw_time} is {started - own:.3g} s before the run "
                                           f"began: not {spec.clock} time?")
            else:
                t, clock = min(own, read_t), "line"
    fields["clock"] = clock
    fields["read_t"] = read_t
    return Event(t=t, event=spec.event, source="log", fields=fields)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    return int(raw[raw.rfind(")") + 2 :].split()[1])
