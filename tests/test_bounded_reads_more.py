"""Timelines and golden files are read as regular files, capped, and golden files only where
no one else could have planted them (issue 48, findings 4 and 6).

A FIFO in place of ``events.jsonl`` or ``golden.json`` hung the command; an events line
nested 200,000 deep ended in a RecursionError traceback; ``golden`` exited 0 on a malformed
file; ``golden.json`` linked to /dev/zero grew until MemoryError; a golden folder anyone can
write was believed.
"""

from __future__ import annotations

import grp
import json
import os
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, bounded_cli

from aftershock.harness.run import timeline
from aftershock.harness.run.timeline import DamagedTimeline, Timeline, read_events
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.twin import golden

GIB = 1 << 30
DEEP = "[" * 200_000
LAUNCH = {"t": 1000.0, "event": "launch", "source": "harness", "argv": ["x"], "phase": "run",
          "seed": 0}
END = {"t": 1003.5, "event": "run_end", "source": "harness", "exit_code": 0,
       "timed_out": False}
TRAINER = """\
name: t
system:
  reference: trainer
  world: {replicas: 2, shards: 1}
  steps: 20
expect: {params_match: fault_free}
"""


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "scenario.yaml").write_text(f"""\
name: r
system:
  command: [{sys.executable}, -c, pass]
  world: 1
expect:
  completes: true
""")
    (run / "events.jsonl").write_text(json.dumps(LAUNCH) + "\n" + json.dumps(END) + "\n")
    (run / "logs" / "launcher.stdout.log").write_text("")
    result = {"name": "r", "file": str(run / "scenario.yaml"), "passed": True, "seed": 0,
              "duration_s": 3.5, "metrics": {}, "run_dir": str(run),
              "checks": [{"name": "completes", "passed": True, "observed": "exit 0",
                          "expected": "exit 0", "message": "exited 0"}],
              "faults": []}
    (run / "result.json").write_text(json.dumps(result))
    return run


def _trainer_folder(folder: Path) -> LoadedScenario:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "t.yaml"
    path.write_text(TRAINER)
    return LoadedScenario(parse_scenario(TRAINER, str(path)), path, TRAINER)


# ------------------------------------------------------------------------ events.jsonl


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recheck", [False, True])
def test_a_fifo_for_a_timeline_is_refused_at_once(tmp_path: Path, recheck: bool) -> None:
    run = _run_folder(tmp_path)
    (run / "events.jsonl").unlink()
    os.mkfifo(run / "events.jsonl")
    shown = bounded_cli("report", str(run), *(["--recheck"] if recheck else []),
                        cpu_s=30, wall_s=60)
    assert not shown.timed_out
    assert shown.returncode == 3, shown.stdout + shown.stderr
    assert f"{run / 'events.jsonl'}: not a regular file" in shown.stderr.replace("\n", "")
    assert "Traceback" not in shown.stderr


