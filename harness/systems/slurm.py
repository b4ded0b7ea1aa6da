"""``slurm: {...}``: a job submitted to a Slurm cluster with ``sbatch`` (docs/scale-out.md).

The job is the reference trainer under torchrun on every node of the allocation
(``trainer:``), a command run by ``srun`` on every task (``command:``), or the user's own
batch script (``script:``). The cluster is whatever Slurm's clients on this machine reach:
the test cluster of ``make slurm-cluster``, or a site's given its ``partition`` and
``account``. The run folder must be on storage every node sees at the same path (the
shared timeline, checkpoints and the job's output are written there), as a site's home or
scratch filesystem is.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shlex
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from aftershock.harness.nodes.cluster import RDZV_PORT
from aftershock.harness.nodes.image import PROJECT_ROOT
from aftershock.harness.run.logprobe import LogProbe
from aftershock.harness.run.target import Launch, Target
from aftershock.harness.run.timeline import Timeline
from aftershock.harness.scenario import presets
from aftershock.harness.scenario.schema import MAX_WORLD, Duration, Strict
from aftershock.harness.systems import Driver, register
from aftershock.harness.systems._reference import fingerprint
from aftershock.harness.systems.nodes import NodeTrainer
from aftershock.harness.systems.trainer import TrainerSystem, World, trainer_program

MAX_NODES = 64
_NAME = r"^[A-Za-z0-9_.\-]+$"  # partition, account, qos names: passed to sbatch as they are


class SlurmJob(Strict):
    """One Slurm job: ``nodes`` × ``ntasks_per_node`` tasks, what runs on them, and where."""

    nodes: int = Field(ge=1, le=MAX_NODES, description="sbatch --nodes")
    ntasks_per_node: int = Field(1, ge=1, le=MAX_WORLD, description="sbatch --ntasks-per-node; "
                                 "with `trainer`: ranks per node (torchrun --nproc-per-node)")
    trainer: NodeTrainer | None = Field(None, description="the reference trainer: one "
                                        "torchrun agent per node (srun), c10d rendezvous at the "
                                        "batch host")
    command: list[str] | None = Field(None, min_length=1, description="run by `srun` on every "
                                      "task, from the scenario's folder")
    script: str | None = Field(None, description="a batch script (relative to the scenario's "
                               "folder) submitted as it is; its #SBATCH lines apply unless the "
                               "fields here set the same option")
    partition: str | None = Field(None, pattern=_NAME, description="sbatch --partition; "
                                  "default: the cluster's default partition")
    account: str | None = Field(None, pattern=_NAME, description="sbatch --account")
    qos: str | None = Field(None, pattern=_NAME, description="sbatch --qos")
    time_limit: Duration | None = Field(None, description="sbatch --time")
    requeue: bool = Field(False, description="sbatch --requeue (else --no-requeue): a job "
                          "preempted or on a failed node goes back to the queue")
    sbatch_args: list[str] = Field(default_factory=list, max_length=32,
                                   description="more sbatch options, as they are")
    world: int | None = Field(None, ge=1, le=MAX_WORLD, description="with `command` or "
                              "`script`: ranks at full strength; default nodes × ntasks_per_node")
    max_restarts: int = Field(3, ge=0, le=1000, description="with `trainer`: torchrun "
                              "--max-restarts")
    rdzv_conf: str = Field("", pattern=r"^[A-Za-z0-9_=,.]*$", description="with `trainer`: "
                           "torchrun --rdzv-conf")
    preset: str | list[str] | None = Field(
        None, description="with `command` or `script`: the frameworks whose own log lines "
        "become events (torchrun, torchft: docs/own-job.md); `probes` add to them")
    probes: list[LogProbe] = Field(default_factory=list, description="with `command` or "
                                   "`script`: log probes read on the job's output "
                                   "(logs/slurm-<job id>.out, every requeue appended) and on "
                                   "the files of `logs`")
    logs: list[str] = Field(default_factory=list, max_length=16, description="per-process "
                            "log files the harness follows as they appear and grow (absolute "
                            "globs, `${run_dir}` expanded), each its own stream (`stream: logs`)")

    @model_validator(mode="after")
    def _one_job(self) -> SlurmJob:
        given = [n for n in ("trainer", "command", "script") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `trainer:` (the reference trainer), "
                             "`command: [...]` (run by srun) or `script:` (a batch script) as "
                             "the job")
        size = self.nodes * self.ntasks_per_node
        if self.trainer is not None:
            if self.trainer.recovery != "restart":
                raise ValueError("trainer.recovery: only restart under Slurm for now "
                                 "(docs/scale-out.md)")
            if size % self.trainer.shards:
                raise ValueError(f"{size} ranks (nodes × ntasks_per_node) are not a multiple "
                                 f"of trainer.shards {self.trainer.shards}")
            if self.world is not None:
                raise ValueError("`world` is for `command` and `script`: the trainer's is "
                                 "nodes × ntasks_per_node")
            if self.preset is not None or self.probes or self.logs:
                raise ValueError("`preset`, `probes` and `logs` are for `command` and "
                                 "`script`: the trainer reports through the in-process probe")
        try:
            presets.probes(self.preset)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        return self

    def all_probes(self) -> list[LogProbe]:
        """Its presets' probes, then its own."""
        return [*presets.probes(self.preset), *self.probes]



