"""The reference trainer names one generation for the whole world, even when its ranks'
launchers count restarts differently.

torchrun's ``TORCHELASTIC_RESTART_COUNT`` is per agent: across nodes, a node whose container
was restarted counts from 0 again while the surviving node's agent says 1 (docs/nodes.md).
Two real ranks (a Gloo group over env://, no torchrun) are started here with the counts two
such nodes give them; both must say the same generation in their ``hello``, the newest one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import ROOT, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ranks_whose_launchers_count_restarts_differently_agree_on_the_newest(
        tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    port = _free_port()
    procs = []
    for rank, restarts in ((0, 1), (1, 0)):  # node 0's agent restarted once; node 1 is new
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RESTART_COUNT": str(restarts), "AFTERSHOCK_EVENTS": str(events),
               "AFTERSHOCK_OUTPUT_DIR": str(tmp_path / "output"), "PYTHONPATH": str(ROOT)}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "aftershock.reference_impl.trainer",
                    "--replicas=2",
                    "--shards=1",
                    "--steps=2",
                    f"--checkpoint-dir={tmp_path / 'ckpt'}",
                    "--device=cpu",
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    hellos = {e["rank"]: e["generation"] for e in read_events(events, "hello")}
    assert hellos == {0: 1, 1: 1}, hellos
    steps = {(e["rank"], e.get("generation")) for e in read_events(events, "step")}
    assert steps == {(0, 1), (1, 1)}, steps
