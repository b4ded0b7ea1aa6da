"""A simulated NVML: pynvml's names and semantics over files, so Xid faults reach a rank.

A rank process on a machine without a GPU (or a test that must not touch a real
one) opts in with ``import aftershock.faults.nvml_sim as pynvml`` and runs the same health
watcher it would run against ``nvidia-ml-py``: register for
``nvmlEventTypeXidCriticalError``, wait with ``nvmlEventSetWait_v2``, and see
``NVMLError_GpuIsLost`` from device calls after an Xid 79, exactly as real
pynvml raises them (same classes, same ``.value``, same constants).

Transport, one folder per run (``$AFTERSHOCK_NVML_DIR``):

- ``devices.json``: the simulated GPUs (name, UUID, PCI bus id), written once;
- ``gpu<N>.events.jsonl``: one JSON line per event, appended by the injector;
- ``state.json``: which devices are lost and which NVLinks are down, replaced
  atomically under ``state.lock``;
- ``kern.log``: the kernel-log lines the driver would print (``NVRM: Xid ...``).

The injector side is :func:`publish_xid`, :func:`set_device_lost`,
:func:`set_links_down` and :func:`reset_device` (the "GPU reset"). Waiting
polls the event files every 10 ms: no inotify, no threads, a few syscalls per
poll, and files work across the process boundary without any cooperation.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aftershock.faults import _jsonl, contract

NVML_DIR_ENV = contract.NVML_DIR_ENV
GPU_COUNT_ENV = "AFTERSHOCK_NVML_GPUS"  # how many GPUs a fresh folder simulates (default 1)
POLL_S = 0.01

# --- constants, values as in nvidia-ml-py's pynvml.py ------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18  # per nvml.h; pynvml's own constant has drifted between releases

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000

# Not attributable to a MIG GPU / compute instance (nvml.h, nvmlEventData_t).
NO_INSTANCE = 0xFFFFFFFF


# --- errors, the same hierarchy pynvml builds --------------------------------------------------


class NVMLError(Exception):
    """pynvml's error root: ``NVMLError(value)`` returns the subclass for that value."""

    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}
    _errcode_to_string: ClassVar[dict[int, str]] = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def _error_class(name: str, value: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: object) -> NVMLError:
        return NVMLError.__new__(cls, value)

    made = type(name, (NVMLError,), {"__new__": new, "__module__": __name__})
    NVMLError._valClassMapping[value] = made
    return made


# Named as pynvml names them: "NVMLError_" + CamelCase of the NVML_ERROR_ suffix.
NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_AlreadyInitialized = _error_class(
    "NVMLError_AlreadyInitialized", NVML_ERROR_ALREADY_INITIALIZED
)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_InsufficientSize = _error_class(
    "NVMLError_InsufficientSize", NVML_ERROR_INSUFFICIENT_SIZE
)
NVMLError_InsufficientPower = _error_class(
    "NVMLError_InsufficientPower", NVML_ERROR_INSUFFICIENT_POWER
)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_Timeout = _error_class("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_IrqIssue = _error_class("NVMLError_IrqIssue", NVML_ERROR_IRQ_ISSUE)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class(
    "NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND
)
NVMLError_CorruptedInforom = _error_class(
    "NVMLError_CorruptedInforom", NVML_ERROR_CORRUPTED_INFOROM
)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_ResetRequired = _error_class("NVMLError_ResetRequired", NVML_ERROR_RESET_REQUIRED)
NVMLError_OperatingSystem = _error_class("NVMLError_OperatingSystem", NVML_ERROR_OPERATING_SYSTEM)
NVMLError_LibRmVersionMismatch = _error_class(
    "NVMLError_LibRmVersionMismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH
)
NVMLError_InUse = _error_class("NVMLError_InUse", NVML_ERROR_IN_USE)
NVMLError_Memory = _error_class("NVMLError_Memory", NVML_ERROR_MEMORY)
NVMLError_NoData = _error_class("NVMLError_NoData", NVML_ERROR_NO_DATA)
NVMLError_VgpuEccNotSupported = _error_class(
    "NVMLError_VgpuEccNotSupported", NVML_ERROR_VGPU_ECC_NOT_SUPPORTED
)
NVMLError_InsufficientResources = _error_class(
    "NVMLError_InsufficientResources", NVML_ERROR_INSUFFICIENT_RESOURCES
)
NVMLError_FreqNotSupported = _error_class(
    "NVMLError_FreqNotSupported", NVML_ERROR_FREQ_NOT_SUPPORTED
)
NVMLError_ArgumentVersionMismatch = _error_class(
    "NVMLError_ArgumentVersionMismatch", NVML_ERROR_ARGUMENT_VERSION_MISMATCH
)
NVMLError_Deprecated = _error_class("NVMLError_Deprecated", NVML_ERROR_DEPRECATED)
NVMLError_NotReady = _error_class("NVMLError_NotReady", NVML_ERROR_NOT_READY)
NVMLError_GpuNotFound = _error_class("NVMLError_GpuNotFound", NVML_ERROR_GPU_NOT_FOUND)
NVMLError_InvalidState = _error_class("NVMLError_InvalidState", NVML_ERROR_INVALID_STATE)
NVMLError_ResetTypeNotSupported = _error_class(
    "NVMLError_ResetTypeNotSupported", NVML_ERROR_RESET_TYPE_NOT_SUPPORTED
)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)


