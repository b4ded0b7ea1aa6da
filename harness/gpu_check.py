"""The GPU check (`ci/gpu-check`): the GPU paths of Aftershock, on a real CUDA machine.

On a machine with CUDA it checks, and prints a short table of:
1. torch sees the GPU (name, memory, capability);
2. real NVML through pynvml: the device, and an Xid event set that times out
   when no Xid happens (what the trainer's watcher relies on);
3. `poison_tensor` on a CUDA tensor (top exponent bit: 1.0 becomes inf);
4. the reference trainer on the GPU with a NaN put into a CUDA gradient at a
   step and phase by the probe: the run must detect it (`failure_detected`), complete,
   and end with the same parameters, bit for bit, as a fault-free run on the GPU
   (`params_match: fault_free`).
Without CUDA it says so and exits 0. It never resets the GPU or changes clocks.
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Row:
    check: str
    ok: bool
    detail: str
    seconds: float


def _timed(name: str, fn) -> Row:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        detail = fn()
        ok = True
    except Exception as exc:
        detail, ok = f"{type(exc).__name__}: {exc}", False
    return Row(name, ok, str(detail)[:200], time.monotonic() - start)


def _torch() -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.0f} GiB, "
            f"sm_{props.major}{props.minor}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


def _nvml() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        events = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError,
                                            events)
            try:
                pynvml.nvmlEventSetWait_v2(events, 100)
                waited = "an Xid event arrived (unexpected on a healthy GPU)"
            except pynvml.NVMLError_Timeout:
                waited = "no Xid within 100 ms (NVMLError_Timeout, as expected)"
        finally:
            pynvml.nvmlEventSetFree(events)
        return f"{name}: Xid events registered; {waited}"
    finally:
        pynvml.nvmlShutdown()


def _poison() -> str:
    import torch

    from aftershock.faults.memory import poison_tensor

    tensor = torch.ones(1024, device="cuda")
    poison_tensor(tensor, "bitflip", index=0)
    value = float(tensor[0].item())
    if value != float("inf") or float(tensor[1:].sum().item()) != 1023.0:
        raise AssertionError(f"expected inf at element 0 and ones elsewhere, got {value}")
    return "bit 30 of element 0 flipped on the GPU: 1.0 -> inf, the rest untouched"


SCENARIO = textwrap.dedent("""\
    name: gpu-nan-gradient
    system:
      reference: trainer
      world: {replicas: 1, shards: 1}
      backend: nccl
      recovery: restart
      steps: 40
      checkpoint_every: 10
      max_restarts: 1
    faults:
      - kind: memory.nan
        target: {rank: 0}
        at: {step: 10, phase: backward}
        tensor: "grad:*"
    expect:
      completes: true
      time_to_detect: {max: 5s}
      params_match: fault_free
""")


def _trainer() -> str:
    from aftershock.harness.run.runner import run_scenario
    from aftershock.harness.scenario.load import parse_scenario
    from aftershock.harness.scenario.spec import LoadedScenario

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpu.yaml"
        path.write_text(SCENARIO)
        loaded = LoadedScenario(parse_scenario(SCENARIO, str(path)), path, SCENARIO)
        result = run_scenario(loaded, run_dir=Path(folder) / "run")
    if not result.passed:
        failed = "; ".join(f"{c.name}: {c.message}" for c in result.failed_checks())
        raise AssertionError(failed)
    return (f"NaN in a CUDA gradient at step 10 detected in "
            f"{result.metrics['time_to_detect_s']:.3f}s; run completed with the fault-free "
            f"run's parameters, bit for bit")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; skipped (exit 0)")
        return 0
    rows = [
        _timed("torch sees the GPU", _torch),
        _timed("real NVML (pynvml)", _nvml),
        _timed("poison a CUDA tensor", _poison),
        _timed("trainer detects a CUDA NaN", _trainer),
    ]
    width = max(len(r.check) for r in rows)
    print(f"gpu-check {time.strftime('%Y-%m-%d %H:%M')}")
    for r in rows:
        print(f"{r.check.ljust(width)}  {'PASS' if r.ok else 'FAIL'}  {r.seconds:6.1f}s  "
              f"{r.detail}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
