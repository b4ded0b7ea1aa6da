"""The Xid catalogue, the driver's log-line format, and gpu.xid on real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.faults import nvml_sim
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, pending
from aftershock.faults.registry import get
from aftershock.faults.xid import CATALOG, GPU_XID, Action, Effect, kernel_log_line
from aftershock.faults.xid import get as get_xid

REQUIRED = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154)
NVIDIA_BUCKETS = re.compile(
    r"^(RESTART_APP|RESET_GPU|RESTART_BM|IGNORE|CONTACT_SUPPORT|WORKFLOW_\w+|XID_154)\b"
)


@pytest.mark.timeout(60)
def test_catalogue_covers_the_required_xids_with_nvidia_text() -> None:
    for code in REQUIRED:
        entry = CATALOG[code]
        assert entry.code == code
        assert entry.mnemonic
        assert entry.name
        assert entry.meaning
        assert entry.message
        assert NVIDIA_BUCKETS.match(entry.nvidia_action), entry
        assert entry.nvidia_investigation
        assert isinstance(entry.effect, Effect)
        assert isinstance(entry.action, Action)


@pytest.mark.timeout(60)
def test_catalogue_effects_and_actions_follow_nvidia() -> None:
    assert CATALOG[79].effect is Effect.DEVICE_LOST
    assert CATALOG[79].nvidia_action == "RESTART_BM"
    assert CATALOG[79].action is Action.DRAIN_NODE
    assert CATALOG[74].effect is Effect.LINK_DOWN
    for code in (13, 31, 43):
        assert CATALOG[code].effect is Effect.KILL_PROCESS
        assert CATALOG[code].action is Action.RESTART_APP
    for code in (48, 94, 95):
        assert CATALOG[code].effect is Effect.POISON_MEMORY
    for code in (63, 64, 92, 154):
        assert CATALOG[code].effect is Effect.LOG_ONLY
    assert CATALOG[94].action is Action.RESTART_APP  # contained: only that app restarts
    assert CATALOG[95].action is Action.RESET_GPU  # uncontained: the GPU must be reset
    assert CATALOG[119].effect is Effect.HANG
    with pytest.raises(KeyError, match="not in the catalogue"):
        get_xid(7)


@pytest.mark.timeout(60)
def test_kernel_log_line_matches_the_driver_format() -> None:
    # krcReportXid: "NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s"
    assert (
        kernel_log_line(13, bus_id="0000:3B:00", pid=1234, name="python", message="boom")
        == "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, boom"
    )
    assert (
        kernel_log_line(43, bus_id="0000:3b:00")
        == "NVRM: Xid (PCI:0000:3b:00): 43, pid='<unknown>', name=<unknown>, Ch 00000008"
    )
    # Xid 79 is logged from the GPU-lost path, which prints no pid or name.
    assert (
        kernel_log_line(79, bus_id="0000:3b:00", pid=1234, name="python")
        == "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    )
    line = kernel_log_line(63, bus_id="0000:10:1c", pid=1896, name="python")
    assert re.fullmatch(
        r"NVRM: Xid \(PCI:[0-9a-f:]+\): 63, pid=\d+, name=\S+, Row Remapper: .*", line
    )


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    folder = tmp_path / "nvml"
    env = {**os.environ, nvml_sim.NVML_DIR_ENV: str(folder), "LOCAL_RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        yield proc, folder
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _ref(proc: subprocess.Popen[bytes]) -> ProcessRef:
    for _ in range(100):
        ref = ProcessRef.of(proc.pid)
        if ref is not None:
            return ref
        time.sleep(0.01)
    raise AssertionError("child did not start")


@pytest.mark.timeout(60)
def test_gpu_xid_is_registered() -> None:
    assert get("gpu.xid") is GPU_XID


@pytest.mark.timeout(60)
def test_xid_13_publishes_and_kills(
    sleeper: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, folder = sleeper
    journal = Journal.create("xid13", tmp_path / "journal")
    applied = GPU_XID.inject(_ref(proc), {"code": 13}, journal)
    assert proc.wait(timeout=10) == -9
    assert applied.journal_id is None
    log = (folder / "kern.log").read_text()
    # LOCAL_RANK=1 in the target's environment picks GPU 1 and its bus id.
    assert f"NVRM: Xid (PCI:0000:2a:00): 13, pid={proc.pid}, name=python" in log
    events = (folder / "gpu1.events.jsonl").read_text().splitlines()
    assert len(events) == 1
    assert '"event_data":13' in events[0]


@pytest.mark.timeout(60)
def test_xid_119_hangs_until_reverted(
    sleeper: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, _ = sleeper
    ref = _ref(proc)
    journal = Journal.create("xid119", tmp_path / "journal")
    applied = GPU_XID.inject(ref, {"code": 119}, journal)
    assert applied.journal_id is not None
    assert [p.kind for p in pending(journal.path)] == ["gpu.xid"]
    deadline = time.monotonic() + 5
    while not ref.stopped() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref.stopped()
    GPU_XID.revert(applied.undo)
    GPU_XID.revert(applied.undo)  # idempotent
    deadline = time.monotonic() + 5
    while ref.stopped() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref.alive()
    assert not ref.stopped()


@pytest.mark.timeout(60)
def test_xid_needs_a_folder_and_the_right_one(tmp_path: Path) -> None:
    bare = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={k: v for k, v in os.environ.items() if k != nvml_sim.NVML_DIR_ENV},
    )
    try:
        journal = Journal.create("xidnodir", tmp_path / "journal")
        with pytest.raises(ValueError, match="AFTERSHOCK_NVML_DIR"):
            GPU_XID.inject(_ref(bare), {"code": 63}, journal)
        applied = GPU_XID.inject(
            _ref(bare), {"code": 63, "nvml_dir": str(tmp_path / "given")}, journal
        )
        assert "Row Remapper" in (tmp_path / "given" / "kern.log").read_text()
        assert bare.poll() is None  # log_only leaves the process alone
        assert applied.journal_id is None
    finally:
        bare.kill()
        bare.wait()


@pytest.mark.timeout(60)
def test_xid_mismatched_folder_is_refused(
    sleeper: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, _ = sleeper
    journal = Journal.create("xidmismatch", tmp_path / "journal")
    with pytest.raises(ValueError, match="not the folder the target reads"):
        GPU_XID.inject(_ref(proc), {"code": 63, "nvml_dir": str(tmp_path / "other")}, journal)


@pytest.mark.timeout(60)
def test_xid_154_names_the_recovery_action(
    sleeper: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, folder = sleeper
    journal = Journal.create("xid154", tmp_path / "journal")
    applied = GPU_XID.inject(
        _ref(proc), {"code": 154, "gpu": 0, "recovery_action": "node_reboot"}, journal
    )
    line = (folder / "kern.log").read_text().splitlines()[-1]
    assert line.endswith(
        "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) "
        "to 0x2 (Node Reboot Required)"
    )
    assert applied.undo["action"] == "drain_node"
