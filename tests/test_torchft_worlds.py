"""examples/torchft_ddp, unmodified and read through the ``torchft`` preset only, as
docs/own-job.md says (issue 46): a replica group frozen until the other finished every step
trains those steps again alone, which ``single_history`` fails; a group killed and healed
from its peer is one history, and ``lost_steps`` counts the steps truly done twice.

The truth each verdict is held to is read here from torchft's own log files, apart from the
harness: the steps each replica group committed, and in which quorum."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from _helpers import ROOT, cli

EXAMPLE = ROOT / "examples" / "torchft_ddp"

pytestmark = [
    pytest.mark.slow, pytest.mark.scenarios, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                       reason="torchft is not installed (`make bench` installs it)"),
]

SCENARIO = """\
name: {name}
system:
  command: [./run.sh, "{steps}"]
  in_process_probe: false
  preset: torchft
  env: {{LOG_DIR: '${{run_dir}}/torchrun', LIGHTHOUSE_PORT: "{port}"}}
  inputs: [train.py]
  logs: ['${{run_dir}}/torchrun/**/*.log']
  timeout: 5m
faults:
  - kind: {kind}
    target: {{env: {{REPLICA_GROUP_ID: '1'}}, role: worker}}
    at: {{step: 10}}
{more}expect:
  completes: true
  single_history: true
"""

_COMMIT = re.compile(r"\[train_ddp_(\d+):[0-9a-f-]+/0 - step (\d+)\] should_commit=True")
_QUORUM = re.compile(r"\[train_ddp_(\d+):[0-9a-f-]+/0 - step \d+\] reconfiguring for "
                     r"quorum_id=(\d+)")


def run(tmp_path: Path, name: str, steps: int, kind: str, more: str, port: int
        ) -> tuple[dict[str, object], Path]:
    for script in ("run.sh", "train.py"):
        shutil.copy2(EXAMPLE / script, tmp_path / script)
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(SCENARIO.format(name=name, steps=steps, kind=kind, more=more,
                                        port=port))
    out = tmp_path / "out.json"
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(tmp_path / "run"),
               "--plain", cache=tmp_path / "cache", timeout=560)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    return record, Path(record["run_dir"])


def truth(run_dir: Path) -> dict[int, set[int]]:
    """Step -> the quorums that committed it, from torchft's own lines in every process's
    files: each process is in the quorum it last reconfigured to."""
    committed: dict[int, set[int]] = defaultdict(set)
    for path in sorted((run_dir / "torchrun").rglob("stderr.log")):
        quorum = None
        for line in path.read_text(errors="replace").splitlines():
            if found := _QUORUM.search(line):
                quorum = int(found.group(2))
            elif (found := _COMMIT.search(line)) and quorum is not None:
                committed[int(found.group(2))].add(quorum)
    return committed


def checks(record: dict[str, object]) -> dict[str, dict[str, object]]:
    listed = record["checks"]
    assert isinstance(listed, list)
    return {c["name"]: c for c in listed}


def test_a_group_frozen_until_the_other_finished_fails_single_history(tmp_path: Path) -> None:
    record, run_dir = run(tmp_path, "torchft-freeze-long", 40, "process.freeze",
                          "    duration: 45s\n", 29521)
    committed = truth(run_dir)
    # Truly a split: steps after 10 committed in two quorums (group 0 alone, then group 1).
    split = [s for s, quorums in committed.items() if s > 10 and len(quorums) > 1]
    assert split, dict(committed)
    verdict = checks(record)["single_history"]
    assert verdict["passed"] is False, verdict
    assert "split brain" in str(verdict["message"]), verdict
    assert record["passed"] is False


def test_a_group_killed_and_healed_passes_single_history(tmp_path: Path) -> None:
    record, run_dir = run(tmp_path, "torchft-kill-heal", 300, "process.kill", "", 29531)
    committed = truth(run_dir)
    assert committed, "no torchft commit line was found in the run's files"
    verdict = checks(record)["single_history"]
    assert verdict["passed"] is True, (verdict, record["metrics"])
    # Steps truly done twice: committed in more than one quorum.
    redone = sum(len(quorums) - 1 for quorums in committed.values())
    metrics = record["metrics"]
    assert isinstance(metrics, dict)
    assert metrics["lost_steps"] == redone, (metrics, dict(committed))
