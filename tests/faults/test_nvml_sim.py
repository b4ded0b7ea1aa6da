"""The NVML simulation seen from a real consumer process, and its likeness to real pynvml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aftershock.faults import nvml_sim
from aftershock.faults._proc import ProcessRef
from aftershock.faults.heal import heal_journal
from aftershock.faults.journal import Journal, pending
from aftershock.faults.xid import GPU_XID

ROOT = Path(__file__).resolve().parents[2]

CONSUMER = textwrap.dedent(
    """
    import json, sys
    import aftershock.faults.nvml_sim as pynvml

    def say(**kw):
        print(json.dumps(kw), flush=True)

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
    try:
        pynvml.nvmlEventSetWait_v2(events, 50)
    except pynvml.NVMLError_Timeout as exc:
        say(step="timeout", cls=type(exc).__name__, value=exc.value)
    say(step="ready", name=pynvml.nvmlDeviceGetName(handle),
        bus=pynvml.nvmlDeviceGetPciInfo(handle).busId.decode())
    event = pynvml.nvmlEventSetWait_v2(events, 20000)
    say(step="event", type=event.eventType, xid=event.eventData,
        gi=event.gpuInstanceId, same=event.device == handle)
    try:
        pynvml.nvmlDeviceGetName(handle)
        say(step="after", error=None)
    except pynvml.NVMLError as exc:
        say(step="after", error=type(exc).__name__, value=exc.value)
    try:
        pynvml.nvmlEventSetWait_v2(events, 50)
    except pynvml.NVMLError as exc:
        say(step="wait_after", error=type(exc).__name__)
    sys.stdin.readline()  # the test resets the GPU, then lets us look again
    say(step="reset", name=pynvml.nvmlDeviceGetName(handle))
    pynvml.nvmlEventSetFree(events)
    pynvml.nvmlShutdown()
    """
)


def _line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "consumer exited early"
    return dict(json.loads(line))


@pytest.mark.timeout(60)
def test_consumer_sees_xid_79_then_a_lost_gpu_until_reset(tmp_path: Path) -> None:
    folder = tmp_path / "nvml"
    env = {**os.environ, nvml_sim.NVML_DIR_ENV: str(folder), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _line(proc) == {"step": "timeout", "cls": "NVMLError_Timeout", "value": 10}
        ready = _line(proc)
        assert ready == {
            "step": "ready",
            "name": "NVIDIA H100 80GB HBM3",
            "bus": "00000000:18:00.0",
        }
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        # The run's folders hold the simulation's: a heal resets a device only there.
        journal = Journal.create("nvml79", tmp_path / "journal", folders=[tmp_path])
        started = time.monotonic()
        applied = GPU_XID.inject(ref, {"code": 79}, journal)
        event = _line(proc)
        assert time.monotonic() - started < 2.0
        assert event == {
            "step": "event",
            "type": nvml_sim.nvmlEventTypeXidCriticalError,
            "xid": 79,
            "gi": 0xFFFFFFFF,
            "same": True,
        }
        assert _line(proc) == {"step": "after", "error": "NVMLError_GpuIsLost", "value": 15}
        assert _line(proc) == {"step": "wait_after", "error": "NVMLError_GpuIsLost"}
        assert [p.kind for p in pending(journal.path)] == ["gpu.xid"]
        assert "79, GPU has fallen off the bus." in (folder / "kern.log").read_text()

        # The simulated GPU reset, from the journal record alone (what `aftershock heal` does).
        healed = heal_journal(journal.path)
        assert [h.error for h in healed] == [None]
        GPU_XID.revert(applied.undo)  # idempotent
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert _line(proc) == {"step": "reset", "name": "NVIDIA H100 80GB HBM3"}
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "nvml"
    monkeypatch.setenv(nvml_sim.NVML_DIR_ENV, str(folder))
    monkeypatch.setenv(nvml_sim.GPU_COUNT_ENV, "2")
    nvml_sim.nvmlInit()
    yield folder
    nvml_sim.nvmlShutdown()


@pytest.mark.timeout(60)
def test_uninitialised_and_missing_library() -> None:
    with pytest.raises(nvml_sim.NVMLError_Uninitialized):
        nvml_sim.nvmlDeviceGetCount()


@pytest.mark.timeout(60)
def test_missing_folder_variable_reads_as_no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nvml_sim.NVML_DIR_ENV, raising=False)
    with pytest.raises(nvml_sim.NVMLError_LibraryNotFound):
        nvml_sim.nvmlInit()


@pytest.mark.timeout(60)
def test_in_process_wait_timeout_and_filtering(sim: Path) -> None:
    assert nvml_sim.nvmlDeviceGetCount() == 2
    h0 = nvml_sim.nvmlDeviceGetHandleByIndex(0)
    h1 = nvml_sim.nvmlDeviceGetHandleByIndex(1)
    assert nvml_sim.nvmlDeviceGetUUID(h0) != nvml_sim.nvmlDeviceGetUUID(h1)
    with pytest.raises(nvml_sim.NVMLError_InvalidArgument):
        nvml_sim.nvmlDeviceGetHandleByIndex(2)
    nvml_sim.publish_xid(sim, 1, 13, 42)  # before registration: never delivered
    events = nvml_sim.nvmlEventSetCreate()
    nvml_sim.nvmlDeviceRegisterEvents(h1, nvml_sim.nvmlEventTypeXidCriticalError, events)
    started = time.monotonic()
    with pytest.raises(nvml_sim.NVMLError_Timeout) as caught:
        nvml_sim.nvmlEventSetWait_v2(events, 100)
    assert 0.09 <= time.monotonic() - started < 1.0
    assert caught.value.value == nvml_sim.NVML_ERROR_TIMEOUT
    assert str(caught.value) == "Timeout"
    nvml_sim.publish_xid(sim, 0, 31, 42)  # GPU 0 is not registered
    nvml_sim.publish_xid(sim, 1, 94, 42)
    nvml_sim.publish_xid(sim, 1, 63, 42)
    assert nvml_sim.nvmlEventSetWait_v2(events, 0).eventData == 94
    assert nvml_sim.nvmlEventSetWait(events, 0).eventData == 63
    with pytest.raises(nvml_sim.NVMLError_Timeout):
        nvml_sim.nvmlEventSetWait_v2(events, 0)
    nvml_sim.nvmlEventSetFree(events)


@pytest.mark.timeout(60)
def test_link_down_and_reset(sim: Path) -> None:
    handle = nvml_sim.nvmlDeviceGetHandleByIndex(0)
    assert nvml_sim.nvmlDeviceGetNvLinkState(handle, 3) == nvml_sim.NVML_FEATURE_ENABLED
    nvml_sim.set_links_down(sim, 0, [3])
    assert nvml_sim.nvmlDeviceGetNvLinkState(handle, 3) == nvml_sim.NVML_FEATURE_DISABLED
    assert nvml_sim.nvmlDeviceGetNvLinkState(handle, 2) == nvml_sim.NVML_FEATURE_ENABLED
    nvml_sim.reset_device(sim, 0)
    assert nvml_sim.nvmlDeviceGetNvLinkState(handle, 3) == nvml_sim.NVML_FEATURE_ENABLED


@pytest.mark.timeout(60)
def test_constants_and_errors_equal_real_pynvml() -> None:
    pynvml = pytest.importorskip(
        "pynvml", reason="nvidia-ml-py not installed (pip install nvidia-ml-py)"
    )
    if not hasattr(pynvml, "nvmlEventSetWait_v2"):
        pytest.skip("the installed pynvml is not NVIDIA's nvidia-ml-py")
    ours = {n: getattr(nvml_sim, n) for n in dir(nvml_sim) if n.startswith("NVML_ERROR_")}
    theirs = {n: getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_ERROR_")}
    assert ours == theirs
    for name in ("NVML_SUCCESS", "NVML_FEATURE_ENABLED", "NVML_FEATURE_DISABLED"):
        assert getattr(nvml_sim, name) == getattr(pynvml, name)
    for name in dir(nvml_sim):
        if name.startswith(("nvmlEventType", "NVML_GPU_RECOVERY_ACTION_")):
            assert getattr(nvml_sim, name) == getattr(pynvml, name), name
    ours_cls = {n for n in dir(nvml_sim) if n.startswith("NVMLError_")}
    theirs_cls = {n for n in dir(pynvml) if n.startswith("NVMLError_")}
    assert ours_cls == theirs_cls
    for name in sorted(theirs_cls):
        real, sim_cls = getattr(pynvml, name), getattr(nvml_sim, name)
        assert sim_cls().value == real().value, name
        assert isinstance(nvml_sim.NVMLError(real().value), sim_cls)
    for value in pynvml.NVMLError._errcode_to_string:
        assert str(nvml_sim.NVMLError(value)) == pynvml.NVMLError._errcode_to_string[value]
    # The functions a health watcher calls exist under the same names.
    for name in (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetNvLinkState",
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlEventSetWait",
        "nvmlEventSetFree",
        "nvmlErrorString",
        "nvmlExceptionClass",
    ):
        assert callable(getattr(pynvml, name)), name
        assert callable(getattr(nvml_sim, name)), name
    event_fields = {f[0] for f in pynvml.c_nvmlEventData_t._fields_}
    assert event_fields == set(nvml_sim.c_nvmlEventData_t.__dataclass_fields__)
