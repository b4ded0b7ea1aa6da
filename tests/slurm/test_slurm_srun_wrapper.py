"""The `srun` the harness puts before a user's own batch script (harness/systems/slurm.py):
without a cluster, against a stand-in srun, the script runs as it would without it (the
same exit codes, input, and its steps' PATH), and each step's exit code and id is recorded;
a script or site that gives srun an epilog of its own keeps it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aftershock.harness.systems.slurm import SRUN_EPILOG_MARK, around_script, srun_files

pytestmark = pytest.mark.timeout(60)
#: Slurm's srun as far as the wrapper can tell: it runs its command (its options dropped),
#: then its --epilog with the step's id, and exits as the command did. Steps are numbered
#: per job, as Slurm does.
FAKE_SRUN = """\
#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_SRUN_LOG"
epilog=
while [ $# -gt 0 ]; do
  case $1 in --epilog=*) epilog=${1#--epilog=}; shift ;; --*) shift ;; *) break ;; esac
done
step=$(cat "$FAKE_SRUN_STEPS" 2>/dev/null || echo 0)
echo $((step + 1)) > "$FAKE_SRUN_STEPS"
"$@"
rc=$?
[ -z "$epilog" ] || SLURM_STEP_ID=$step "$epilog" "$@"
exit $rc
"""
SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2

#SBATCH --time=5
srun sh -c 'exit 0'
echo "first $?"
echo hello | srun sh -c 'read -r line; echo "read $line"; exit 3'
echo "second $?"
srun sh -c 'echo "path $PATH"'
#SBATCH --not-an-option-any-more
"""


def _run(tmp_path: Path, script: str, env: dict[str, str] | None = None,
         epilog_allowed: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    for relative, text in srun_files(script, name="job.sh", run_dir=run_dir):
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace(SRUN_EPILOG_MARK, "1" if epilog_allowed else ""))
        path.chmod(0o755)
    wrapper = run_dir / "slurm" / "job.sh"
    wrapper.write_text(around_script(script, name="job.sh", run_dir=run_dir))
    fake = tmp_path / "slurm-bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(0o755)
    done = subprocess.run(
        ["sh", str(wrapper)], capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env={"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "77",
             "SLURM_RESTART_COUNT": "1", "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
             "FAKE_SRUN_STEPS": str(tmp_path / "steps.n"), **(env or {})})
    return done, run_dir


def _records(run_dir: Path) -> list[dict[str, object]]:
    text = (run_dir / "slurm" / "steps.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_the_script_runs_as_it_is_and_each_step_is_recorded(tmp_path: Path) -> None:
    done, run_dir = _run(tmp_path, SCRIPT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["first 0", "read hello", "second 3"], done.stdout
    # The steps' tasks get the job's PATH, without the harness's srun.
    assert lines[3] == f"path {tmp_path / 'slurm-bin'}:/usr/bin:/bin", done.stdout
    assert [(r["step"], r["exit_code"], r["restart"]) for r in _records(run_dir)] == [
        ("77.0", 0, 1), ("77.1", 3, 1), ("77.2", 0, 1)]
    assert not list((run_dir / "slurm" / "bin").glob(".step.*")), "a step note was left"


def test_the_scripts_own_sbatch_lines_head_what_is_submitted(tmp_path: Path) -> None:
    text = around_script(SCRIPT, name="job.sh", run_dir=tmp_path)
    head = text.splitlines()[:4]
    assert head == ["#!/bin/sh", "#SBATCH --nodes=2", "", "#SBATCH --time=5"]
    assert "--not-an-option-any-more" not in text  # past the first command: not sbatch's
    assert around_script("srun hostname\n", name="x", run_dir=tmp_path) == "srun hostname\n"


def test_an_epilog_the_script_gives_srun_is_kept(tmp_path: Path) -> None:
    """srun's --epilog would replace the user's SLURM_EPILOG (or the site's SrunEpilog): the
    wrapper then adds none, and records the exit code without the step's id."""
    own = tmp_path / "own-epilog"
    own.write_text("#!/bin/sh\necho own epilog >&2\n")
    own.chmod(0o755)
    script = "#!/bin/bash\nsrun sh -c 'exit 4'\n"
    done, run_dir = _run(tmp_path, script, env={"SLURM_EPILOG": str(own)})
    assert done.returncode == 4
    assert "--epilog" not in (tmp_path / "srun.log").read_text()
    assert [(r["step"], r["exit_code"]) for r in _records(run_dir)] == [(None, 4)]


def test_a_site_srun_epilog_is_kept(tmp_path: Path) -> None:
    done, run_dir = _run(tmp_path, "#!/bin/bash\nsrun true\n", epilog_allowed=False)
    assert done.returncode == 0, done.stderr
    assert "--epilog" not in (tmp_path / "srun.log").read_text()
    assert [(r["step"], r["exit_code"]) for r in _records(run_dir)] == [(None, 0)]