class SlurmSystem(Strict):
    """``system: {slurm: {...}}``: the job, and the run's limit and environment."""

    slurm: SlurmJob
    timeout: Duration = Field(timedelta(minutes=5), description="limit for the whole run, "
                              "queue wait included")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment (sbatch "
                                "exports the harness's own to the job)")

    def as_trainer(self) -> TrainerSystem:
        job = self.slurm
        assert job.trainer is not None
        t = job.trainer
        size = job.nodes * job.ntasks_per_node
        return TrainerSystem(
            reference="trainer", world=World(replicas=size // t.shards, shards=t.shards),
            recovery=t.recovery, steps=t.steps, checkpoint_every=t.checkpoint_every,
            collective_timeout=t.collective_timeout, step_sleep=t.step_sleep,
            max_restarts=job.max_restarts, timeout=self.timeout)


@dataclass(frozen=True, slots=True)
class SlurmLaunch(Launch):
    """The batch script and the sbatch options of one run."""

    script: str = ""  # the batch script's text
    sbatch: tuple[str, ...] = ()  # sbatch's options, before the script
    #: Files the job needs in the run folder, written (executable) before sbatch: (path in
    #: the run folder, text). SRUN_EPILOG_MARK in a text is replaced then (srun_files).
    files: tuple[tuple[str, str], ...] = ()


#: Where the job's steps record their exit codes (in ``<run>/slurm/``): the batch script the
#: harness writes (its one step), or the `srun` of a user's own batch script (srun_files).
STEPS_FILE = "steps.jsonl"
#: In the `srun` wrapper: "1" where srun may be given the harness's epilog, "" where the site
#: has an SrunEpilog of its own (which --epilog would replace).
SRUN_EPILOG_MARK = "@AFTERSHOCK_SRUN_EPILOG@"


def batch_script(system: SlurmSystem, *, run_dir: Path, seed: int,
                 extra_args: tuple[str, ...], scenario_dir: Path) -> str:
    """The batch script the harness submits for ``trainer`` or ``command``; for ``script``,
    the one around the user's own (around_script)."""
    job = system.slurm
    if job.script is not None:
        return around_script((scenario_dir / job.script).read_text(),
                             name=Path(job.script).name, run_dir=run_dir)
    lines = ["#!/bin/bash", "# Written by Aftershock (harness/systems/slurm.py).", "set -u"]
    if job.trainer is not None:
        program = [*trainer_program(system.as_trainer(), run_dir, seed), *extra_args]
        # The batch script runs on the allocation's first node: its agent hosts the
        # rendezvous. One torchrun agent per node; its workers are the node's ranks.
        torchrun = [sys.executable, "-m", "torch.distributed.run",
                    "--nnodes=$SLURM_JOB_NUM_NODES",
                    f"--nproc-per-node={job.ntasks_per_node}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=$head:{RDZV_PORT}",
                    "--rdzv-id=$SLURM_JOB_ID", f"--max-restarts={job.max_restarts}",
                    "--monitor-interval=0.1",
                    *([f"--rdzv-conf={job.rdzv_conf}"] if job.rdzv_conf else []),
                    *program]
        lines += ["head=$(hostname)",
                  "srun --ntasks-per-node=1 --kill-on-bad-exit=0 "
                  + " ".join(a if a.startswith("--") and "$" in a else shlex.quote(a)
                             for a in torchrun)]
    else:
        assert job.command is not None
        lines.append("srun " + shlex.join([*job.command, *extra_args]))
    # The step's exit code as the job itself saw it: Slurm keeps it only in its accounting
    # (sacct, with slurmdbd), which a cluster may not run. One srun, so the step is <job>.0
    # in every run of the job; a run that Slurm ends (preemption, a node lost) records none.
    record = shlex.quote(str(run_dir / "slurm" / STEPS_FILE))
    lines += ["rc=$?",
              "printf '{\"job_id\": \"%s\", \"step\": \"%s.0\", \"restart\": %d, "
              "\"exit_code\": %d, \"nodes\": \"%s\"}\\n' \"$SLURM_JOB_ID\" \"$SLURM_JOB_ID\" "
              f'"${{SLURM_RESTART_COUNT:-0}}" "$rc" "$SLURM_JOB_NODELIST" >> {record}',
              "exit $rc"]
    return "\n".join(lines) + "\n"


def around_script(text: str, *, name: str, run_dir: Path) -> str:
    """The batch script submitted for a user's own ``script``: its leading comment block
    (its #SBATCH lines, which sbatch reads up to the first command), then ``exec`` of the
    script itself, unchanged, from the run folder, with the harness's ``srun`` first on its
    PATH (srun_files), so each of its steps records its exit code where Slurm keeps none
    (no accounting). A file that is not a script (no ``#!``) goes as it is: sbatch says why."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return text
    head = list(itertools.takewhile(
        lambda line: not line.strip() or line.lstrip().startswith("#"), lines[1:]))
    return "\n".join([
        "#!/bin/sh", *head,
        f"# Written by Aftershock (harness/systems/slurm.py) around {name}, which runs as it",
        "# is (the #SBATCH lines above are its own); each of its `srun` steps records its exit",
        f"# code in {run_dir / 'slurm' / STEPS_FILE}.",
        f"PATH={shlex.quote(str(run_dir / 'slurm' / 'bin'))}:$PATH",
        "export PATH",
        f'exec {shlex.quote(str(run_dir / "slurm" / "script" / name))} "$@"',
    ]) + "\n"


#: The `srun` a user's own batch script finds first on its PATH (srun_files): @BIN@, @RECORD@,
#: @EPILOG@ are the run's paths (quoted), @NAME@ the script's name.
_SRUN = r'''#!/bin/bash
# Written by Aftershock (harness/systems/slurm.py): `srun` for the batch script @NAME@.
bin=@BIN@
kept=
IFS=: read -ra parts <<< "$PATH"
for part in "${parts[@]}"; do
  [ "$part" = "$bin" ] || kept="${kept:+$kept:}$part"
done
PATH=$kept
real=$(command -v srun) || { echo "srun: command not found" >&2; exit 127; }
note="$bin/.step.$(uname -n).$$"
rm -f "$note"
extra=()
if [ -n "@AFTERSHOCK_SRUN_EPILOG@" ] && [ -z "${SLURM_EPILOG:-}" ]; then
  extra=(--epilog=@EPILOG@)
  for arg in "$@"; do
    case $arg in --epilog|--epilog=*) extra=(); break ;; esac
  done
fi
# srun is sent the job's signals itself: this shell only waits for it, to record its end.
trap : HUP INT QUIT USR1 USR2 ALRM TERM
"$real" "${extra[@]}" "$@"
rc=$?
step=null
[ -s "$note" ] && step="\"$(head -c 64 "$note")\""
rm -f "$note"
printf '{"job_id": "%s", "step": %s, "restart": %d, "exit_code": %d, "source": "srun"}\n' \
  "${SLURM_JOB_ID:-}" "$step" "${SLURM_RESTART_COUNT:-0}" "$rc" >> @RECORD@
trap - HUP INT QUIT USR1 USR2 ALRM TERM
# Ended by a signal (HUP INT KILL USR1 USR2 PIPE ALRM TERM): so does this wrapper, as its
# caller would have seen srun end.
case $rc in
  129|130|137|138|140|141|142|143) kill -s "$((rc - 128))" $$ 2>/dev/null ;;
esac
exit "$rc"
'''
#: srun's epilog, run by srun after its step (on the host srun runs on): which step it was,
#: for the `srun` wrapper that started that srun (its parent) to record.
_SRUN_EPILOG = r'''#!/bin/sh
# Written by Aftershock (harness/systems/slurm.py): srun's epilog for the `srun` wrapper.
wrapper=$(awk '{print $4}' "/proc/$PPID/stat" 2>/dev/null)
printf '%s.%s' "$SLURM_JOB_ID" "$SLURM_STEP_ID" > @BIN@/".step.$(uname -n).$wrapper" 2>/dev/null
exit 0
'''


def srun_files(text: str, *, name: str, run_dir: Path) -> tuple[tuple[str, str], ...]:
    """What around_script runs: the user's script as it is, and the ``srun`` its PATH finds
    first. That ``srun`` takes itself off PATH (the step's tasks get the job's own), runs
    Slurm's srun with the same arguments, input and output, and records the step's exit code
    (and the job's restart count) in STEPS_FILE; the step's id comes from an srun epilog it
    adds, unless the script or the site gives srun one already (``--epilog``,
    ``SLURM_EPILOG``, SrunEpilog), which it leaves alone. It stays through the signals that
    srun itself is sent, and exits as srun did. The step's nodes are not recorded: srun's
    epilog is told the allocation's, not the step's."""
    bin_dir = run_dir / "slurm" / "bin"
    paths = {"@BIN@": bin_dir, "@RECORD@": run_dir / "slurm" / STEPS_FILE,
             "@EPILOG@": bin_dir / "srun-epilog"}
    srun, epilog = _SRUN.replace("@NAME@", name), _SRUN_EPILOG
    for mark, path in paths.items():
        srun = srun.replace(mark, shlex.quote(str(path)))
        epilog = epilog.replace(mark, shlex.quote(str(path)))
    return ((f"slurm/script/{name}", text), ("slurm/bin/srun", srun),
            ("slurm/bin/srun-epilog", epilog))


def sbatch_options(system: SlurmSystem, *, run_dir: Path) -> list[str]:
    """What the harness asks of sbatch: the allocation, where the job's output goes (the
    run folder's logs, appended to across requeues), the requeue policy, and the site's
    partition, account and QOS when given."""
    job = system.slurm
    options = [f"--nodes={job.nodes}", f"--ntasks-per-node={job.ntasks_per_node}",
               f"--output={run_dir / 'logs' / 'slurm-%j.out'}", "--open-mode=append",
               "--export=ALL", "--requeue" if job.requeue else "--no-requeue"]
    if job.partition:
        options.append(f"--partition={job.partition}")
    if job.account:
        options.append(f"--account={job.account}")
    if job.qos:
        options.append(f"--qos={job.qos}")
    if job.time_limit is not None:
        options.append(f"--time={max(1, int(job.time_limit.total_seconds() // 60))}")
    return [*options, *job.sbatch_args]


TIMING = ("requeue", "sbatch_args", "partition", "account", "qos", "time_limit",
          "max_restarts", "rdzv_conf")
TRAINER_TIMING = ("collective_timeout", "step_sleep", "checkpoint_every", "spares")


class Slurm:
    name = "slurm"
    model = SlurmSystem
    tag = ("slurm", None)
    shape = "`slurm: {nodes: N, ...}`"
    order = 50
    family: Literal["training"] = "training"
    golden = None  # a twin on a shared cluster queues behind everyone's jobs: no goldens yet

    def launch(self, system: SlurmSystem, *, run_dir: Path, scenario_dir: Path, seed: int,
               extra_args: tuple[str, ...] = ()) -> Launch:
        run_dir = run_dir.absolute()  # the same path on every node
        cwd = PROJECT_ROOT if system.slurm.trainer is not None else scenario_dir.resolve()
        script = batch_script(system, run_dir=run_dir, seed=seed, extra_args=extra_args,
                              scenario_dir=scenario_dir)
        options = sbatch_options(system, run_dir=run_dir)
        argv = ["sbatch", *options, str(run_dir / "slurm" / "job.sh")]
        job = system.slurm
        probes = tuple(job.all_probes())
        # The job's own output first (every task's lines, each requeue appended), then the
        # per-process files it names; only read when there are probes to read them.
        tails = (str(run_dir / "logs" / "slurm-*.out"),
                 *(pattern.replace("${run_dir}", str(run_dir)) for pattern in job.logs)) \
            if probes else ()
        files = srun_files((scenario_dir / job.script).read_text(), name=Path(job.script).name,
                           run_dir=run_dir) if job.script is not None and script.startswith(
                               "#!/bin/sh\n") else ()
        return SlurmLaunch(argv, cwd, dict(system.env), self.world(system), probes, tails,
                           script=script, sbatch=tuple(options), files=files)

    def target(self, launch: Launch, *, run_dir: Path, run_id: str,
               timeline: Timeline) -> Target:
        from aftershock.harness.nodes.slurm_target import SlurmTarget

        assert isinstance(launch, SlurmLaunch), "a slurm system's launch comes from launch()"
        return SlurmTarget(launch, run_dir=run_dir, run_id=run_id, timeline=timeline)

    def capabilities(self, system: SlurmSystem | None) -> frozenset[str]:
        from aftershock.harness.nodes.slurm_target import SlurmTarget

        return SlurmTarget.capabilities

    def probe(self, system: SlurmSystem | None, scenario_dir: Path | None) -> str | None:
        if system is None or system.slurm.trainer is not None:
            return None
        return "a `command` or `script` under Slurm is not known to call it"

    def world(self, system: SlurmSystem) -> int | None:
        job = system.slurm
        return job.world or job.nodes * job.ntasks_per_node

    def steps(self, system: SlurmSystem) -> int | None:
        trainer = system.slurm.trainer
        return trainer.steps if trainer is not None else None

    def default_root(self, system: SlurmSystem, run_dir: Path) -> Path:
        return run_dir / "checkpoints" if system.slurm.trainer is not None else run_dir

    def root_is_run_folder(self, system: SlurmSystem) -> bool:
        return system.slurm.trainer is None

    def twin(self, system: SlurmSystem) -> SlurmSystem:
        job = system.slurm
        if job.trainer is None:
            return system
        paced = job.trainer.model_copy(update={"step_sleep": timedelta(0)})
        return system.model_copy(update={"slurm": job.model_copy(update={"trainer": paced})})

    def twin_key(self, system: SlurmSystem) -> dict[str, Any]:
        data: dict[str, Any] = system.slurm.model_dump(mode="json", exclude_none=True)
        for name in TIMING:
            data.pop(name, None)
        for name in TRAINER_TIMING:
            data.get("trainer", {}).pop(name, None)
        return {"slurm": data}

    def fingerprint(self, system: SlurmSystem, scenario_dir: Path) -> str:
        job = system.slurm
        if job.trainer is not None:
            return fingerprint(("*.py",))
        text = json.dumps([job.command, job.script])
        if job.script is not None and (scenario_dir / job.script).is_file():
            text += (scenario_dir / job.script).read_text()
        return hashlib.sha256(text.encode()).hexdigest()

    def device(self, system: SlurmSystem) -> str:
        return "cpu"

    def driver(self, system: SlurmSystem, *, seed: int, timeline: Timeline) -> Driver | None:
        return None

    def log_probes(self, system: SlurmSystem) -> list[LogProbe]:
        return system.slurm.all_probes()

    def replays(self, system: SlurmSystem) -> bool:
        return False

    def file_problems(self, system: SlurmSystem, scenario_dir: Path
                      ) -> list[tuple[tuple[str | int, ...], str]]:
        script = system.slurm.script
        if script is not None and not (scenario_dir / script).is_file():
            return [(("slurm", "script"), f"no file {script!r} in {scenario_dir}")]
        return []

    def problems(self, scenario: Any) -> list[str]:
        return []


SLURM = register(Slurm())
