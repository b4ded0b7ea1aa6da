"""Can two NCCL ranks share one GPU? What ``python -m bench --gpu`` relies on, measured.

Launched by ``ci/gpu-bench`` as two ranks that both take ``cuda:0``::

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m bench.nccl_probe

Each rank sums a one-element tensor with NCCL and prints one line: the sum (2.0 if NCCL ran
the two ranks on one device) or NCCL's error. NCCL 2.5 and later refuse it at the
communicator's creation ("Duplicate GPU detected"), which is why the bench's rows that need a
second rank (a warm spare, a second replica) do not run on a one-GPU machine.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)  # both ranks on the one GPU
    dist.init_process_group("nccl", timeout=timedelta(seconds=30))
    tensor = torch.ones(1, device="cuda")
    try:
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        said = f"sum {float(tensor.item())} (two NCCL ranks ran on one GPU)"
    except Exception as exc:  # NCCL's refusal arrives as a DistBackendError
        lines = [line for line in str(exc).splitlines() if "Duplicate" in line]
        said = f"refused: {(lines or str(exc).splitlines() or [type(exc).__name__])[0]}"
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    print(f"rank {rank}, NCCL {nccl}: {said}", flush=True)
    os._exit(0)  # a refused communicator can hang in its destructor


if __name__ == "__main__":
    raise SystemExit(main())
