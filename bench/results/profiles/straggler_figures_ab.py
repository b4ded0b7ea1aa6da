"""A/B: rank 0 reading the straggler figures right after its vote (``OLD=``, a checkout of
the code before) against at its next vote (``NEW=``), in ``trainer_no_ckpt``-shaped jobs
(4 ranks as 2 x 2, ``restart`` loop, no checkpoints), one job of each in turn.

    ROUNDS=10 OLD=/tmp/old NEW=/tmp/new OUT=ab.json python straggler_figures_ab.py
    PHASES=1 ROUNDS=6 ... (also keeps every rank's phases, ``AFTERSHOCK_PHASES``)
    python straggler_figures_ab.py --show ab.json ...  (time per step, CPU, digests, phases)

Rank 0's time per step over steps 101 to the last, from its step events; the job's CPU from
the children's rusage; every rank's final parameter digest. docs/benchmarks.md, "The
straggler figures read at the next vote".
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TREES = {"old": Path(os.environ.get("OLD", "/tmp/old")),
         "new": Path(os.environ.get("NEW", "/tmp/new"))}
MODEL = ["--replicas=2", "--shards=2", "--d-model=128", "--hidden=1024", "--blocks=2",
         "--batch-size=32"]
STEPS = int(os.environ.get("STEPS", "1100"))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
FIRST = 100  # the first timed step: start-up and the first comparison's baseline are behind


def job(kind: str) -> dict[str, Any]:
    repo = TREES[kind]
    d = Path(tempfile.mkdtemp(prefix=f"straggler-ab-{kind}-"))
    args = [*MODEL, f"--steps={STEPS}", "--recovery=restart", "--checkpoint-every=0",
            f"--checkpoint-dir={d / 'ck'}"]
    env = {**os.environ, "AFTERSHOCK_EVENTS": str(d / "events.jsonl"),
           "AFTERSHOCK_OUTPUT_DIR": str(d / "out"), "PYTHONPATH": str(repo),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if os.environ.get("PHASES"):
        env["AFTERSHOCK_PHASES"] = f"{FIRST}:{STEPS}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=4", "--max-restarts=0", "--monitor-interval=0.1",
                    "-m", "reference_impl.trainer", *args],
                   cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    events = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]
    t = {e["step"]: e["t"] for e in events if e.get("event") == "step" and e.get("rank") == 0}
    result: dict[str, Any] = {
        "kind": kind,
        "ms_per_step": (t[STEPS] - t[FIRST]) / (STEPS - FIRST) * 1e3,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "digests": sorted({json.dumps(e.get("digest")) for e in events
                           if e.get("event") == "params"}),
    }
    phases = {e["rank"]: e["phases"] for e in events if e.get("event") == "phases"}
    if phases:
        result["phases"] = phases
    return result


def show(files: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from bench.stats import median_interval

    for f in files:
        rounds = json.loads(Path(f).read_text())
        old = [r for r in rounds if r["kind"] == "old"]
        new = [r for r in rounds if r["kind"] == "new"]
        for key in ("ms_per_step", "cpu_s"):
            pairs = sorted(100 * (n[key] / o[key] - 1) for o, n in zip(old, new, strict=True))
            lo, hi, cover = median_interval(pairs)
            print(f"{f} {key}: old {statistics.median(o[key] for o in old):.2f}, "
                  f"new {statistics.median(n[key] for n in new):.2f}, pairs' median "
                  f"{statistics.median(pairs):+.1f}% ({lo:.1f} to {hi:.1f}, {100 * cover:.0f}%)")
        distinct = len({tuple(r["digests"]) for r in rounds})
        print(f"  parameter digests: {distinct} distinct across {len(rounds)} jobs")
        for kind, chosen in (("old", old), ("new", new)):
            if "phases" not in chosen[0]:
                continue
            for name in ("straggler figures", "vote", "average", "forward"):
                wall = statistics.median(r["phases"]["0"].get(name, {}).get("wall_ns", 0)
                                         for r in chosen)
                cpu = statistics.median(sum(p.get(name, {}).get("cpu_ns", 0)
                                            for p in r["phases"].values()) for r in chosen)
                print(f"  {kind} {name}: rank 0 wall {wall / (STEPS - FIRST) / 1e6:.3f} ms/step,"
                      f" all ranks' CPU {cpu / (STEPS - FIRST) / 1e6:.3f} ms/step")


def main() -> None:
    if sys.argv[1:2] == ["--show"]:
        show(sys.argv[2:])
        return
    out = []
    for i in range(ROUNDS):
        for kind in ("old", "new") if i % 2 == 0 else ("new", "old"):
            r = job(kind)
            out.append(r)
            print(f"{kind} round {i}: {r['ms_per_step']:.2f} ms/step, cpu {r['cpu_s']:.1f} s",
                  flush=True)
    Path(os.environ.get("OUT", "straggler_figures_ab.json")).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
