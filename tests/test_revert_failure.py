"""A fault whose undo fails at the end of a run is not counted as undone: the run says
"could not revert" (exit 3), its timeline has no `fault_healed` for it, and the heal journal
keeps the entry, so `aftershock heal` reports it rather than finding nothing to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

# The job saves a file, waits until the fault has corrupted it, then saves it again (a new
# file renamed over the corrupted one): the fault's restore must not overwrite the new save.
JOB = """\
import os, sys, time
path = "step_1.pt"
original = b"the checkpoint as it was" * 100
with open(path, "wb") as f:
    f.write(original)
print("rank 0 step 1 gen 0 t=%f" % time.time(), flush=True)
deadline = time.monotonic() + 30
while open(path, "rb").read() == original and time.monotonic() < deadline:
    time.sleep(0.05)
with open(path + ".tmp", "wb") as f:
    f.write(b"saved again by the system")
os.rename(path + ".tmp", path)
print("rank 0 step 2 gen 0 t=%f" % time.time(), flush=True)
time.sleep(1)
"""

SCENARIO = """\
name: revert_fails
system:
  command: [{python}, {job}]
  probes:
    - event: step
      pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) gen (?P<generation>\\d+) t=(?P<time>\\S+)'
faults:
  - {{kind: storage.corrupt, path: step_1.pt, restore: true, at: {{time: 0.5s}}}}
"""


def test_a_failed_undo_stays_in_the_journal_and_is_not_called_healed(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(python=sys.executable, job=job))
    state, runs = tmp_path / "state", tmp_path / "runs"
    env = {**os.environ, "AFTERSHOCK_STATE_DIR": str(state)}
    done = subprocess.run(
        [sys.executable, "-m", "aftershock", "run", str(scenario), "--run-dir", str(runs),
         "--plain"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=100)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "could not revert" in done.stdout + done.stderr
    (events_file,) = runs.rglob("events.jsonl")
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert any(e["event"] == "fault_injected" for e in events)
    assert not any(e["event"] == "fault_healed" for e in events), "a failed undo called healed"
    assert (runs.glob("**/work/step_1.pt").__next__().read_bytes()
            == b"saved again by the system")
    # The entry is still pending: heal finds it, refuses it again and keeps the backup.
    healed = subprocess.run([sys.executable, "-m", "aftershock", "heal"], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=60)
    assert healed.returncode != 0, healed.stdout + healed.stderr
    assert "storage.corrupt" in healed.stdout + healed.stderr
