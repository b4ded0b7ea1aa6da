"""The defects of docs/findings.md, each reproduced by its scenario on the unmodified public
job and gone once the job is fixed.

examples/ddp_tutorial/ holds PyTorch's DDP tutorial job (pytorch/examples,
`distributed/ddp-tutorial-series/multigpu_torchrun.py`), unchanged but for a recorded CPU port
(`cpu_port.patch`); its scenarios under `findings/` must fail, each for its own reason. The
fixes live here (tests/fixtures/ddp_tutorial/*.patch), applied to a copy of the job: the same
scenario must then pass. The port check is fast; the runs are `scenarios` tests (their own
CI step, `make test-scenarios`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli, read_events

JOB = ROOT / "examples" / "ddp_tutorial"
FIXES = ROOT / "tests" / "fixtures" / "ddp_tutorial"
#: Upstream's git blob ids at pytorch/examples 77f55b912142e11fcfdf5b530231fb9c52f181e8.
UPSTREAM_BLOBS = {"multigpu_torchrun.py": "32d6254d2dc43b104655bb7aec41a00b492e8dc4",
                  "datautils.py": "22c364eaa0d36bdcb5726f9f23972fe6b5d50615"}
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")


def apply_patch(text: str, patch: str, *, reverse: bool = False) -> str:
    """``text`` with a one-file unified diff applied (or undone), every context and removed
    line checked: a patch that no longer fits the file fails loudly instead of guessing."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    old, new = ("+", "-") if reverse else ("-", "+")
    for line in patch.splitlines(keepends=True)[2:]:  # past the ---/+++ header
        hunk = _HUNK.match(line)
        if hunk:
            start = int(hunk.group(2 if reverse else 1)) - 1
            out += lines[pos:start]
            pos = start
        elif line[:1] in (" ", old):
            assert lines[pos] == line[1:], f"patch does not fit at line {pos + 1}: {line!r}"
            if line[0] == " ":
                out.append(lines[pos])
            pos += 1
        elif line[:1] == new:
            out.append(line[1:])
    return "".join(out + lines[pos:])


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_job_is_upstreams_but_for_the_recorded_cpu_port() -> None:
    port = (JOB / "multigpu_torchrun.py").read_text()
    upstream = apply_patch(port, (JOB / "cpu_port.patch").read_text(), reverse=True)
    assert git_blob_id(upstream.encode()) == UPSTREAM_BLOBS["multigpu_torchrun.py"]
    datautils = (JOB / "datautils.py").read_bytes()
    assert git_blob_id(datautils) == UPSTREAM_BLOBS["datautils.py"]


@pytest.mark.parametrize("fix", sorted(FIXES.glob("*.patch")), ids=lambda p: p.stem)
def test_each_fix_applies_to_the_job(fix: Path) -> None:
    port = (JOB / "multigpu_torchrun.py").read_text()
    fixed = apply_patch(port, fix.read_text())
    assert fixed != port
    compile(fixed, fix.name, "exec")


FINDINGS = sorted(ROOT.glob("examples/*/findings/*.yaml"))


