"""A harness SIGKILLed with a partition, a freeze, a full disk and a straggler applied
leaves nothing behind once healed, whether by `heal_orphans` or by its reaper;
and a journal whose harness is still alive is left alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aftershock.faults.net
import aftershock.faults.storage
import aftershock.faults.straggle
from aftershock.faults import _cgroup, _nft, registry
from aftershock.faults._proc import ProcessRef, state
from aftershock.faults.heal import heal_orphans
from aftershock.faults.journal import pending, state_dir

ROOT = Path(__file__).resolve().parents[2]
# Imported so that heal_orphans in this process knows these kinds.
HEALED_KINDS = (
    aftershock.faults.net.PARTITION,
    aftershock.faults.storage.FULL,
    aftershock.faults.straggle.STRAGGLE,
)

# A harness-like parent: journals and applies four faults to children it started,
# prints what it did, then waits to be killed.
PARENT = """
    import json, os, subprocess, sys, time
    from pathlib import Path
    import aftershock.faults.net, aftershock.faults.process
    import aftershock.faults.storage, aftershock.faults.straggle
    from aftershock.faults._proc import ProcessRef
    from aftershock.faults.heal import start_reaper
    from aftershock.faults.journal import Journal

    root, use_reaper = Path(sys.argv[1]), sys.argv[2] == "reaper"
    # Like the harness: the journal names the run's folder, its children carry the run id.
    journal = Journal.create("heal-all", folders=[root])
    env = {**os.environ, "AFTERSHOCK_RUN_ID": "heal-all"}
    if use_reaper:
        start_reaper(journal.path)
    listener = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(60)"
    )
    kids = [
        subprocess.Popen([sys.executable, "-c", listener], stdout=subprocess.PIPE, text=True,
                         env=env),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env),
        subprocess.Popen([sys.executable, "-c", "import time\\nend = time.time() + 60\\n"
                          "while time.time() < end: pass"], env=env),
    ]
    kids[0].stdout.readline()
    refs = [ProcessRef.of(k.pid) for k in kids]
    me = ProcessRef.of(os.getpid())
    (root / "ckpt").mkdir()
    (root / "ckpt" / "step_1.pt").write_bytes(b"w" * 5000)
    applied = [
        aftershock.faults.net.PARTITION.inject(refs[0], {}, journal),
        aftershock.faults.process.FREEZE.inject(refs[1], {}, journal),
        aftershock.faults.storage.FULL.inject(me, {"root": str(root), "dir": "ckpt"}, journal),
        aftershock.faults.straggle.STRAGGLE.inject(refs[2], {"factor": 4}, journal),
    ]
    print(json.dumps({"journal": str(journal.path), "pids": [r.pid for r in refs],
                      "undo": {a.kind: dict(a.undo) for a in applied}}), flush=True)
    time.sleep(120)
"""


def _need_everything() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: nftables, mount and cgroups")
    if not any(p and os.access(p, os.X_OK) for p in (shutil.which("nft"), "/usr/sbin/nft")):
        pytest.skip("nft not installed: apt-get install nftables")
    v2 = _cgroup.v2_mount()
    if v2 is None or not v2.is_relative_to("/sys/fs/cgroup"):
        pytest.skip("no cgroup2 mount under /sys/fs/cgroup (net.partition new_connections)")
    cpu = _cgroup.v1_mount("cpu")
    if cpu is None or not _cgroup.writable(cpu):
        pytest.skip("no writable cgroup v1 cpu controller (process.straggle by quota)")


class Harness:
    def __init__(self, root: Path, mode: str) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PARENT), str(root), mode],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"harness exited early (rc={self.proc.wait()})"
        self.record: dict[str, Any] = json.loads(line)
        self.journal = Path(self.record["journal"])
        self.kids = [ProcessRef.of(pid) for pid in self.record["pids"]]
        self.undo: dict[str, dict[str, Any]] = self.record["undo"]

    def kill(self) -> None:
        self.proc.kill()
        with self.proc:
            pass

    def kill_kids(self) -> None:
        for ref in self.kids:
            if ref is not None:
                ref.signal(signal.SIGKILL)

    def leftovers(self) -> list[str]:
        """Everything of this harness's faults still in place."""
        found = []
        if self.undo["net.partition"]["table"] in _nft.tables():
            found.append("nft table")
        if Path(self.undo["net.partition"]["cgroup"]).exists():
            found.append("partition cgroup")
        frozen = self.kids[1]
        if frozen is not None and state(frozen.pid) in ("T", "t"):
            found.append("frozen child")
        with open("/proc/mounts") as handle:
            if any(line.split()[0] == self.undo["storage.full"]["source"] for line in handle):
                found.append("tmpfs mount")
        if Path(self.undo["process.straggle"]["cgroup"]).exists():
            found.append("straggle cgroup")
        return found


@pytest.fixture
def harness_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Harness] = []

    def make(mode: str) -> Harness:
        root = tmp_path / f"run{len(made)}"
        root.mkdir()
        made.append(Harness(root, mode))
        return made[-1]

    yield make
    for harness in made:  # whatever the test did, leave the machine clean
        harness.kill()
        heal_orphans()
        harness.kill_kids()


@pytest.mark.timeout(60)
def test_heal_orphans_undoes_everything_after_sigkill(harness_factory: Any) -> None:
    _need_everything()
    harness = harness_factory("plain")
    assert len(harness.leftovers()) == 5
    assert len(pending(harness.journal)) == 4
    os.kill(harness.proc.pid, signal.SIGKILL)
    harness.proc.wait()
    healed = heal_orphans()
    assert [h.error for h in healed] == [None] * 4
    assert harness.leftovers() == []
    assert not harness.journal.exists()  # nothing pending: the journal is removed
    assert all(ref is not None and ref.alive() for ref in harness.kids)  # thawed, not killed
    # The folder under the tmpfs holds what the run left there.
    assert (harness.root / "ckpt" / "step_1.pt").read_bytes() == b"w" * 5000


@pytest.mark.timeout(60)
def test_reaper_heals_when_the_harness_is_killed(harness_factory: Any) -> None:
    _need_everything()
    missing = {
        "aftershock.faults.net",
        "aftershock.faults.storage",
        "aftershock.faults.straggle",
    } - set(registry._BUILTIN_MODULES)
    if missing:
        # The reaper is a fresh `python -m faults.heal`: it knows only the built-in kinds.
        pytest.skip(f"add {sorted(missing)} to aftershock.faults.registry._BUILTIN_MODULES")
    harness = harness_factory("reaper")
    assert len(harness.leftovers()) == 5
    os.kill(harness.proc.pid, signal.SIGKILL)
    harness.proc.wait()
    deadline = time.monotonic() + 20
    while harness.leftovers() or harness.journal.exists():
        assert time.monotonic() < deadline, f"reaper left {aftershock.harness.leftovers()}"
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_heal_leaves_a_live_harness_alone(harness_factory: Any) -> None:
    _need_everything()
    harness = harness_factory("plain")
    assert heal_orphans() == []
    assert len(harness.leftovers()) == 5
    assert len(pending(harness.journal)) == 4
    assert harness.journal.parent == state_dir() / "journal"
    harness.kill()
    assert [h.error for h in heal_orphans()] == [None] * 4
    assert harness.leftovers() == []
