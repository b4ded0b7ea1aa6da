"""``command: [...]``: any command line (a torchrun job, a user's server) as local
processes, observed through its log lines (``probes``) and, if it calls it, the
in-process probe."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import shutil
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from aftershock.harness.run.logprobe import LogProbe
from aftershock.harness.run.target import SERVED_STOP_GRACE_S, Launch, LocalTarget, Target
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario import presets
from aftershock.harness.scenario.schema import MAX_STEPS, MAX_WORLD, Duration, Strict
from aftershock.harness.systems import Driver, register


class CommandSystem(Strict):
    """Any command line (a torchrun job, a user's server), observed through logs.

    ``${run_dir}``, ``${scenario_dir}``, ``${seed}`` and ``${port}`` in ``command``, ``env``
    values and ``cwd`` are replaced by the run's own folder, the scenario file's folder, the
    run's seed and a free TCP port picked for the run (:data:`VARIABLES`).
    """

    command: list[str] = Field(min_length=1)
    preset: str | list[str] | None = Field(
        None, description="the frameworks whose own log lines become events without "
        "writing probes: torchrun (its agent's worker failures), torchft (its Manager's "
        "quorums, committed steps, heals; torchrun's too); more through the "
        "`aftershock.presets` entry points (harness/scenario/presets.py). `probes` add to them")
    probes: list[LogProbe] = Field(default_factory=list)
    logs: list[str] = Field(
        default_factory=list, max_length=16,
        description="per-process log files the harness follows as they appear and grow "
        "(globs, `**` too; relative to the working directory; `${run_dir}` expanded), each "
        "its own stream for the probes (`stream: logs` or `both`): torchrun's "
        "`--log-dir=${run_dir}/torchrun --redirects=3` files are "
        "`${run_dir}/torchrun/**/stdout.log`, and give each line its rank and restart count",
    )
    world: int | None = Field(
        None, ge=1, le=MAX_WORLD,
        description="ranks at full strength; default: ranks seen before the fault"
    )
    steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="how many steps the job runs (the live "
        "view's progress bar)")
    cwd: str | None = Field(
        None, description="working directory, relative to the scenario file's folder "
        "(`${run_dir}` expanded); default: a fresh folder `work` in the run folder, so nothing "
        "a run writes there (a snapshot) reaches the next run")
    env: dict[str, str] = Field(default_factory=dict)
    inputs: list[str] = Field(
        default_factory=list,
        description="files, folders or globs the command reads (modules run with -m, configs, "
        "data), relative to its working directory. With the files named in `command`, their "
        "content is part of the fault-free twin's cache key; each must exist",
    )
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run")
    stop_grace: Duration = Field(
        timedelta(seconds=SERVED_STOP_GRACE_S),
        description="with a `load:`: how long the server gets to exit after SIGTERM once the "
        "load was served, before SIGKILL (`completes` wants exit 0 within it; Kubernetes' "
        "terminationGracePeriodSeconds). A run stopped early (its timeout, Ctrl-C) gives 3 s")
    in_process_probe: bool | None = Field(
        None,
        description="whether the job calls aftershock.harness.probe.install(), which in-process "
        "faults need (collective.*, process.hang, memory.* with `tensor`, process.kill with "
        "`at.phase`); default: whether the command line, a file it names or an `inputs` "
        "file calls it",
    )

    @field_validator("preset")
    @classmethod
    def _known_presets(cls, value: str | list[str] | None) -> str | list[str] | None:
        try:
            presets.probes(value)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        return value

    def all_probes(self) -> list[LogProbe]:
        """Its presets' probes, then its own."""
        return [*presets.probes(self.preset), *self.probes]

    def workdir(self, scenario_dir: Path) -> Path:
        """Where the command's relative file names point: its ``cwd``, or the scenario's
        folder when it runs in a fresh folder of the run (its files named relative to the
        scenario are then passed as absolute paths: :func:`absolute_args`). A ``cwd``
        inside the run folder is not known before the run: the scenario's folder then."""
        if self.cwd and "${run_dir}" not in self.cwd:
            return (
                scenario_dir / expand(self.cwd, {"scenario_dir": str(scenario_dir.resolve())})
            ).resolve()
        return scenario_dir.resolve()

    def input_files(self, scenario_dir: Path) -> tuple[list[Path], list[int]]:
        """The files ``inputs`` names (folders: every file under them), sorted, and the
        indices of the entries that name nothing."""
        base = self.workdir(scenario_dir)
        files: set[Path] = set()
        missing: list[int] = []
        for index, pattern in enumerate(self.inputs):
            if any(c in pattern for c in "*?["):
                root, relative = (
                    (Path(base.anchor), pattern.lstrip("/"))
                    if Path(pattern).is_absolute()
                    else (base, pattern)
                )
                found = list(root.glob(relative))
            else:
                found = [base / pattern]
            found = [
                f
                for p in found
                for f in (sorted(p.rglob("*")) if p.is_dir() else [p])
                if f.is_file()
            ]
            if not found:
                missing.append(index)
            files.update(found)
        return sorted(files), missing


#: The variables a command's ``command``, ``env`` values and ``cwd`` may use (docs/scenarios.md).
VARIABLES = ("run_dir", "scenario_dir", "seed", "port")
_VARIABLE = re.compile(r"\$\{(" + "|".join(VARIABLES) + r")\}")


def expand(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``${name}`` of :data:`VARIABLES` that ``values`` gives replaced."""
    return _VARIABLE.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def uses(system: CommandSystem, name: str) -> bool:
    """Whether ``${name}`` appears in the command line, an env value or the cwd."""
    marker = "${" + name + "}"
    return any(marker in text for text in [*system.command, *system.env.values(), system.cwd or ""])


def free_port() -> int:
    """A TCP port nothing listens on now, for the run's server (``${port}``). The kernel
    picks it among its ephemeral ports and does not hand it out again at once; another
    program could still take it before the server binds it (then the server says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port: int = probe_socket.getsockname()[1]
        return port


#: A ``key=value`` argument as hydra, OmegaConf and fire take them (``data.path=x.yaml``,
#: ``+trainer.ckpt=...``): the value may name a file.
_KEY_VALUE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.\-/@]*=")


def split_value(arg: str) -> tuple[str, str]:
    """``arg`` as (what precedes its value, its value): ``--config=`` and ``cfg.yaml`` for an
    option with its value, ``data.path=`` and ``x.yaml`` for a hydra-style override, and
    ``""`` and the whole argument otherwise."""
    if arg.startswith("-") or _KEY_VALUE.match(arg):
        head, eq, value = arg.partition("=")
        if eq:
            return head + eq, value
    return "", arg


def absolute_args(system: CommandSystem, scenario_dir: Path) -> list[str]:
    """The command line as the job gets it when it runs in a fresh folder: each argument
    (or ``--flag=value`` value) that names a file relative to the scenario's folder made
    absolute, the same files :func:`command_files` keys the twin by. The program itself is
    looked up on PATH unless it names a folder (``./run.sh``)."""
    if system.cwd:
        return list(system.command)
    base = scenario_dir.resolve()
    out: list[str] = []
    for index, arg in enumerate(system.command):
        if "${" in arg or Path(arg).is_absolute():
            out.append(arg)
            continue
        head, value = split_value(arg)
        if value and (index or "/" in value) and (base / value).is_file():
            arg = f"{head}{base / value}"
        out.append(arg)
    return out


def command_files(system: CommandSystem, scenario_dir: Path) -> list[Path]:
    """The files a command names that exist (relative ones from its working directory), and
    its declared inputs. Arguments naming the run's own folder change every run: skipped."""
    base = system.workdir(scenario_dir)
    files, _ = system.input_files(scenario_dir)
    named = set(files)
    for arg in system.command:
        if "${run_dir}" in arg:
            continue
        arg = arg.replace("${scenario_dir}", str(scenario_dir.resolve()))
        head, value = split_value(arg)
        for candidate in (arg, value if head else None):
            if candidate and (base / candidate).is_file():
                named.add((base / candidate).resolve())
    return sorted(named)


#: A file that uses the probe (`from aftershock import probe`, `aftershock.harness.probe.…`)
#: and calls an `install(`: what in-process faults need.
_USES_PROBE = re.compile(
    r"(harness|aftershock)\.probe|from\s+aftershock(\.harness)?\s+import\s[^\n]*\bprobe\b")
_INSTALLS = re.compile(r"\binstall\s*\(")
_READ_LIMIT = 1 << 20  # bytes of one file looked at: scripts, not data


def _calls_install(text: str) -> bool:
    return bool(_USES_PROBE.search(text) and _INSTALLS.search(text))


def _module_files(system: CommandSystem, base: Path | None) -> list[Path]:
    """The source of each module the command runs with ``-m`` (its own code, found on the
    job's path without importing it)."""
    roots = [base] if base is not None else []
    roots += [Path(p) for p in system.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots += [Path(p) for p in sys.path if p]
    found: list[Path] = []
    for flag, name in itertools.pairwise(system.command):
        if flag != "-m":
            continue
        stem = Path(*name.split("."))
        for root in roots:
            candidates = [root / stem.with_suffix(".py"), root / stem / "__main__.py"]
            hit = next((c for c in candidates if c.is_file()), None)
            if hit is not None:
                found.append(hit)
                break
    return found


def _named_files(system: CommandSystem, scenario_dir: Path | None) -> list[Path]:
    """The files the job's command line names, and the modules it runs with ``-m``."""
    if scenario_dir is not None:
        files = command_files(system, scenario_dir)
        base: Path | None = system.workdir(scenario_dir)
    else:  # parsed from text: only what the command names absolutely can be read
        files = sorted(
            {
                Path(a).resolve()
                for a in system.command
                if Path(a).is_absolute() and Path(a).is_file()
            }
        )
        base = None
    return [*files, *_module_files(system, base)]


def _sources_call_install(paths: list[Path], read: list[Path]) -> bool:
    """Whether one of the Python sources among ``paths`` calls probe.install(); those read
    are added to ``read``."""
    for path in paths:
        try:
            with open(path, "rb") as handle:
                data = handle.read(_READ_LIMIT)
        except OSError:
            continue
        if data.startswith(b"\x7fELF"):
            continue  # the interpreter, a compiled program: no Python source to read
        read.append(path)
        if _calls_install(data.decode(errors="replace")):
            return True
    return False


def probe_reason(system: CommandSystem, scenario_dir: Path | None) -> str | None:
    """None if the job calls aftershock.harness.probe.install(), as declared or as its command line
    and
    the files it names show; else why it is not known to."""
    if system.in_process_probe is not None:
        return (
            None
            if system.in_process_probe
            else "the scenario says it does not (`in_process_probe: false`)"
        )
    if any(_calls_install(arg) for arg in system.command):
        return None
    read: list[Path] = []
    if _sources_call_install(_named_files(system, scenario_dir), read):
        return None
    shown = ", ".join(str(p) for p in read[:4]) + (" ..." if len(read) > 4 else "")
    return (
        "neither its command line nor a file it names calls aftershock.harness.probe.install()"
        + (f" (read: {shown})" if read else "")
        + "; if it calls it from a file the "
        "harness cannot see, say so with `in_process_probe: true`"
    )


class Command:
    name = "command"
    model = CommandSystem
    tag: tuple[str, str | None] = ("command", None)
    shape = "`command: [...]`"
    order = 30
    family: Literal["training"] = "training"
    golden = None

    def launch(
        self,
        system: CommandSystem,
        *,
        run_dir: Path,
        scenario_dir: Path,
        seed: int,
        extra_args: tuple[str, ...] = (),
    ) -> Launch:
        values = {
            "run_dir": str(run_dir),
            "scenario_dir": str(scenario_dir.resolve()),
            "seed": str(seed),
        }
        if uses(system, "port"):
            values["port"] = str(free_port())
        if system.cwd:
            cwd = (scenario_dir / expand(system.cwd, values)).resolve()
        else:
            # A fresh folder per run: what a run writes where it stands (a snapshot.pt)
            # must not reach the next run, nor the fault-free twin's the faulted run's.
            cwd = run_dir / "work"
            if cwd.is_dir():
                shutil.rmtree(cwd)
            cwd.mkdir(parents=True)
        env = {key: expand(value, values) for key, value in system.env.items()}
        if not system.cwd and "-m" in system.command:
            # `python -m pkg.main` finds its module from the scenario's folder, as it would
            # from the folder it runs in (and as `validate` found it).
            env["PYTHONPATH"] = os.pathsep.join(
                p
                for p in (
                    values["scenario_dir"],
                    env.get("PYTHONPATH", os.environ.get("PYTHONPATH")),
                )
                if p
            )
        return Launch(
            [expand(arg, values) for arg in absolute_args(system, scenario_dir)],
            cwd,
            env,
            system.world,
            tuple(system.all_probes()),
            tuple(str(cwd / expand(pattern, values)) for pattern in system.logs),
            values,
        )

    def target(self, launch: Launch, *, run_dir: Path, run_id: str, timeline: Timeline) -> Target:
        return LocalTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)

    def capabilities(self, system: CommandSystem | None) -> frozenset[str]:
        return LocalTarget.capabilities

    def probe(self, system: CommandSystem | None, scenario_dir: Path | None) -> str | None:
        if system is None:
            return "a plain command does not call it"
        return probe_reason(system, scenario_dir)

    def unresolved(self, system: CommandSystem, target: Any, probed: bool) -> str | None:
        """Why ``target`` can never name a process of this job, or None. A command's ranks
        are its processes' RANK, or what the job reports of itself: through the in-process
        probe's hello (``probed``) or a log probe's ``event: hello`` line, whose groups say
        which coordinates it reports."""
        if (
            target.rank is not None
            and system.world is not None
            and not 0 <= target.rank < system.world
        ):
            return (
                f"the system's `world: {system.world}` has ranks 0-{system.world - 1}; "
                "give a rank of the world, or correct `world`"
            )
        reported = {"rank", "pid"} if probed else set()
        for p in system.all_probes():
            if p.event == "hello":
                reported |= set(re.compile(p.pattern).groupindex)
        if probed:
            reported |= {"replica", "shard", "role"}
        needs = []
        if target.replica is not None or target.shard is not None:
            needs = [c for c in ("replica",) if c not in reported]
        elif target.role in ("spare", "router") and "role" not in reported:
            needs = ["role"]
        if not needs:
            return None
        return (
            f"this command's processes have no {needs[0]}: only the job can say which "
            f"process has one, and it says so neither through aftershock.harness.probe.install() "
            f"nor a log probe with `event: hello` and a (?P<{needs[0]}>...) group. Name "
            "the processes by what they have instead: `env: {REPLICA_GROUP_ID: '1'}`, "
            "`cmdline: ...`, `role: agent|worker` (docs/own-job.md)"
        )

    def world(self, system: CommandSystem) -> int | None:
        return system.world

    def steps(self, system: CommandSystem) -> int | None:
        return system.steps

    def default_root(self, system: CommandSystem, run_dir: Path) -> Path:
        """Where the job works, so a fault on its files finds them: its ``cwd`` (a relative
        one, or one with ``${scenario_dir}``, is resolved against the scenario's folder by
        the caller), else the fresh ``work`` folder :meth:`launch` gives it."""
        if not system.cwd:
            return run_dir / "work"
        return Path(expand(system.cwd, {"run_dir": str(run_dir)}))

    def root_is_run_folder(self, system: CommandSystem) -> bool:
        marker = Path("/run_dir")
        return Path(os.path.normpath(self.default_root(system, marker))) == marker

    def twin(self, system: CommandSystem) -> CommandSystem:
        return system

    def twin_key(self, system: CommandSystem) -> dict[str, Any]:
        data: dict[str, Any] = system.model_dump(mode="json")
        data.pop("env", None)
        return data

    def fingerprint(self, system: CommandSystem, scenario_dir: Path) -> str:
        """Every file named in the command line (its script, the interpreter, a
        ``--config=FILE``) and every declared ``inputs`` file (a module run with ``-m``,
        data), by content."""
        digest = hashlib.sha256()
        for path in command_files(system, scenario_dir):
            digest.update(str(path).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
        return digest.hexdigest()

    def device(self, system: CommandSystem) -> str:
        return "cpu"

    def driver(self, system: CommandSystem, *, seed: int, timeline: Timeline) -> Driver | None:
        return None

    def log_probes(self, system: CommandSystem) -> list[LogProbe]:
        return system.all_probes()

    def replays(self, system: CommandSystem) -> bool:
        return False

    def file_problems(
        self, system: CommandSystem, scenario_dir: Path
    ) -> list[tuple[tuple[str | int, ...], str]]:
        _, missing = system.input_files(scenario_dir)
        return [
            (
                ("inputs", index),
                f"nothing matches {system.inputs[index]!r} in {system.workdir(scenario_dir)} "
                "(an input the command reads must exist: its content keys the fault-free twin)",
            )
            for index in missing
        ]

    def problems(self, scenario: Any) -> list[str]:
        system: CommandSystem = scenario.system
        expect = scenario.expect
        probed = {p.event for p in system.all_probes()}
        problems: list[str] = []
        if expect.params_match and "params" not in probed:
            problems.append(
                "expect.params_match on a command needs a log probe with "
                "`event: params` and a `(?P<digest>...)` group"
            )
        missing = [e for e in ("checkpoint_saved", "checkpoint_loaded") if e not in probed]
        if expect.checkpoint_durable and missing:
            problems.append(
                "expect.checkpoint_durable on a command needs log probes with "
                + " and ".join(f"`event: {e}`" for e in missing)
                + " (and a `(?P<step>...)` group)"
            )
        if "stop_grace" in system.model_fields_set and scenario.load is None:
            problems.append(
                "system.stop_grace is how long a server gets to exit once its "
                "`load:` was served; without a `load:` the command ends by itself "
                "(or at its `timeout`, with 3 s to exit): remove stop_grace, or add "
                "a `load:` block"
            )
        return problems


COMMAND = register(Command())
