"""The Xid catalogue and the ``gpu.xid`` fault: NVIDIA's GPU errors, simulated with their effects.

Each entry carries NVIDIA's own words (mnemonic, description, the "resolution
buckets" of the Xid catalog) next to what Aftershock does to simulate it: the
*effect* on the process using the GPU and the *action* a fault-tolerant system
is expected to take. Sources (see docs/xid.md):

- NVIDIA, "Analyzing Xid Errors with the Xid Catalog",
  https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
- NVIDIA, "GPU Debug Guidelines", https://docs.nvidia.com/deploy/gpu-debug-guidelines/index.html
- the kernel-log format printed by ``krcReportXid`` in NVIDIA's open kernel modules,
  ``src/nvidia/src/kernel/gpu/rc/kernel_rc.c``.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field, field_validator

from aftershock.faults import nvml_sim
from aftershock.faults._proc import ProcessRef, environ
from aftershock.faults.journal import Journal, UndoContext, UndoRefused
from aftershock.faults.params import MAX_SEED, MAX_WORLD, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
DEBUG_GUIDE_URL = "https://docs.nvidia.com/deploy/gpu-debug-guidelines/index.html"


class Effect(enum.StrEnum):
    """What the simulation does to the target when the Xid is injected."""

    KILL_PROCESS = "kill_process"  # the CUDA context is dead: the process goes (SIGKILL)
    HANG = "hang"  # the GPU stops answering: the process stops (SIGSTOP) until reset
    POISON_MEMORY = "poison_memory"  # data in GPU memory is wrong (memory.* does the bits)
    DEVICE_LOST = "device_lost"  # NVML/CUDA calls fail with "GPU is lost" until reset
    LINK_DOWN = "link_down"  # NVLinks inactive until reset (net.* cuts the traffic)
    LOG_ONLY = "log_only"  # an event and a log line, nothing else changes


class Action(enum.StrEnum):
    """What a fault-tolerant system should do, normalised from NVIDIA's immediate action."""

    NONE = "none"  # log it, keep going
    RESTART_APP = "restart_app"  # the application (rank) must restart; the GPU is fine
    RESET_GPU = "reset_gpu"  # stop the GPU's processes, `nvidia-smi -r`, then restart
    DRAIN_NODE = "drain_node"  # take the node out: reboot / power-cycle, maybe RMA


@dataclass(frozen=True, slots=True)
class Xid:
    code: int
    mnemonic: str  # NVIDIA's mnemonic (the driver's #define)
    name: str  # NVIDIA's one-line description in the catalog
    meaning: str  # what happened, in NVIDIA's terms (trigger conditions, shortened)
    nvidia_action: str  # catalog "Resolution Bucket (Immediate Action)", verbatim
    nvidia_investigation: str  # catalog "Resolution Bucket (Investigatory Action)"
    effect: Effect
    action: Action
    message: str  # the text after the prefix in the kernel log (representative)
    attributed: bool = True  # the driver prints "pid=..., name=..., " for this Xid