@pytest.mark.timeout(120)
def test_an_events_line_nested_200000_deep_is_a_damaged_line(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    (run / "events.jsonl").write_text(json.dumps(LAUNCH) + "\n" + DEEP + "\n")
    with pytest.raises(DamagedTimeline, match=r"events\.jsonl:2: .*nested more than 64"):
        read_events(run / "events.jsonl")
    shown = bounded_cli("report", str(run), cpu_s=30, wall_s=60)
    assert shown.returncode == 3, shown.stdout + shown.stderr
    assert "Traceback" not in shown.stderr
    assert "events.jsonl:2: not an event" in shown.stderr.replace("\n", "")
    # The live tail passes over it (the run goes on; the final read refuses it).
    live = Timeline(run / "events.jsonl")
    try:
        assert [e.event for e in live.poll()] == ["launch"]
    finally:
        live.close()


@pytest.mark.timeout(30)
def test_an_event_nested_a_little_too_deep_is_refused_too(tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(timeline.DEPTH_LIMIT):
        deep = [deep]
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(LAUNCH) + "\n" + json.dumps({**END, "x": deep}) + "\n")
    with pytest.raises(DamagedTimeline, match=r"events\.jsonl:2: .*nested more than"):
        read_events(path)


@pytest.mark.timeout(180)
def test_a_one_gib_events_line_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    with open(run / "events.jsonl", "wb") as handle:  # sparse: one line of 1 GiB of NUL
        handle.write((json.dumps(LAUNCH) + "\n").encode())
        handle.truncate(GIB)
        handle.seek(GIB)
        handle.write(b"\n" + json.dumps(END).encode() + b"\n")
    shown = bounded_cli("report", str(run), cpu_s=60, wall_s=150)
    assert shown.returncode == 3, shown.stdout + shown.stderr
    assert "events.jsonl:2: longer than 1 MiB" in shown.stderr.replace("\n", "")
    assert shown.max_rss_mb < 200, shown.max_rss_mb


# ------------------------------------------------------------------------- golden.json


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("text", "said"), [
    ("{not json", "golden.json:1:2: not JSON"),
    ('{"about": "x"}', "golden.json:1:1: no `goldens` list"),
    ('{"goldens": [{"system": {}, "seed": "0"}]}', 'goldens.0.seed: "0" is not an integer'),
    ('{"goldens": [{"system": {}, "seed": 0, "digests": {"a": "b"}}]}', "goldens.0.digests"),
    ('{"goldens": ' + DEEP + "}", "nested more than 16 levels deep"),
])
def test_golden_refuses_a_malformed_golden_file_with_exit_2(
        tmp_path: Path, text: str, said: str) -> None:
    _trainer_folder(tmp_path / "s")
    (tmp_path / "s" / "golden.json").write_text(text)
    for update in ([], ["--update"]):
        shown = bounded_cli("golden", str(tmp_path / "s"), *update, cpu_s=20, wall_s=50)
        assert shown.returncode == 2, shown.stdout + shown.stderr
        assert said in shown.stderr.replace("\n", ""), shown.stderr
        assert "Traceback" not in shown.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plant", ["fifo", "dev_zero", "huge"])
def test_a_golden_file_that_is_no_small_regular_file_is_refused_at_once(
        tmp_path: Path, plant: str) -> None:
    loaded = _trainer_folder(tmp_path / "s")
    path = tmp_path / "s" / "golden.json"
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "dev_zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as handle:
            handle.truncate(GIB)
    shown = bounded_cli("golden", str(tmp_path / "s"), cpu_s=30, wall_s=60)
    assert not shown.timed_out
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert str(path) in shown.stderr.replace("\n", "")
    said = "larger than 4 MiB" if plant == "huge" else "not a regular file"
    assert said in shown.stderr.replace("\n", ""), shown.stderr
    assert shown.max_rss_mb < 200, shown.max_rss_mb
    # What a run's fault_free_golden check reads: not observed, at once, saying why.
    result = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert result.message.startswith("not observed:")
    assert said in result.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plant", ["world_writable_folder", "file_of_another_user",
                                   "group_writable_file"])
def test_a_golden_anyone_could_have_planted_is_not_believed(tmp_path: Path, plant: str) -> None:
    loaded = _trainer_folder(tmp_path / "s")
    path = tmp_path / "s" / "golden.json"
    path.write_text(json.dumps({"goldens": []}))
    assert golden.problems([loaded], writing=True) == []  # the control: ours, private
    if plant == "world_writable_folder":
        os.chmod(path.parent, 0o777)
    elif plant == "file_of_another_user":
        os.chown(path, 65534, 65534)
    else:  # writable by a group with no member: not this user's own (test_private_group.py)
        os.chown(path, os.geteuid(), grp.getgrnam("users").gr_gid)
        os.chmod(path, 0o664)
    shown = bounded_cli("golden", str(path.parent), cpu_s=20, wall_s=50)
    text = shown.stderr.replace("\n", "")
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert f"{path}:1:1: not trusted" in text, text
    assert "chmod go-w" in text
    assert "chown" in text
    result = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert "not trusted" in result.message


@pytest.mark.timeout(60)
def test_update_refuses_to_record_into_a_folder_anyone_can_write(tmp_path: Path) -> None:
    _trainer_folder(tmp_path / "s")
    os.chmod(tmp_path / "s", 0o777)
    shown = bounded_cli("golden", str(tmp_path / "s"), "--update", cpu_s=20, wall_s=50)
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert "not trusted" in shown.stderr
    assert not (tmp_path / "s" / "golden.json").exists()


