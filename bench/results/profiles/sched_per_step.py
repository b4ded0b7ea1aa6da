"""One failure-free job's scheduler and page-fault figures per step, in its steady state.

``python bench/results/profiles/sched_per_step.py ROW`` (from the repository root; ROW:
``ddp`` or ``trainer_no_ckpt``) launches the bench's job of that row (the same model and
launcher, ``bench.peers``) for 1,200 steps, reads every rank thread's
``/proc/PID/task/TID/sched`` and each rank's minor faults at rank 0's steps 300 and 1,000,
and prints per step: the ranks' main threads' migrations, voluntary and involuntary context
switches and CPU, the same over all their threads, and minor faults per rank. Run the rows
in turns: the host's speed drifts within minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.peers import Model, torchrun

FIRST, LAST, STEPS = 300, 1000, 1200
Figures = dict[tuple[str, str], tuple[bool, list[float]]]  # (pid, tid) -> (main?, figures)
FIELDS = ("se.nr_migrations", "nr_voluntary_switches", "nr_involuntary_switches",
          "se.sum_exec_runtime")


def command(row: str, workdir: str) -> list[str]:
    model = Model()
    args = [*model.args(), f"--steps={STEPS}"]
    if row == "ddp":
        return torchrun(model.world, 0, "bench.ddp_train", args)
    return torchrun(model.world, 0, "reference_impl.trainer",
                    [*args, "--recovery=restart", "--checkpoint-every=0",
                     f"--checkpoint-dir={workdir}/checkpoints"])


class Steps:
    """Rank 0's newest step, from the job's events file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step = path, 0, 0

    def __call__(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        whole = data.rfind(b"\n") + 1
        self.offset += whole
        for line in data[:whole].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "step" and event.get("rank") == 0:
                self.step = int(event["step"])
        return self.step


def sample() -> tuple[Figures, dict[str, int]]:
    """Every rank thread's scheduler figures, and each rank's minor faults."""
    threads: Figures = {}
    faults: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            ours = b"bench.ddp_train" in argv or b"reference_impl.trainer" in argv
            if not ours or b"torch.distributed.run" in argv:
                continue
            faults[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
            for tid in os.listdir(f"/proc/{pid}/task"):
                values: dict[str, float] = {}
                for line in Path(f"/proc/{pid}/task/{tid}/sched").read_text().splitlines():
                    key, sep, value = line.partition(":")
                    if sep and key.strip() in FIELDS:
                        values[key.strip()] = float(value)
                threads[(pid, tid)] = (tid == pid, [values.get(f, 0.0) for f in FIELDS])
        except OSError:
            continue
    return threads, faults


def main(row: str) -> None:
    workdir = tempfile.mkdtemp(prefix="sched-per-step-")
    events = Path(workdir) / "events.jsonl"
    env = {**os.environ, "AFTERSHOCK_EVENTS": str(events),
           "AFTERSHOCK_OUTPUT_DIR": f"{workdir}/out", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.getcwd()}
    with open(f"{workdir}/job.log", "wb") as log:
        job = subprocess.Popen(command(row, workdir), env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    steps = Steps(events)
    marks = []
    for target in (FIRST, LAST):
        while steps() < target and job.poll() is None:
            time.sleep(0.05)
        marks.append((steps(), time.monotonic(), *sample()))
    job.wait()
    (s0, t0, a, fa), (s1, t1, b, fb) = marks
    n = s1 - s0
    if n <= 0:
        sys.exit(f"the job ended before step {LAST} (exit {job.returncode}): {workdir}/job.log")

    def per_step(main_only: bool, i: int) -> float:
        keys = [k for k in a if k in b and (a[k][0] or not main_only)]
        return sum(b[k][1][i] - a[k][1][i] for k in keys) / n

    ranks = [p for p in fa if p in fb]
    figures = " ".join(f"{name} {per_step(True, i):.2f}" for i, name in
                       enumerate(("migrations", "voluntary", "involuntary")))
    every = " ".join(f"{name} {per_step(False, i):.2f}" for i, name in
                     enumerate(("migrations", "voluntary", "involuntary")))
    print(f"{row}: {n / (t1 - t0):.1f} steps/s | main threads per step: {figures}, CPU "
          f"{per_step(True, 3):.2f} ms | all threads: {every}, CPU {per_step(False, 3):.2f} ms"
          f" | minor faults per step and rank "
          f"{sum(fb[p] - fa[p] for p in ranks) / n / max(len(ranks), 1):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trainer_no_ckpt")