_ENTRIES = (
    Xid(
        13,
        "ROBUST_CHANNEL_GR_EXCEPTION",
        "Graphics Engine Exception",
        "A general user-application fault, typically an out-of-bounds access; also an illegal "
        "instruction or register. Rarely hardware or system software.",
        "RESTART_APP",
        "WORKFLOW_XID_13 (cuda-gdb / compute-sanitizer memcheck, then file a bug)",
        Effect.KILL_PROCESS,
        Action.RESTART_APP,
        "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    ),
    Xid(
        31,
        "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT",
        "GPU memory page fault",
        "The MMU reported a fault, e.g. an illegal address access; usually an application bug, "
        "can be a driver or hardware bug.",
        "RESTART_APP",
        "WORKFLOW_XID_31 (cuda-gdb / compute-sanitizer memcheck, then file a bug)",
        Effect.KILL_PROCESS,
        Action.RESTART_APP,
        "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2b_c0000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    ),
    Xid(
        43,
        "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR",
        "GPU stopped processing",
        "A user application hit a software-induced fault and must terminate; the GPU remains "
        "healthy. NVIDIA's IGNORE refers to the GPU: the application itself is gone.",
        "IGNORE",
        "CONTACT_SUPPORT",
        Effect.KILL_PROCESS,
        Action.RESTART_APP,
        "Ch 00000008",
    ),
    Xid(
        45,
        "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL",
        "Preemptive cleanup, due to previous errors",
        "The driver tore down a GPU application: after another error (often a DBE, Xid 48/94/95), "
        "Ctrl-C, a GPU reset or SIGKILL. Usually a consequence; follow the Xid that caused it.",
        "WORKFLOW_XID_45 (solo: RESTART_FM; with other Xids: IGNORE, follow the other Xid)",
        "Solo: RESTART_FM; not solo: IGNORE (follow other Xid)",
        Effect.KILL_PROCESS,
        Action.RESTART_APP,
        "Ch 00000010",
    ),
    Xid(
        46,
        "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR",
        "GPU stopped processing",
        "The GPU stopped processing work (a timeout in the driver's watchdog).",
        "RESET_GPU",
        "CONTACT_SUPPORT",
        Effect.HANG,
        Action.RESET_GPU,
        "GPU stopped processing",
    ),
    Xid(
        48,
        "ROBUST_CHANNEL_GPU_ECC_DBE",
        "Double Bit ECC Error",
        "An uncorrectable (double-bit) ECC error in GPU memory, also reported to the "
        "application. A GPU reset or node reboot is needed to clear it.",
        "WORKFLOW_XID_48 (solo: RESET_GPU; with Xid 63/64: DRAIN_AND_RESET)",
        "WORKFLOW_XID_48 (check SRAM DBE thresholds; run field diagnostics if exceeded)",
        Effect.POISON_MEMORY,
        Action.RESET_GPU,
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at partition 6, subpartition 0.",
    ),
    Xid(
        63,
        "INFOROM_DRAM_RETIREMENT_EVENT",
        "GPU memory remapping event",
        "The GPU handled an ECC memory error by marking a row for remapping (row remapper, "
        "Ampere and newer); takes effect at the next GPU reset.",
        "IGNORE",
        "IGNORE",
        Effect.LOG_ONLY,
        Action.NONE,
        "Row Remapper: New row marked for remapping, reset gpu to activate.",
    ),
    Xid(
        64,
        "INFOROM_DRAM_RETIREMENT_FAILURE",
        "GPU memory remapping failure",
        "The row remapper could not remap a row after an ECC memory error.",
        "RESET_GPU",
        "CONTACT_SUPPORT",
        Effect.LOG_ONLY,
        Action.RESET_GPU,
        "Row Remapper: Failed to remap row. Reset the GPU and contact support if this persists.",
    ),
    Xid(
        74,
        "NVLINK_ERROR",
        "NVLINK Error",
        "A problem with an NVLink connection to another GPU or NVSwitch; may be the link or "
        "the device at the far end (a failed peer makes its neighbours report 74). A GPU reset "
        "or node reboot is needed to clear it.",
        "WORKFLOW_NVLINK_ERR (reset the GPU or reboot the node; `nvidia-smi nvlink` for details)",
        "CONTACT_SUPPORT",
        Effect.LINK_DOWN,
        Action.RESET_GPU,
        "NVLink: fatal error detected on link 0(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
    ),
    Xid(
        79,
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        "GPU has fallen off the bus",
        "The driver found the GPU inaccessible over PCI Express: often a PCIe link failure, "
        "also failing GPU hardware or driver issues.",
        "RESTART_BM",
        "CONTACT_SUPPORT",
        Effect.DEVICE_LOST,
        Action.DRAIN_NODE,
        "GPU has fallen off the bus.",
        attributed=False,
    ),
    Xid(
        92,
        "EXCESSIVE_SBE_INTERRUPTS",
        "High single-bit ECC error rate",
        "Single-bit ECC errors are corrected, but at a high rate.",
        "IGNORE",
        "CONTACT_SUPPORT",
        Effect.LOG_ONLY,
        Action.NONE,
        "High single-bit ECC error rate detected",
    ),
    Xid(
        94,
        "ROBUST_CHANNEL_CONTAINED_ERROR",
        "Contained memory error",
        "An error (e.g. an ECC memory error) contained to one application, which must restart; "
        "other applications are unaffected. Reset the GPU when convenient.",
        "RESTART_APP",
        "IGNORE (sympathetic)",
        Effect.POISON_MEMORY,
        Action.RESTART_APP,
        "Contained: SM (0x1). RST: No, D-RST: No",
    ),
    Xid(
        95,
        "ROBUST_CHANNEL_UNCONTAINED_ERROR",
        "Uncontained memory error",
        "An error (e.g. an ECC memory error) that affects multiple applications; the GPU must "
        "be reset before applications can restart.",
        "RESET_GPU",
        "IGNORE (sympathetic)",
        Effect.POISON_MEMORY,
        Action.RESET_GPU,
        "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
    ),
    Xid(
        109,
        "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR",
        "Context Switch Timeout Error",
        "A context switch on the GPU timed out.",
        "RESET_GPU",
        "CONTACT_SUPPORT",
        Effect.HANG,
        Action.RESET_GPU,
        "Context switch timeout",
    ),
    Xid(
        119,
        "GSP_RPC_TIMEOUT",
        "GSP RPC Timeout",
        "The GSP core of the GPU did not answer an RPC in time; a GPU reset or node power "
        "cycle may be needed if it persists.",
        "RESET_GPU",
        "INVESTIGATE_SW",
        Effect.HANG,
        Action.RESET_GPU,
        "Timeout after 6s of waiting for RPC response from GPU0 GSP! "
        "Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
    ),
    Xid(
        120,
        "GSP_ERROR",
        "GSP Error",
        "An error in code running on the GSP core of the GPU; a GPU reset or node power cycle "
        "may be needed if it persists.",
        "RESET_GPU",
        "INVESTIGATE_SW",
        Effect.KILL_PROCESS,
        Action.RESET_GPU,
        "GSP task exception: illegal instruction",
    ),
    Xid(
        140,
        "UNRECOVERABLE_ECC_ERROR_ESCAPE",
        "ECC Unrecovered Error",
        "Uncorrectable errors in GPU memory that interrupted the driver's ability to retire or "
        "remap the pages. Reset the GPU; contact the vendor if it persists.",
        "RESET_GPU",
        "CONTACT_SUPPORT",
        Effect.POISON_MEMORY,
        Action.RESET_GPU,
        "An uncorrectable ECC error escaped page retirement / row remapping.",
    ),
    Xid(
        154,
        "GPU_RECOVERY_ACTION_CHANGED",
        "GPU Recovery Action Changed",
        "Informational: summarises the recovery action required by other Xids (None, Drain P2P, "
        "Drain and Reset, GPU Reset Required, Node Reboot Required).",
        "XID_154 (take the recovery action the message names)",
        "N/A Informational only regarding another Xid",
        Effect.LOG_ONLY,
        Action.NONE,
        "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        attributed=False,
    ),
)

CATALOG: Mapping[int, Xid] = MappingProxyType({entry.code: entry for entry in _ENTRIES})

# Xid 154's recovery actions (NVML_GPU_RECOVERY_ACTION_*), as the driver names them.
RECOVERY_ACTIONS: Mapping[str, tuple[int, str, Action]] = MappingProxyType(
    {
        "none": (0, "None", Action.NONE),
        "gpu_reset": (1, "GPU Reset Required", Action.RESET_GPU),
        "node_reboot": (2, "Node Reboot Required", Action.DRAIN_NODE),
        "drain_p2p": (3, "Drain P2P", Action.RESET_GPU),
        "drain_and_reset": (4, "Drain and Reset", Action.RESET_GPU),
    }
)


def get(code: int) -> Xid:
    try:
        return CATALOG[int(code)]
    except KeyError:
        known = ", ".join(str(c) for c in sorted(CATALOG))
        raise KeyError(f"Xid {code} is not in the catalogue (known: {known})") from None


def kernel_log_line(
    code: int,
    *,
    bus_id: str = "0000:00:00",
    pid: int | None = None,
    name: str | None = None,
    message: str | None = None,
) -> str:
    """The line the driver prints, without dmesg's timestamp.

    ``NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s`` (krcReportXid);
    an unknown pid prints as ``'<unknown>'`` and name as ``<unknown>``. Xid 79 and
    154 come from other paths that print no pid or name.
    """
    entry = CATALOG.get(int(code))
    text = message if message is not None else (entry.message if entry else "")
    attributed = entry.attributed if entry else True
    head = f"NVRM: Xid (PCI:{bus_id.lower()}): {int(code)}, "
    if not attributed:
        return head + text
    pid_text = str(pid) if pid is not None else "'<unknown>'"
    return f"{head}pid={pid_text}, name={name if name else '<unknown>'}, {text}"


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        return None


def _nvml_dir(target: ProcessRef, params: Mapping[str, Any]) -> str:
    seen = environ(target.pid).get(nvml_sim.NVML_DIR_ENV)
    given = params.get("nvml_dir")
    if seen and given and Path(seen).resolve() != Path(str(given)).resolve():
        raise ValueError(
            f"nvml_dir {given!r} is not the folder the target reads "
            f"({nvml_sim.NVML_DIR_ENV}={seen!r} in pid {target.pid}'s environment)"
        )
    folder = seen or given
    if not folder:
        raise ValueError(
            f"pid {target.pid} has no {nvml_sim.NVML_DIR_ENV} in its environment; "
            "launch it with one or pass nvml_dir"
        )
    return str(folder)


class XidParams(FaultParams):
    code: int = Field(description="the Xid number; `aftershock faults xid` lists the catalogue")
    gpu: int | None = Field(None, ge=0, lt=MAX_WORLD,
                            description="simulated GPU index; default the target's LOCAL_RANK, "
                            "else 0")
    effect: Effect | None = Field(None, description="instead of the catalogue's effect")
    message: str | None = Field(None, max_length=1000,
                                description="instead of the kernel-log line's message")
    recovery_action: Literal["none", "gpu_reset", "node_reboot", "drain_p2p",
                             "drain_and_reset"] | None = Field(
        None, description="Xid 154 only: the recovery action it announces; default gpu_reset")
    bitflips: int | None = Field(None, ge=1, le=1_000_000,
                                 description="poison_memory: also flip this many seeded bits "
                                 "in the target's anonymous memory through /proc/PID/mem; "
                                 "default: publish only")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed for bitflips")
    nvml_dir: str | None = Field(None, description="the NVML simulation folder, when the "
                                 "target's environment has no AFTERSHOCK_NVML_DIR (it must "
                                 "match it when it has)")

    @field_validator("code")
    @classmethod
    def _known_xid(cls, value: int) -> int:
        if value not in CATALOG:
            raise ValueError(f"unknown Xid {value} (allowed: {', '.join(map(str, CATALOG))})")
        return value


def _effect(effect: Effect, target: ProcessRef, gpu: int, p: XidParams,
            undo: dict[str, Any]) -> str:
    """Apply the Xid's effect on the process (the device state changed with the event);
    what was done. A poisoning notes its flips in ``undo``."""
    if effect is Effect.KILL_PROCESS:
        return "SIGKILL" if target.signal(signal.SIGKILL) else "process already gone"
    if effect is Effect.HANG:
        return "SIGSTOP" if target.signal(signal.SIGSTOP) else "process already gone"
    if effect is Effect.DEVICE_LOST:
        return f"GPU {gpu} lost until reset"
    if effect is Effect.LINK_DOWN:
        return f"GPU {gpu} NVLinks down until reset"
    if effect is not Effect.POISON_MEMORY:
        return "published only"
    flips = p.bitflips or 0
    if flips <= 0:
        return ("published only (poison data with memory.* or "
                "aftershock.faults.memory.poison_tensor)")
    from aftershock.faults import memory

    record = memory.flip_heap_bits(target, count=flips, seed=p.seed)
    undo["flips"] = record
    return f"{len(record)} bits flipped in anonymous memory"


class GpuXid:
    params = XidParams
    acts: Acts = "outside"
    needs = frozenset({"signals", "files"})
    info = KindInfo(
        kind="gpu.xid",
        summary="Simulate an NVIDIA Xid on the target's GPU: NVML event, kernel-log line and "
        "the Xid's effect (kill, hang, lost device, link down, poisoned memory, log only).",
        caused_by="Real Xids are raised by the NVIDIA driver on GPU faults (ECC, MMU faults, "
        "PCIe link loss, NVLink errors, GSP firmware timeouts). Here: an event appended to the "
        "NVML simulation's folder (aftershock.faults.nvml_sim), the driver's `NVRM: Xid` line "
        "appended to "
        "its kern.log, then the effect on the process: SIGKILL, SIGSTOP, or device state.",
        reverted_by="hang: SIGCONT; device_lost and link_down: a simulated GPU reset (state "
        "cleared); kill_process, poison_memory and log_only: nothing to undo.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        if "code" not in params:
            raise ValueError("gpu.xid needs `code` (an Xid number)")
        entry = get(int(params["code"]))
        p = XidParams.bind(params)
        folder = _nvml_dir(target, params)
        env = environ(target.pid)
        gpu = p.gpu if p.gpu is not None else int(env.get("LOCAL_RANK", 0))
        effect = entry.effect if p.effect is None else p.effect
        message = p.message
        action = entry.action
        if entry.code == 154 and message is None:
            value, text, action = RECOVERY_ACTIONS[p.recovery_action or "gpu_reset"]
            message = f"GPU recovery action changed from 0x0 (None) to 0x{value:x} ({text})"

        # Journal first: the device state must be reset even if the harness dies right after.
        undo: dict[str, Any] = {"effect": str(effect), "nvml_dir": folder, "gpu": gpu}
        entry_id: str | None = None
        if effect is Effect.HANG:
            undo["target"] = target.to_json()
            entry_id = journal.intend(self.info.kind, undo)
        elif effect in (Effect.DEVICE_LOST, Effect.LINK_DOWN):
            entry_id = journal.intend(self.info.kind, undo)

        # The event and the log line come before the process effect: a real driver logs,
        # then the process sees the failure.
        # Device state changes with the event, atomically (see publish_xid).
        line = nvml_sim.publish_xid(
            folder,
            gpu,
            entry.code,
            target.pid if entry.attributed else None,
            name=_comm(target.pid),
            message=None if message is None else str(message),
            lose_device=effect is Effect.DEVICE_LOST,
            links_down=effect is Effect.LINK_DOWN,
        )
        done = _effect(effect, target, gpu, p, undo)
        detail = f"Xid {entry.code} on GPU {gpu} of pid {target.pid}: {done}; {line}"
        return Applied(self.info.kind, entry_id, {**undo, "action": str(action)}, detail)

    def revert(self, undo: Mapping[str, Any]) -> None:
        effect = Effect(str(undo.get("effect", Effect.LOG_ONLY)))
        if effect is Effect.HANG and "target" in undo:
            ProcessRef.from_json(dict(undo["target"])).signal(signal.SIGCONT)
        elif effect in (Effect.DEVICE_LOST, Effect.LINK_DOWN):
            nvml_sim.reset_device(str(undo["nvml_dir"]), int(undo["gpu"]))

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        effect = Effect(str(undo.get("effect", Effect.LOG_ONLY)))
        if effect is Effect.HANG and "target" in undo:
            context.process(undo["target"])
        elif effect in (Effect.DEVICE_LOST, Effect.LINK_DOWN):
            context.path(undo.get("nvml_dir"))
            gpu = undo.get("gpu")
            if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
                raise UndoRefused(f"gpu {gpu!r} is not a GPU index")


GPU_XID = register(GpuXid())
