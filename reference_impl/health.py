"""GPU health for the reference trainer: watch NVML for Xid errors and react as NVIDIA says.

The watcher uses real pynvml when the rank has a CUDA device, and Aftershock's
simulated NVML (``aftershock.faults.nvml_sim``, same function names, errors and values)
when it has none but the harness gave it an NVML folder. It runs in a daemon
thread and hands each Xid to ``on_xid`` with the action NVIDIA recommends for
it (``aftershock.faults.xid``'s catalogue):

- ``none`` (63, 92, ...): log and keep training;
- ``restart_app`` (13, 31, 43, 94, ...): the application must restart: treat
  it as a failure of this rank;
- ``reset_gpu`` (48, 95, 64, ...): the GPU must be reset before it is used
  again: stop using it and fail this rank (the scheduler resets it);
- ``drain_node`` (79): the node is gone for good: fail and report it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from aftershock.faults.xid import CATALOG, Action


def nvml_module() -> Any | None:
    """Real pynvml for a real GPU, the simulation for a simulated one, else None."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        try:
            import pynvml

            return pynvml
        except ImportError:
            return None
    if os.environ.get("AFTERSHOCK_NVML_DIR"):
        import aftershock.faults.nvml_sim as sim

        # One simulated GPU per local rank (the simulation defaults to one), so every rank
        # can watch the GPU its LOCAL_RANK names.
        os.environ.setdefault(sim.GPU_COUNT_ENV, os.environ.get("LOCAL_WORLD_SIZE", "1"))

        return sim
    return None


def action_for(code: int) -> str:
    entry = CATALOG.get(code)
    return str(entry.action) if entry is not None else str(Action.RESTART_APP)


class XidWatcher:
    """Waits for Xid events on one GPU and reports each with its recommended action."""

    def __init__(self, gpu: int, on_xid: Callable[[int, str], None]) -> None:
        self.gpu = gpu
        self.on_xid = on_xid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nvml = nvml_module()

    def start(self) -> bool:
        if self.nvml is None:
            return False
        self._thread = threading.Thread(target=self._run, name="xid-watcher", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        nvml = self.nvml
        if nvml is None:
            return
        try:
            nvml.nvmlInit()
            handle = nvml.nvmlDeviceGetHandleByIndex(self.gpu)
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except Exception:
            return  # no NVML here after all: nothing to watch
        try:
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(events, 200)
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError:
                    return
                code = int(data.eventData)
                self.on_xid(code, action_for(code))
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(events)
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