def test_the_shipped_golden_files_are_accepted() -> None:
    """In a checkout of this user's (CI clones as root and runs as root)."""
    shipped = sorted((ROOT / "scenarios").rglob("golden.json"))
    assert shipped
    loaded = [load_scenario(p) for g in shipped for p in sorted(g.parent.glob("*.yaml"))]
    assert golden.problems(loaded, writing=True) == []
    for path in shipped:
        assert golden.read(path)


# ------------------------------------------------- other files a job or a user can plant


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plant", ["fifo", "dev_zero"])
def test_a_membership_log_or_a_worker_log_is_read_only_as_a_regular_file(
        tmp_path: Path, plant: str) -> None:
    from aftershock.harness import oracle
    from aftershock.harness.run import attempts

    for name in ("membership.jsonl", "stderr.log"):
        path = tmp_path / name
        if plant == "fifo":
            os.mkfifo(path)
        else:
            os.symlink("/dev/zero", path)
    with pytest.raises(ValueError, match=r"membership\.jsonl: .*not"):
        oracle.read_membership(tmp_path / "membership.jsonl")
    assert attempts.read_tail(tmp_path / "stderr.log") == ""


@pytest.mark.timeout(30)
def test_a_membership_line_nested_deep_is_a_malformed_entry(tmp_path: Path) -> None:
    from aftershock.harness import oracle

    path = tmp_path / "membership.jsonl"
    path.write_text('{"gen": 0, "first_step": 1, "replicas": [0]}\n' + DEEP + "\n")
    with pytest.raises(ValueError, match=r"membership\.jsonl:2: not a membership entry"):
        oracle.read_membership(path)


@pytest.mark.timeout(30)
def test_recheck_believes_a_cached_twin_only_where_the_run_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aftershock.harness.run.runner import baseline_key
    from aftershock.harness.verdict import recheck

    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    loaded = _trainer_folder(tmp_path / "s")
    cached = tmp_path / "cache" / "fault_free" / (
        baseline_key(loaded.spec, 0, scenario_dir=loaded.path.parent) + ".json")
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"digests": {"0": "abc"}}))
    assert recheck._cached(loaded, 0, "digests") == {"0": "abc"}  # the control
    os.chmod(cached.parent, 0o777)
    assert recheck._cached(loaded, 0, "digests") is None


@pytest.mark.timeout(120)
def test_a_run_into_a_folder_holding_a_fifo_timeline_is_a_harness_error(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: s\nsystem:\n  command: [{sys.executable}, -c, pass]\n"
                        "expect:\n  completes: true\n")
    (tmp_path / "runs" / "s").mkdir(parents=True)  # not a run's folder: used as it is
    os.mkfifo(tmp_path / "runs" / "s" / "events.jsonl")
    shown = bounded_cli("run", str(scenario), "--run-dir", str(tmp_path / "runs"), "--plain",
                        cpu_s=60, wall_s=90)
    assert not shown.timed_out
    assert shown.returncode == 3, shown.stdout + shown.stderr
    assert "events.jsonl: not a regular file" in shown.stderr.replace("\n", "")


@pytest.mark.timeout(60)
def test_the_per_process_log_tail_passes_over_a_fifo(tmp_path: Path) -> None:
    """A job's FIFO among torchrun's per-process logs would stall the one thread that feeds
    every log probe; it is passed over, and the regular log beside it still read."""
    import threading

    from aftershock.harness.run.target import _Tailer

    logs = tmp_path / "attempt_0"
    logs.mkdir()
    os.mkfifo(logs / "0.stdout.log")
    (logs / "1.stdout.log").write_text("rank 1 step 1\n")
    seen: list[tuple[str, bytes]] = []
    tail = _Tailer((str(logs / "*.stdout.log"),), lambda path, raw, t: seen.append((path, raw)))
    one_pass = threading.Thread(target=tail._pass, daemon=True)
    one_pass.start()
    one_pass.join(20)
    assert not one_pass.is_alive(), "the tail waits on a FIFO"
    assert seen == [(str(logs / "1.stdout.log"), b"rank 1 step 1")]