def test_every_finding_is_valid_and_run_here() -> None:
    """A scenario added under findings/ without a test here would never run in CI."""
    assert FINDINGS
    source = Path(__file__).read_text()
    for scenario in FINDINGS:
        assert f'"{scenario.name}"' in source, f"{scenario} has no test in {__file__}"
    proc = cli("validate", *map(str, FINDINGS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run(scenario: Path, folder: Path) -> tuple[dict[str, Any], Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "out.json"
    proc = cli("run", str(scenario), "--json", str(out), "--run-dir", str(folder / "run"),
               "--plain", timeout=400)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    return record, Path(record["run_dir"])


#: Runs of torn_snapshot.yaml until its kill lands inside the save. About a third of the
#: upstream job's do here: its save can fit in one sliver of the CPU its rank is left, and
#: finish before the harness reacts. A miss fails `faults_landed` and proves nothing either
#: way, so it is run again, and a test whose every run missed is skipped, saying so.
LANDING_TRIES = 3


def run_until_landed(scenario: Path, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    for attempt in range(LANDING_TRIES):
        record, run_dir = run(scenario, tmp_path / f"try{attempt}")
        if checks(record)["faults_landed"]:
            return record, run_dir
        assert checks(record)["faults_injected"], record["checks"]
    pytest.skip(f"not observed: the kill missed the save in all {LANDING_TRIES} runs "
                "(faults_landed); power_loss.yaml shows the same defect deterministically")


def fixed_job(tmp_path: Path, fix: str, scenario: str) -> Path:
    """The scenario beside a copy of the job with ``fix`` applied; the scenario itself is
    unchanged (it names the job as ``../multigpu_torchrun.py``)."""
    job = tmp_path / "ddp_tutorial"
    (job / "findings").mkdir(parents=True)
    shutil.copy(JOB / "datautils.py", job)
    port = (JOB / "multigpu_torchrun.py").read_text()
    (job / "multigpu_torchrun.py").write_text(
        apply_patch(port, (FIXES / f"{fix}.patch").read_text()))
    shutil.copy(JOB / "findings" / scenario, job / "findings")
    return job / "findings" / scenario


def checks(record: dict[str, Any]) -> dict[str, bool]:
    return {c["name"]: c["passed"] for c in record["checks"]}


def attempts(run_dir: Path, name: str) -> dict[tuple[int, int], str]:
    """(torchrun attempt, local rank) -> that worker's ``name`` log (stdout.log, stderr.log)."""
    found = {}
    for path in (run_dir / "torchrun").glob(f"*/attempt_*/*/{name}"):
        key = (int(path.parent.parent.name.removeprefix("attempt_")), int(path.parent.name))
        found[key] = path.read_text()
    return found


def slow(test: Any) -> Any:
    """Runs the job under torchrun: tens of seconds, in the scenario sweep's CI step."""
    return pytest.mark.slow(pytest.mark.scenarios(pytest.mark.timeout(1200)(test)))


@slow
@pytest.mark.parametrize("fixed", [False, True], ids=["upstream", "fixed"])
def test_a_snapshot_reported_saved_does_not_survive_a_power_loss(
        tmp_path: Path, fixed: bool) -> None:
    scenario = JOB / "findings" / "power_loss.yaml"
    if fixed:
        scenario = fixed_job(tmp_path, "fix_atomic_snapshot", scenario.name)
    record, run_dir = run(scenario, tmp_path / "run")
    events = read_events(run_dir / "events.jsonl")
    loaded = [e["step"] for e in events if e["event"] == "checkpoint_loaded"]
    if fixed:
        assert record["passed"], checks(record)
        assert loaded, "no resume after the power loss"
        assert min(loaded) >= 5, loaded  # the snapshot of epoch 5, or newer
        return
    # It said "Epoch 5 | Training snapshot saved", lost power, and started over from
    # nothing: no snapshot was left to resume from. (On a loaded CI machine a later crash
    # once restarted it again, "from snapshot at Epoch 5", the one saved after the loss:
    # that resume must not pass the check either.)
    said = {c["name"]: c["message"] for c in record["checks"]}
    why = json.dumps({"checks": said, "faults": record["faults"], "loaded": loaded}, indent=1)
    assert checks(record) == {"completes": True, "faults_injected": True,
                              "checkpoint_durable": False}, why
    logs = attempts(run_dir, "stdout.log")
    restarted = [text for (attempt, _), text in logs.items() if attempt == 1]
    assert restarted, "no restart after the power loss"
    for text in restarted:
        assert re.match(r"\[GPU\d\] Epoch 0 \|", text), text[:200]
    if loaded:  # only after another restart, from what was saved after the loss
        assert max(attempt for attempt, _ in logs) >= 2, why
        assert "saved step 0 again" in said["checkpoint_durable"], why


@slow
@pytest.mark.parametrize("fixed", [False, True], ids=["upstream", "fixed"])
def test_a_kill_inside_the_save_leaves_a_snapshot_no_restart_can_load(
        tmp_path: Path, fixed: bool) -> None:
    scenario = JOB / "findings" / "torn_snapshot.yaml"
    if fixed:
        scenario = fixed_job(tmp_path, "fix_atomic_snapshot", scenario.name)
    record, run_dir = run_until_landed(scenario, tmp_path)
    (kill,) = [e for e in read_events(run_dir / "events.jsonl", "fault_injected")
               if e["kind"] == "process.kill"]
    if fixed:
        # Killed inside the save of its temporary file: no snapshot.pt was half written, so
        # the restarted world starts over and finishes.
        assert kill["file"] == "snapshot.pt.tmp", kill
        assert record["passed"], checks(record)
        return
    # Killed inside the save, on the file it resumes from: every restart dies loading what
    # is left, until torchrun gives up; nothing else failed.
    assert kill["file"] == "snapshot.pt", kill
    assert checks(record) == {"completes": False, "faults_injected": True,
                              "faults_landed": True}
    assert (run_dir / "work" / "snapshot.pt").stat().st_size < 1000  # a whole one is ~2 KB
    errors = attempts(run_dir, "stderr.log")
    restarted = {key: text for key, text in errors.items() if key[0] >= 1}
    assert {attempt for attempt, _ in restarted} == {1, 2, 3}  # --max-restarts=3, all spent
    # Each restart ended in the load: the rank that died first died in it. Not every rank:
    # torchrun stops the others then, and on a busy machine one may not have got that far
    # (an empty stderr.log, seen beside three CPU hogs).
    for attempt in (1, 2, 3):
        texts = [text for (a, _), text in restarted.items() if a == attempt]
        assert any("in _load_snapshot" in text for text in texts), (
            attempt, [text[-2000:] for text in texts])


@slow
@pytest.mark.parametrize("fixed", [False, True], ids=["upstream", "fixed"])
def test_a_restart_trains_the_epoch_of_its_snapshot_again(tmp_path: Path, fixed: bool) -> None:
    scenario = JOB / "findings" / "epoch_retrained.yaml"
    if fixed:
        scenario = fixed_job(tmp_path, "fix_epochs_run", scenario.name)
    record, run_dir = run(scenario, tmp_path / "run")
    events = read_events(run_dir / "events.jsonl")
    saved = Counter(e["step"] for e in events if e["event"] == "step")
    (loaded,) = {e["step"] for e in events if e["event"] == "checkpoint_loaded"}
    assert set(saved) == set(range(10)), saved  # every epoch finished
    if fixed:
        assert record["passed"], checks(record)
        assert record["metrics"]["lost_steps"] == 0
        assert saved[loaded - 1] == 1  # resumed after the epoch it saved
        return
    # Resumed "at" the epoch its snapshot was taken after, and trained that epoch again.
    assert checks(record) == {"completes": True, "faults_injected": True,
                              "checkpoint_durable": True, "lost_steps": False}
    assert record["metrics"]["lost_steps"] == 1
    assert [step for step, n in saved.items() if n > 1] == [loaded]
