"""The checkpoint's collectives on a group that has no CPU collectives (NCCL's).

Found on the first GPU run (docs/gpu.md): every `restart` job with checkpoints died at its
first save, "No backend type associated with device type cpu", because the commit's
agreement flag was a CPU tensor reduced over an NCCL group. A group built with the backend
string ``cuda:gloo`` has the same gap on a CPU machine (Gloo serves only CUDA tensors in
it), so the rule that places the flag is checked here for real; the whole save and load
over NCCL runs where CUDA is (the second test, and ci/gpu-check's trainer row).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import ROOT

SCRIPT = textwrap.dedent("""\
    import os, socket, sys, tempfile
    from pathlib import Path
    import torch, torch.distributed as dist
    from aftershock.reference_impl import checkpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = sys.argv[1]
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    group = dist.new_group([0])
    print("device", checkpoint.flag_device(group).type, flush=True)
    if sys.argv[2] == "save":
        root = Path(tempfile.mkdtemp())
        device = "cuda" if backend == "nccl" else "cpu"
        state = {"w": torch.arange(4.0, device=device)}
        assert checkpoint.save(root, 5, state, {"m": 1}, group) is not None
        step, _, loaded = checkpoint.load_latest(root, {"m": 1}, group)
        assert step == 5 and torch.equal(loaded["w"].cpu(), torch.arange(4.0))
        print("saved and loaded step", step, flush=True)
    dist.destroy_process_group()
""")


def _run(backend: str, what: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, backend, what], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_flag_goes_where_the_group_reduces() -> None:
    assert "device cpu" in _run("gloo", "device")
    assert "device cuda" in _run("cuda:gloo", "device")  # no CPU collectives, like NCCL


def test_a_checkpoint_saves_and_loads_over_gloo_on_the_cpu() -> None:
    assert "saved and loaded step 5" in _run("gloo", "save")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ci/gpu-check)")
def test_a_checkpoint_saves_and_loads_over_nccl() -> None:
    assert "saved and loaded step 5" in _run("nccl", "save")