def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def nvmlErrorString(result: int) -> str:
    return str(NVMLError(result))


# --- the folder: devices, events, state (shared by both sides) --------------------------------

# PCI bus ids of an 8-GPU HGX H100 baseboard, in nvidia-smi order, so simulated
# kernel-log lines look like the ones operators grep for.
_BUS_IDS = (
    "0000:18:00",
    "0000:2a:00",
    "0000:3a:00",
    "0000:5d:00",
    "0000:9a:00",
    "0000:ab:00",
    "0000:ba:00",
    "0000:db:00",
)
DEFAULT_NAME = "NVIDIA H100 80GB HBM3"


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str
    bus_id: str  # domain:bus:device as the kernel log prints it, e.g. 0000:3b:00


def _bus_id(index: int) -> str:
    if index < len(_BUS_IDS):
        return _BUS_IDS[index]
    return f"0001:{index:02x}:00"


def _devices_path(folder: Path) -> Path:
    return folder / "devices.json"


def _events_path(folder: Path, index: int) -> Path:
    return folder / f"gpu{index}.events.jsonl"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise read-modify-write of the folder's shared files between processes."""
    fd = os.open(folder / "state.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def setup(folder: str | os.PathLike[str], count: int | None = None) -> list[DeviceInfo]:
    """Create the folder with ``count`` simulated GPUs, or grow it to ``count``; idempotent."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        existing = _read_json(_devices_path(path)) or {"devices": []}
        devices: list[dict[str, Any]] = list(existing["devices"])
        wanted = max(count if count is not None else int(os.environ.get(GPU_COUNT_ENV, "1")), 1)
        if len(devices) < wanted:
            for index in range(len(devices), wanted):
                # Stable per folder and index, so every process sees the same UUID.
                ident = uuid.uuid5(uuid.NAMESPACE_URL, f"aftershock:{path.resolve()}:{index}")
                devices.append(
                    {
                        "index": index,
                        "name": DEFAULT_NAME,
                        "uuid": f"GPU-{ident}",
                        "bus_id": _bus_id(index),
                    }
                )
            _write_json_atomic(_devices_path(path), {"devices": devices})
    return [DeviceInfo(**d) for d in devices]


def devices(folder: str | os.PathLike[str]) -> list[DeviceInfo]:
    data = _read_json(_devices_path(Path(folder)))
    return [DeviceInfo(**d) for d in data["devices"]] if data else []


def device_state(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"lost": [index...], "links_down": {"index": [link...]}}``."""
    data = _read_json(Path(folder) / "state.json")
    return data if data else {"lost": [], "links_down": {}}


def _update_state(folder: Path, change: Any, *, locked: bool = False) -> None:
    with contextlib.nullcontext() if locked else _locked(folder):
        state = device_state(folder)
        change(state)
        _write_json_atomic(folder / "state.json", state)


def _lose(index: int) -> Any:
    def change(state: dict[str, Any]) -> None:
        if index not in state["lost"]:
            state["lost"].append(index)

    return change


def _links_down(index: int, links: list[int] | None) -> Any:
    down = list(range(NVML_NVLINK_MAX_LINKS)) if links is None else list(links)

    def change(state: dict[str, Any]) -> None:
        current = set(state["links_down"].get(str(index), []))
        state["links_down"][str(index)] = sorted(current | set(down))

    return change


def set_device_lost(folder: str | os.PathLike[str], index: int) -> None:
    """The GPU fell off the bus: every device call now raises NVMLError_GpuIsLost."""
    _update_state(Path(folder), _lose(index))


def set_links_down(
    folder: str | os.PathLike[str], index: int, links: list[int] | None = None
) -> None:
    """Mark NVLinks of a GPU inactive (all of them when ``links`` is None)."""
    _update_state(Path(folder), _links_down(index, links))


def reset_device(folder: str | os.PathLike[str], index: int) -> None:
    """``nvidia-smi -r`` for the simulation: the device answers again, its links are up."""

    def change(state: dict[str, Any]) -> None:
        state["lost"] = [i for i in state["lost"] if i != index]
        state["links_down"].pop(str(index), None)

    path = Path(folder)
    if path.is_dir():
        _update_state(path, change)


def _boottime_prefix() -> str:
    # dmesg prints seconds since boot; CLOCK_BOOTTIME is the same clock.
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    return f"[{now:12.6f}] "


def append_kernel_log(folder: str | os.PathLike[str], line: str) -> None:
    _jsonl.append(Path(folder) / "kern.log", (_boottime_prefix() + line + "\n").encode())


def publish_event(
    folder: str | os.PathLike[str],
    gpu_index: int,
    event_type: int,
    event_data: int,
    *,
    pid: int | None = None,
) -> None:
    """Append one event to a GPU's event file; a waiting rank sees it within a poll."""
    path = Path(folder)
    setup(path, gpu_index + 1)
    _append_event(path, gpu_index, event_type, event_data, pid)


def _append_event(
    path: Path, gpu_index: int, event_type: int, event_data: int, pid: int | None
) -> None:
    record = {
        "t": time.time(),
        "event_type": event_type,
        "event_data": event_data,
        "pid": pid,
        "gpu_instance_id": NO_INSTANCE,
        "compute_instance_id": NO_INSTANCE,
    }
    # One write(2) with O_APPEND: a reader never sees two events interleaved.
    _jsonl.append(_events_path(path, gpu_index), _jsonl.encode(record))


def publish_xid(
    folder: str | os.PathLike[str],
    gpu_index: int,
    code: int,
    pid: int | None = None,
    *,
    name: str | None = None,
    message: str | None = None,
    lose_device: bool = False,
    links_down: bool = False,
) -> str:
    """Publish Xid ``code`` on a GPU: an NVML event plus the driver's kernel-log line.

    ``lose_device`` / ``links_down`` change the device state in the same locked
    step, state first: a rank that receives the event already finds the device
    lost, and a rank that finds the device lost (and then takes the lock) always
    finds the event too. Returns the kernel-log line (without dmesg's timestamp).
    """
    from aftershock.faults.xid import kernel_log_line  # the catalogue imports this module

    path = Path(folder)
    info = setup(path, gpu_index + 1)[gpu_index]
    line = kernel_log_line(code, bus_id=info.bus_id, pid=pid, name=name, message=message)
    with _locked(path):
        if lose_device:
            _update_state(path, _lose(gpu_index), locked=True)
        if links_down:
            _update_state(path, _links_down(gpu_index, None), locked=True)
        append_kernel_log(path, line)
        _append_event(path, gpu_index, nvmlEventTypeXidCriticalError, code, pid)
    return line


# --- the consumer side: pynvml's functions ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class c_nvmlDevice_t:
    """A device handle; pynvml's class name, compared by value."""

    index: int
    uuid: str


@dataclass(frozen=True, slots=True)
class c_nvmlEventData_t:
    """What nvmlEventSetWait_v2 returns; field names as in pynvml."""

    device: c_nvmlDevice_t
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass(frozen=True, slots=True)
class nvmlPciInfo_t:
    """PCI info; the char fields are bytes, as ctypes returns them from pynvml."""

    busIdLegacy: bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int
    busId: bytes


@dataclass
class c_nvmlEventSet_t:
    """An event set: what is registered and how far each GPU's event file was read."""

    # device index -> (event type mask, byte offset read so far, partial line)
    registered: dict[int, tuple[int, _jsonl.Tail]] = field(default_factory=dict)
    handles: dict[int, c_nvmlDevice_t] = field(default_factory=dict)
    pending: list[c_nvmlEventData_t] = field(default_factory=list)
    freed: bool = False


_folder: Path | None = None
_refcount = 0


def _check_init() -> Path:
    if _folder is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _folder


def _device_info(handle: c_nvmlDevice_t) -> DeviceInfo:
    folder = _check_init()
    if not isinstance(handle, c_nvmlDevice_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if handle.index in device_state(folder)["lost"]:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    known = devices(folder)
    if handle.index >= len(known):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return known[handle.index]


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlInitWithFlags(flags: int) -> None:
    """Initialise from ``$AFTERSHOCK_NVML_DIR``; a missing variable reads as "no library"."""
    global _folder, _refcount
    folder = os.environ.get(NVML_DIR_ENV)
    if not folder:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    setup(folder)
    _folder = Path(folder)
    _refcount += 1


def nvmlShutdown() -> None:
    global _folder, _refcount
    _check_init()
    _refcount -= 1
    if _refcount <= 0:
        _refcount = 0
        _folder = None


def nvmlSystemGetDriverVersion() -> str:
    _check_init()
    return "aftershock-nvml-sim"


def nvmlDeviceGetCount() -> int:
    return len(devices(_check_init()))


def nvmlDeviceGetHandleByIndex(index: int) -> c_nvmlDevice_t:
    folder = _check_init()
    known = devices(folder)
    if not 0 <= index < len(known):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if index in device_state(folder)["lost"]:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return c_nvmlDevice_t(index, known[index].uuid)


def nvmlDeviceGetName(handle: c_nvmlDevice_t) -> str:
    return _device_info(handle).name


def nvmlDeviceGetUUID(handle: c_nvmlDevice_t) -> str:
    return _device_info(handle).uuid


def nvmlDeviceGetIndex(handle: c_nvmlDevice_t) -> int:
    return _device_info(handle).index


def nvmlDeviceGetPciInfo(handle: c_nvmlDevice_t) -> nvmlPciInfo_t:
    info = _device_info(handle)
    domain, bus, dev = (int(part, 16) for part in info.bus_id.split(":"))
    return nvmlPciInfo_t(
        busIdLegacy=f"{domain:04X}:{bus:02X}:{dev:02X}.0".encode(),
        domain=domain,
        bus=bus,
        device=dev,
        pciDeviceId=0x233010DE,  # H100 SXM5 device id 0x2330, vendor 0x10de
        pciSubSystemId=0x16C110DE,
        busId=f"{domain:08X}:{bus:02X}:{dev:02X}.0".encode(),
    )


nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo


def nvmlDeviceGetNvLinkState(handle: c_nvmlDevice_t, link: int) -> int:
    info = _device_info(handle)
    if not 0 <= link < NVML_NVLINK_MAX_LINKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    down = device_state(_check_init())["links_down"].get(str(info.index), [])
    return NVML_FEATURE_DISABLED if link in down else NVML_FEATURE_ENABLED


def nvmlDeviceGetSupportedEventTypes(handle: c_nvmlDevice_t) -> int:
    _device_info(handle)
    return nvmlEventTypeXidCriticalError


def nvmlEventSetCreate() -> c_nvmlEventSet_t:
    _check_init()
    return c_nvmlEventSet_t()


def nvmlDeviceRegisterEvents(
    handle: c_nvmlDevice_t, eventTypes: int, eventSet: c_nvmlEventSet_t
) -> None:
    """Register for events that happen *from now on*, as NVML does."""
    info = _device_info(handle)
    if not isinstance(eventSet, c_nvmlEventSet_t) or eventSet.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    try:
        offset = _events_path(_check_init(), info.index).stat().st_size
    except FileNotFoundError:
        offset = 0
    mask, tail = eventSet.registered.get(info.index, (0, _jsonl.Tail(offset=offset)))
    eventSet.registered[info.index] = (mask | int(eventTypes), tail)
    eventSet.handles[info.index] = handle


def _collect(folder: Path, eventSet: c_nvmlEventSet_t) -> None:
    for index, (mask, tail) in list(eventSet.registered.items()):
        try:
            with open(_events_path(folder, index), "rb") as handle:
                lines = tail.read(handle)
        except FileNotFoundError:
            continue
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                record = json.loads(line)
                if record["event_type"] & mask:
                    eventSet.pending.append(
                        c_nvmlEventData_t(
                            device=eventSet.handles[index],
                            eventType=int(record["event_type"]),
                            eventData=int(record["event_data"]),
                            gpuInstanceId=int(record.get("gpu_instance_id", NO_INSTANCE)),
                            computeInstanceId=int(record.get("compute_instance_id", NO_INSTANCE)),
                        )
                    )


def nvmlEventSetWait_v2(eventSet: c_nvmlEventSet_t, timeoutms: int) -> c_nvmlEventData_t:
    """Wait up to ``timeoutms`` for an event; NVMLError_Timeout if none comes.

    Events already published are delivered first (so an Xid 79 is seen before
    the lost device); after that a lost registered device raises
    NVMLError_GpuIsLost, as the real call does.
    """
    folder = _check_init()
    if not isinstance(eventSet, c_nvmlEventSet_t) or eventSet.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    deadline = time.monotonic() + max(int(timeoutms), 0) / 1000.0
    while True:
        _collect(folder, eventSet)
        if eventSet.pending:
            return eventSet.pending.pop(0)
        lost = set(device_state(folder)["lost"])
        if lost & set(eventSet.registered):
            # The injector marks the device lost and appends the Xid under this lock:
            # once we hold it, the event that explains the loss is in the file.
            with _locked(folder):
                _collect(folder, eventSet)
            if eventSet.pending:
                return eventSet.pending.pop(0)
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(min(POLL_S, remaining))


def nvmlEventSetWait(eventSet: c_nvmlEventSet_t, timeoutms: int) -> c_nvmlEventData_t:
    return nvmlEventSetWait_v2(eventSet, timeoutms)


def nvmlEventSetFree(eventSet: c_nvmlEventSet_t) -> None:
    _check_init()
    if not isinstance(eventSet, c_nvmlEventSet_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    eventSet.freed = True
    eventSet.registered.clear()
    eventSet.pending.clear()
