"""``python -m bench.allreduce_sizes``: what a tiny Gloo sum over the world costs, by element
count and by method.

The trainer's vote is a tiny sum over the whole world every step. This runs one under torchrun
(``--ranks`` processes, Gloo on CPU, one thread each, as the bench's jobs run) for each
element count and method, interleaved ``--repeat`` times, and prints per call the wall time
and the CPU the ranks' threads spent, by kind (the bench's ``thread_cpu``: the caller's main
thread, Gloo's transport loop, Gloo's work threads), rank 0's and all ranks' together. The
methods: ``all_reduce`` (Gloo's, through ``torch.distributed.all_reduce``, as the ``restart``
loop and the model's tensor-parallel layers call it there), ``group_all_reduce`` (the same, through
the group's own ``allreduce`` method, as the ``hot_spare`` and ``elastic`` loops call their
groups), ``star`` (``aftershock.reference_impl.model.sum_through_root``, what the vote uses:
through rank 0
over point-to-point calls, here the group's non-blocking ones, as the ``hot_spare`` loop's vote),
``star_blocking`` (the same over the blocking ``dist.send``/``dist.recv``, as the ``restart``
loop's vote used to), ``socket_star`` (the same over the star's own TCP connections,
``aftershock.reference_impl._star``, what both loops' votes use now); and, for the trainer's
straggler
figures, ``all_gather`` (every rank gets every rank's values) against ``to_root`` (what the
trainer does now: the others send, rank 0 receives; the others do not wait). Every call's
result is checked against the sum computed here (the gathers' parts are summed to check
them; ``to_root`` on rank 0 only), so a fast wrong collective cannot look good.

    python -m bench.allreduce_sizes [--ranks 4] [--sizes 1,2,3,8,64] [--calls 2000]
                                    [--methods all_reduce,group_all_reduce,star,
                                               star_blocking,socket_star,all_gather,
                                               to_root]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent
METHODS = ("all_reduce", "group_all_reduce", "star", "star_blocking", "socket_star", "all_gather",
           "to_root")


def _rank(sizes: list[int], methods: list[str], calls: int, out: str) -> int:
    import torch
    import torch.distributed as dist

    from aftershock.reference_impl._star import Star
    from aftershock.reference_impl.model import sum_through_root
    from bench.run import thread_cpu

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)))

    def star(t: Any) -> None:
        sum_through_root(t, rank, world, send=lambda x, peer: group.send([x], peer, 0),
                         recv=lambda x, peer: group.recv([x], peer, 0))

    def star_blocking(t: Any) -> None:
        def send(x: Any, peer: int) -> None:
            dist.send(x, group=group, group_dst=peer)

        def recv(x: Any, peer: int) -> None:
            dist.recv(x, group=group, group_src=peer)

        sum_through_root(t, rank, world, send=send, recv=recv)

    lazy: list[Star] = []

    def socket_star(t: Any) -> None:
        if not lazy:  # built at its first call, inside the warm-up, by every rank at once
            lazy.append(Star.connect(dist.distributed_c10d._get_default_store(), rank, world,
                                     60.0, key="bench/star"))
        sum_through_root(t, rank, world, send=lazy[0].send, recv=lazy[0].recv)

    def all_gather(t: Any) -> None:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        t.copy_(torch.stack(parts).sum(0))  # summed only to check what arrived

    def to_root(t: Any) -> bool:
        if rank != 0:
            group.send([t], 0, 1).wait()
            return False  # nothing arrives here to check
        parts = [torch.empty_like(t) for _ in range(1, world)]
        for work in [group.recv([part], peer, 1) for peer, part in enumerate(parts, start=1)]:
            work.wait()
        t.add_(torch.stack(parts).sum(0))
        return True

    run = {"all_reduce": lambda t: dist.all_reduce(t, group=group),
           "group_all_reduce": lambda t: group.allreduce([t]).wait(), "star": star,
           "star_blocking": star_blocking, "socket_star": socket_star,
           "all_gather": all_gather, "to_root": to_root}
    rows = []
    for size in sizes:
        for method in methods:
            mine = torch.arange(size, dtype=torch.float64) + rank
            want = torch.arange(size, dtype=torch.float64) * world + world * (world - 1) / 2
            call = run[method]
            for _ in range(50):  # warm: connections made, buffers allocated
                call(mine.clone())
            dist.barrier(group=group)
            before, start = thread_cpu(os.getpid()), time.monotonic()
            wrong = 0
            for _ in range(calls):
                t = mine.clone()
                if call(t) is not False:
                    wrong += int(not torch.equal(t, want))
            wall = time.monotonic() - start
            after = thread_cpu(os.getpid())
            cpu = {k: (after[k] - before.get(k, 0.0)) / calls * 1e6 for k in after}
            every: list[Any] = [None] * world
            dist.all_gather_object(every, cpu, group=group)
            total = {k: sum(c.get(k, 0.0) for c in every) for k in set().union(*every)}
            rows.append({"size": size, "method": method, "wall_us": wall / calls * 1e6,
                         "cpu_us": cpu, "all_cpu_us": total, "wrong": wrong})
            dist.barrier(group=group)
    wrong_anywhere: list[Any] = [None] * world
    dist.all_gather_object(wrong_anywhere, [r["wrong"] for r in rows], group=group)
    if rank == 0:
        for i, row in enumerate(rows):
            row["wrong"] = sum(w[i] for w in wrong_anywhere)
        Path(out).write_text(json.dumps(rows))
    for built in lazy:
        built.close()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.allreduce_sizes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="1,2,3,8,64",
                        help="element counts, comma-separated (float64)")
    parser.add_argument("--methods", default="all_reduce,star",
                        help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per size and run")
    parser.add_argument("--repeat", type=int, default=3, help="runs, each over every size")
    parser.add_argument("--rank-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --methods {','.join(unknown)}: use {', '.join(METHODS)}")
    if args.rank_worker:
        return _rank(sizes, methods, int(args.rank_worker[0]), args.rank_worker[1])
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            # Interleaved: drift hits both ends.
            order = sizes if i % 2 == 0 else sizes[::-1]
            how = methods if i % 2 == 0 else methods[::-1]
            out = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.ranks}", "-m", "bench.allreduce_sizes",
                   f"--sizes={','.join(map(str, order))}", f"--methods={','.join(how)}",
                   "--rank-worker", str(args.calls), str(out)]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0 or not out.exists():
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            runs.append(json.loads(out.read_text()))
    load = os.getloadavg()[0]
    print(f"{args.ranks} ranks, Gloo on CPU, {args.calls} calls per size, method and run, "
          f"median of {args.repeat} runs (load {load:.1f} at the end); CPU per call, "
          "rank 0's threads and all ranks' together")
    print("| elements | method | wall µs/call | main µs | gloo transport µs | gloo work µs "
          "| all ranks' CPU µs | wrong |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    for size in sizes:
        for method in methods:
            rows = [r for run in runs for r in run
                    if r["size"] == size and r["method"] == method]

            def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return median(r["cpu_us"].get(key, 0.0) for r in rows)

            wrong = sum(r["wrong"] for r in rows)
            failed += wrong
            every = median(sum(r["all_cpu_us"].values()) for r in rows)
            print(f"| {size} | {method} | {median(r['wall_us'] for r in rows):.0f} "
                  f"| {med('main'):.0f} | {med('gloo transport'):.0f} "
                  f"| {med('gloo work'):.0f} | {every:.0f} | {wrong} |")
    if failed:
        print(f"{failed} results differ from the sum", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
