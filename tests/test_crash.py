"""A harness SIGKILLed at a random moment, with every kind of lasting fault applied or
being applied, leaves nothing behind once its reaper, or `aftershock heal`, is done.

Each trial runs `aftershock run` on a torch-free job of seven ranks with a frozen rank,
two stragglers (cgroup quota and SIGSTOP duty cycle), a partition (nftables and a
cgroup), an Xid hang (SIGSTOP), a lost GPU (simulated NVML state), a restorable heap
bit flip, a full disk (tmpfs) and a restorable corruption of a file outside the run
folder. It is killed at a seeded random moment (and once as soon as every fault is
in place); with its reaper alive, or with the reaper killed too, in which case
`aftershock heal` must clean up and exit 0. The oracle reads the system itself (the
process table, /proc/mounts, `nft list tables`, cgroup folders, the file's bytes)
and the journal's raw JSON, never the heal code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import reaper_of

from aftershock.faults import _cgroup
from aftershock.faults._proc import all_pids, environ, state

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "fixtures" / "ranks_job.py"
FAULTS = 9  # in the scenario below

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _need_everything() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: nftables, mount, cgroups, /proc/PID/mem")
    if not any(p and os.access(p, os.X_OK) for p in (shutil.which("nft"), "/usr/sbin/nft")):
        pytest.skip("nft not installed: apt-get install nftables")
    v2 = _cgroup.v2_mount()
    if v2 is None or not v2.is_relative_to("/sys/fs/cgroup"):
        pytest.skip("no cgroup2 mount under /sys/fs/cgroup (net.partition new_connections)")
    cpu = _cgroup.v1_mount("cpu")
    if cpu is None or not _cgroup.writable(cpu):
        pytest.skip("no writable cgroup v1 cpu controller (process.straggle by quota)")


def _scenario(tmp_path: Path) -> Path:
    path = tmp_path / "crash.yaml"
    path.write_text(f"""\
