"""A slot whose first process starts after a short job has already ended.

On a busy 2-core host one torchrun worker can take seconds longer than the others to import
torch; a 20-step job is over by then. The controller hosts the store: if it leaves as soon as
every process it knows has seen the end, the late slot finds no store and TCPStore waits out
its connect timeout (120 s, then retries after a random delay), so the job hangs for minutes
(a clean-clone `make test` here hung in test_hot_spare.py this way)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _helpers import ROOT, marked

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

WAIT_S = 90.0  # the hang it guards against lasts 120 s and more


def test_a_spare_slot_that_starts_after_the_end_finds_the_job_over(tmp_path: Path) -> None:
    late = tmp_path / "late"
    late.mkdir()
    # Test scaffolding, not a broken trainer: slot 2 (the spare) starts only once both ranks
    # reported their final parameters, however long the others take on a loaded machine.
    (late / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == '2':\n"
        "    path, end = os.environ['AFTERSHOCK_EVENTS'], time.monotonic() + 120\n"
        "    while time.monotonic() < end:\n"
        "        try:\n"
        "            if open(path).read().count('\"event\":\"params\"') >= 2:\n"
        "                break\n"
        "        except OSError:\n"
        "            pass\n"
        "        time.sleep(0.05)\n")
    events = tmp_path / "events.jsonl"
    mark = f"AFTERSHOCK_TEST_MARK={uuid.uuid4().hex}"  # finds every process of the job
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(late), str(ROOT)]),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "AFTERSHOCK_EVENTS": str(events),
           **dict([mark.split("=", 1)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=3", "--max-restarts=0", "--monitor-interval=0.1",
           "-m", "aftershock.reference_impl.trainer", "--recovery=hot_spare", "--spares=1",
           "--replicas=2", "--shards=1", "--steps=20", "--checkpoint-every=0",
           f"--checkpoint-dir={tmp_path / 'ck'}"]
    start = time.monotonic()
    log = tmp_path / "job.log"
    with log.open("w") as sink, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink,
                                                 stderr=subprocess.STDOUT) as proc:
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            for pid in marked(mark):  # torchrun's workers sit in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the job hung past {WAIT_S:.0f} s waiting for its late slot:\n"
                        + log.read_text()[-3000:])
    took = time.monotonic() - start
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    steps = [e for e in seen if e["event"] == "step" and e.get("step") == 20]
    assert len(steps) == 2, "both ranks trained to the end"
    # The spare did start (late) and left at once: it said hello after the last step.
    spare = [e for e in seen if e["event"] == "hello" and e.get("role") == "spare"]
    assert spare, "the late spare never got going"
    assert spare[0]["t"] > max(e["t"] for e in steps)
    assert took < WAIT_S, took
