"""The reference trainer's reactions to the chaos engine's faults, piece by piece, in process.

No torchrun here: a one-rank Gloo group is enough for the checkpoint vote, and the Xid
watcher runs against the simulated NVML. The end-to-end reactions are the shipped
scenarios in scenarios/faults/ (collective_error_restart, memory_nan_gradient,
storage_full_checkpoint, storage_crash_during_save, xid_*, straggle_rank).
"""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from aftershock.reference_impl import checkpoint, health, trainer  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probe writes to this file, as it does under the harness."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("AFTERSHOCK_EVENTS", str(path))
    return path


def read(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["event"] == kind]


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Any]:
    """A one-rank Gloo world: every collective of checkpoint.save runs for real."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_save_commits_when_every_rank_wrote(tmp_path: Path, group: Any, events: Path) -> None:
    path = checkpoint.save(tmp_path / "ckpt", 20, {"w": torch.ones(3)}, {"seed": 0}, group)
    assert path is not None
    assert (path / checkpoint.COMMIT).is_file()
    assert read(events, "checkpoint_failed") == []


def test_resume_skips_a_corrupt_checkpoint_and_ignores_a_torn_save(
    tmp_path: Path, group: Any, events: Path
) -> None:
    """What a restarted trainer loads, exactly: the shipped storage scenarios show the same
    end to end, but when the harness's kill lands is up to timing, and here it is not."""
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        state = {"w": torch.full((3,), float(step))}
        assert checkpoint.save(root, step, state, {"seed": 0}, group) is not None
    newest = checkpoint.step_dir(root, 30) / "rank_0.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    newest.write_bytes(bytes(data))
    torn = checkpoint.step_dir(root, 40)  # a save that crashed before its COMMIT marker
    torn.mkdir()
    (torn / "rank_0.pt").write_bytes(b"torn")

    loaded = checkpoint.load_latest(root, {"seed": 0}, group)
    assert loaded is not None
    step, _, state = loaded
    assert step == 20
    assert torch.equal(state["w"], torch.full((3,), 20.0))
    skipped = [(e["step"], e["reason"]) for e in read(events, "checkpoint_skipped")]
    assert skipped == [(30, "sha256 mismatch")]  # the torn folder is not even a candidate


def test_a_full_disk_costs_the_checkpoint_not_the_run(
    tmp_path: Path, group: Any, events: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint.write_atomic

    def full(path: Path, data: bytes) -> None:
        if path.name.endswith(".json"):  # the payload lands, its sidecar does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", full)
    root = tmp_path / "ckpt"
    assert checkpoint.save(root, 20, {"w": torch.ones(3)}, {"seed": 0}, group) is None
    assert not checkpoint.step_dir(root, 20).exists()  # the partial payload is gone
    assert checkpoint.committed_steps(root) == []
    (failed,) = read(events, "checkpoint_failed")
    assert failed["step"] == 20
    assert failed["error"].startswith("ENOSPC")
    (detected,) = read(events, "failure_detected")
    assert detected["cause"] == "checkpoint_failed: ENOSPC"

    # The disk has room again: the next save commits and is the one start-up loads.
    monkeypatch.setattr(checkpoint, "write_atomic", real)
    assert checkpoint.save(root, 40, {"w": torch.ones(3)}, {"seed": 0}, group) is not None
    loaded = checkpoint.load_latest(root, {"seed": 0}, group)
    assert loaded is not None
    assert loaded[0] == 40


def test_xid_monitor_logs_harmless_xids_and_fails_on_the_others(events: Path) -> None:
    monitor = trainer.XidMonitor()
    monitor.on_xid(63, "none")
    monitor.check()  # log only: training goes on
    monitor.on_xid(79, "drain_node")
    monitor.on_xid(13, "restart_app")  # the first fatal Xid is the one reported
    with pytest.raises(trainer.XidFailure) as caught:
        monitor.check()
    assert trainer._describe(caught.value)[0] == "xid_79"
    answers = [(e["code"], e["action"]) for e in read(events, "xid_action")]
    assert answers == [(63, "none"), (79, "drain_node"), (13, "restart_app")]


def test_watcher_sees_a_simulated_xid_on_its_local_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aftershock.faults import nvml_sim

    folder = tmp_path / "nvml"
    monkeypatch.setenv(nvml_sim.NVML_DIR_ENV, str(folder))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv(nvml_sim.GPU_COUNT_ENV, raising=False)
    seen: list[tuple[int, str]] = []
    arrived = threading.Event()

    def on_xid(code: int, action: str) -> None:
        seen.append((code, action))
        arrived.set()

    watcher = health.XidWatcher(gpu=3, on_xid=on_xid)
    if watcher.nvml is not nvml_sim:
        pytest.skip("a real GPU is visible: the watcher uses real NVML")
    assert watcher.start()
    try:
        # Rank 3's GPU exists only because the watcher sized the simulation by LOCAL_WORLD_SIZE.
        deadline = 5.0
        while not (folder / "devices.json").exists() and deadline > 0:
            arrived.wait(0.05)
            deadline -= 0.05
        threading.Event().wait(0.3)  # registered: it sees events from now on
        nvml_sim.publish_xid(folder, 3, 79, lose_device=True)
        assert arrived.wait(5), "the watcher never reported the Xid"
    finally:
        watcher.stop()
    assert seen == [(79, "drain_node")]


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ([1.0, 1.0, 1.0, 1.0], []),
        ([1.0, 1.1, 0.9, 4.0], [3]),
        ([1.0, 1.0, 1.9, 1.0], []),  # slower, but under 2x the median
        ([0.0, 0.0, 0.0, 0.0], []),  # nothing measured yet
    ],
)
def test_stragglers_are_ranks_slower_than_twice_the_median(
    values: list[float], named: list[int]
) -> None:
    assert [rank for rank, _ in trainer.stragglers(values)] == named