name: crash
system:
  command: [{sys.executable}, {JOB}]
  env: {{JOB_RANKS: "7", JOB_DURATION: "60"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
faults:
  - {{kind: process.freeze, target: {{rank: 0}}, at: {{step: 3}}}}
  - {{kind: process.straggle, method: cgroup, target: {{rank: 1}}, at: {{step: 3}}}}
  - {{kind: process.straggle, method: signal, target: {{rank: 2}}, at: {{step: 3}}}}
  - {{kind: net.partition, target: {{rank: 3}}, at: {{step: 3}}}}
  - {{kind: gpu.xid, code: 46, target: {{rank: 4}}, at: {{step: 3}}}}
  - {{kind: gpu.xid, code: 79, target: {{rank: 5}}, at: {{step: 3}}}}
  - {{kind: memory.bitflip, region: heap, restore: true, target: {{rank: 6}}, at: {{step: 3}}}}
  - {{kind: storage.full, dir: ckpt, at: {{step: 3}}}}
  - {{kind: storage.corrupt, root: {tmp_path / "data"}, path: "*.bin", restore: true,
     at: {{step: 3}}}}
""")
    return path


def _run_processes(runs: Path) -> list[int]:
    """Live processes whose timeline is under ``runs``: the run's own, however started."""
    found = []
    for pid in all_pids():
        mine = environ(pid).get("AFTERSHOCK_EVENTS", "").startswith(str(runs))
        if mine and state(pid) not in (None, "Z", "X"):
            found.append(pid)
    return found


def _journal_records(state_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in (state_dir / "journal").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _events(runs: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for path in runs.glob("**/events.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                found.append(event)
    return found


def _tables() -> set[str]:
    nft = shutil.which("nft") or "/usr/sbin/nft"
    out = subprocess.run([nft, "list", "tables", "inet"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.startswith("table")}


class Trial:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.runs = tmp_path / "runs"
        self.state = tmp_path / "state"
        self.data = tmp_path / "data" / "blob.bin"
        self.data.parent.mkdir()
        self.data.write_bytes(bytes(range(256)) * 64)
        self.digest = hashlib.sha256(self.data.read_bytes()).hexdigest()
        self.env = {**os.environ, "AFTERSHOCK_STATE_DIR": str(self.state)}
        self.harness = subprocess.Popen(
            [sys.executable, "-m", "aftershock", "run", str(_scenario(tmp_path)),
             "--run-dir", str(self.runs), "--plain"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
            cwd=ROOT,
        )
        self.started = time.monotonic()
        self.records: list[dict[str, Any]] = []
        self.groups: set[str] = set()  # aftershock_ cgroups the run's processes were in

    def wait_applied(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(_events(self.runs, "fault_injected")) + len(
                _events(self.runs, "fault_failed")) < FAULTS:
            assert self.harness.poll() is None, self.output()
            assert time.monotonic() < deadline, "the faults were never applied"
            time.sleep(0.05)
        failed = _events(self.runs, "fault_failed")
        assert not failed, [e.get("error") for e in failed]

    def output(self) -> str:
        self.harness.kill()
        out, _ = self.harness.communicate(timeout=30)
        return str(out)

    def kill(self, *, reaper: str) -> tuple[list[str], str]:
        """SIGKILL the harness; ``reaper`` is "alive" or "killed". Returns what was in
        place at that moment, and a line for the failure message."""
        for pid in _run_processes(self.runs):
            self.groups.update(self._aftershock_groups(pid))
        reaper_pid = reaper_of(self.harness.pid)
        if reaper_pid is not None:
            # Stopped (alive) or killed before the harness dies: either way the journal
            # is whole when read below; a stopped reaper heals once continued.
            os.kill(reaper_pid, signal.SIGSTOP if reaper == "alive" else signal.SIGKILL)
        self.harness.kill()
        self.harness.communicate(timeout=30)
        self.records = _journal_records(self.state)
        in_place = self.in_place()
        if reaper_pid is not None and reaper == "alive":
            os.kill(reaper_pid, signal.SIGCONT)
        return in_place, (f"killed after {time.monotonic() - self.started:.2f}s; reaper "
                          f"{'none yet' if reaper_pid is None else reaper}; in place: "
                          f"{in_place}")

    @staticmethod
    def _aftershock_groups(pid: int) -> set[str]:
        found = set()
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return found
        for line in lines:
            hier, controllers, path = line.split(":", 2)
            if "aftershock_" not in path:
                continue
            mount = (_cgroup.v2_mount() if hier == "0"
                     else _cgroup.v1_mount(controllers.split(",")[0]))
            if mount is not None:
                found.add(str(_cgroup.directory(mount, path)))
        return found

    def undo(self, kind: str) -> list[dict[str, Any]]:
        return [r["undo"] for r in self.records if r.get("kind") == kind and r.get("undo")]

    def in_place(self) -> list[str]:
        """Everything of this run still on the machine."""
        found = []
        pids = _run_processes(self.runs)
        if pids:
            stopped = [p for p in pids if state(p) in ("T", "t")]
            found.append(f"{len(pids)} processes ({len(stopped)} stopped)")
        tables = _tables()
        found += [f"table {u['table']}" for u in self.undo("net.partition")
                  if u["table"] in tables]
        groups = self.groups | {u["cgroup"] for k in ("net.partition", "process.straggle")
                                for u in self.undo(k) if u.get("cgroup")}
        found += [f"cgroup {g}" for g in sorted(groups) if Path(g).exists()]
        with open("/proc/mounts") as handle:
            mounts = [line.split()[:2] for line in handle]
        found += [f"mount {src} on {point}" for src, point in mounts
                  if point.startswith(str(self.tmp))]
        if hashlib.sha256(self.data.read_bytes()).hexdigest() != self.digest:
            found.append("corrupted file not restored")
        for area in ("backup", "storage"):
            if (self.state / area).is_dir() and any((self.state / area).iterdir()):
                found.append(f"state/{area} not emptied")
        for nvml in self.runs.glob("**/nvml/state.json"):
            if json.loads(nvml.read_text()).get("lost"):
                found.append("simulated GPU still lost")
        if list((self.state / "journal").glob("*.jsonl")):
            found.append("journal")
        return found

    def settle(self, timeout: float = 20) -> list[str]:
        deadline = time.monotonic() + timeout
        left = self.in_place()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.in_place()
        return left


@pytest.fixture
def trial(tmp_path: Path) -> Any:
    _need_everything()
    made: list[Trial] = []

    def make() -> Trial:
        made.append(Trial(tmp_path))
        return made[0]

    yield make
    for t in made:  # whatever happened, leave the machine clean
        if t.harness.poll() is None:
            t.harness.kill()
            t.harness.communicate(timeout=30)
        subprocess.run([sys.executable, "-m", "aftershock", "heal"], env=t.env, cwd=ROOT,
                       capture_output=True, timeout=60, check=False)


def _everything(in_place: list[str]) -> None:
    """Every kind of leftover was there when the harness died: the trial proves something."""
    text = "\n".join(in_place)
    for what in ("stopped", "table aftershock_", "cgroup", "mount aftershock_",
                 "corrupted file", "state/backup", "simulated GPU", "journal"):
        assert what in text, f"{what!r} not in place at the kill: {in_place}"
    assert sum("cgroup" in line for line in in_place) >= 2, in_place  # partition, straggle


# Seeded moments, from the harness's start: before, during and after the faults go in.
MOMENTS = [pytest.param(seed, id=f"random{seed}") for seed in (1, 2)] + [
    pytest.param(None, id="all-applied")]


@pytest.mark.parametrize("moment", MOMENTS)
def test_reaper_leaves_nothing(trial: Any, moment: int | None) -> None:
    t = trial()
    if moment is None:
        t.wait_applied()
    else:
        time.sleep(random.Random(moment).uniform(0.3, 3.0))
    in_place, what = t.kill(reaper="alive")
    if moment is None:
        _everything(in_place)
    assert t.settle() == [], what


@pytest.mark.parametrize("moment", MOMENTS)
def test_heal_leaves_nothing_when_the_reaper_died_too(trial: Any, moment: int | None) -> None:
    t = trial()
    if moment is None:
        t.wait_applied()
    else:
        time.sleep(random.Random(100 + moment).uniform(0.3, 3.0))
    in_place, what = t.kill(reaper="killed")
    if moment is None:
        _everything(in_place)
    healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], env=t.env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert healed.returncode == 0, f"{what}\n{healed.stdout}{healed.stderr}"
    # Processes get SIGKILL, which takes effect a moment later; everything else is done.
    assert t.settle(timeout=5) == [], f"{what}\n{healed.stdout}"
