"""A command's fault-free twin is keyed on the content of what the command runs.

The twin of a `command:` scenario is cached; if its key ignored the script the command runs,
editing that script would silently reuse a twin of the old code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, cli

JOB = ROOT / "tests" / "fixtures" / "resume_job.py"

SCENARIO = f"""\
name: resume-job
system:
  command: [{sys.executable}, job.py]
  env: {{JOB_CKPT: "${{run_dir}}/ckpt.json", JOB_STEPS: "30"}}
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+)', event: step}}
    - {{pattern: 'rank (?P<rank>\\d+) params digest=(?P<digest>[0-9a-f]+)', event: params}}
  timeout: 1m
faults:
  - kind: process.kill
    target: {{rank: 0}}
    at: {{step: 10}}
expect:
  completes: true
  params_match: fault_free
"""

# An edit with a bug on the path of a run that is never interrupted: its result now depends
# on whether it was killed, which is what params_match is for. The faulted run resumed, so it
# ends as the old code did; only a twin of the *new* code shows the difference.
BUG = """\
if start == 0:  # (the edit's bug: a run that was never interrupted ends differently)
    state = hashlib.sha256(state.encode()).hexdigest()
print(f"rank 0 params"""


def run(folder: Path, cache: Path, name: str) -> dict:
    out = folder / f"{name}.json"
    proc = cli("run", str(folder / "job.yaml"), "--json", str(out), "--run-dir",
               str(folder / name), cache=cache, timeout=100)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    return {c["name"]: c for c in record["checks"]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_editing_the_script_reruns_the_fault_free_twin(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(SCENARIO)
    (tmp_path / "job.py").write_text(JOB.read_text())
    cache = tmp_path / "cache"
    first = run(tmp_path, cache, "v1")
    assert first["params_match"]["passed"], first["params_match"]
    assert first["faults_injected"]["passed"]

    edited = JOB.read_text().replace('print(f"rank 0 params', BUG)
    assert edited != JOB.read_text()
    (tmp_path / "job.py").write_text(edited)
    second = run(tmp_path, cache, "v2")
    assert second["faults_injected"]["passed"]
    assert not second["params_match"]["passed"], second["params_match"]
