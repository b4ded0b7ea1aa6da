"""The sync's broadcast alone: two forked processes, a fresh Gloo group per round, four
broadcasts of the flat state's size (3.2 MB) each (docs/benchmarks.md, "Where a `hot_spare`
recovery goes with the standby"). ``python broadcast_alone.py [FLOATS]`` prints each rank's
milliseconds per call, a line per group."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run(rank: int, port: int, numel: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    for round_ in range(3):
        # Any: torch's stubs do not declare the group's own collectives, which it has.
        group: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"g{round_}/", store), rank, 2,
                                      timedelta(seconds=30))
        flat = torch.randn(numel) if rank == 0 else torch.empty(numel)
        took = []
        for _ in range(4):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            start = time.perf_counter()
            group.broadcast([flat], opts).wait()
            took.append((time.perf_counter() - start) * 1000)
        print(rank, round_, " ".join(f"{ms:.2f}" for ms in took), flush=True)
        del group


def main() -> None:
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 800_000
    port = 29876
    pid = os.fork()
    if pid == 0:
        run(1, port, numel)
        os._exit(0)
    run(0, port, numel)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
