"""Acknowledged before durable (issue 47, class 1), through whole scenarios.

Each broken variant of the router's durability path (tests/broken_serving/sitecustomize.py,
on the server's PYTHONPATH through ``system.env``; the fault-free twin runs the correct
server) passes every serving scenario shipped before the durability points existed, and
fails one of the new ones; the correct server passes the new ones, each crash landing at its
named fault point. Minutes per run on a busy machine: marked ``scenarios`` (make
test-scenarios), like tests/test_shipped_scenarios.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aftershock.harness.run.records import RunResult
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.run.timeline import read_events
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario

pytestmark = [pytest.mark.scenarios, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
BROKEN = Path(__file__).resolve().parent / "broken_serving"
POINTS = ("token_produced", "journal_appended", "journal_synced", "token_sent")
#: The serving scenarios shipped before the router's durability points: every broken
#: variant passes them all, which is why the new ones exist.
BEFORE = ("fault_free", "kill_worker", "freeze_worker", "poison_kv_block", "xid_79_worker",
          "wedged_worker", "reset_worker_links", "kill_worker_during_recovery", "kill_router",
          "poison_idle_prefix_block", "fail_stop_resume")
VARIANTS = ("shown_before_durable", "never_synced", "redo_after_crash")


def scenario(name: str, broken: str | None = None) -> LoadedScenario:
    loaded = load_scenario(ROOT / "scenarios" / "serving" / f"{name}.yaml")
    if broken is None:
        return loaded
    system = loaded.spec.system
    env = {**system.env, "PYTHONPATH": f"{BROKEN}:{ROOT}",
           "AFTERSHOCK_INJECT_BROKEN_DURABILITY": broken}
    spec = loaded.spec.model_copy(update={"system": system.model_copy(update={"env": env})})
    return LoadedScenario(spec, loaded.path, loaded.text)


def run(loaded: LoadedScenario, tmp_path: Path, cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> RunResult:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(cache))
    return run_scenario(loaded, run_dir=tmp_path / "run")


def failed(result: RunResult) -> dict[str, str]:
    return {c.name: c.message for c in result.checks if not c.passed}


@pytest.mark.parametrize("point", POINTS)
def test_a_router_crashed_at_each_durability_point_resumes_every_request(
        point: str, tmp_path: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(scenario(f"crash_router_{point}"), tmp_path, shared_cache, monkeypatch)
    assert not failed(result), failed(result)
    events = read_events(Path(result.run_dir) / "events.jsonl")
    (hit,) = [e for e in events if e.event == "fault_injected"]
    assert hit.fields["phase"] == point  # the timeline names the point the crash hit
    routers = [e.fields["generation"] for e in events
               if e.event == "hello" and e.fields.get("role") == "router"]
    assert routers == [0, 1]


def test_a_power_loss_under_the_journal_loses_nothing_a_client_saw(
        tmp_path: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(scenario("journal_power_loss"), tmp_path, shared_cache, monkeypatch)
    assert not failed(result), failed(result)
    events = read_events(Path(result.run_dir) / "events.jsonl")
    (checked,) = [e.fields for e in events if e.event == "journal_checked"]
    assert checked["tokens_proven"] == checked["tokens_seen"] > 0
    # Every token timed against the journal's fsyncs, none received before its own.
    assert checked["tokens_timed"] == checked["tokens_seen"], checked
    assert checked["fsyncs_seen"] > 0, checked
    assert checked["early_tokens"] == 0, checked


def test_a_restarted_router_makes_what_it_replayed_durable_before_serving_it(
        tmp_path: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router died between writing a batch and fsyncing it; its successor replayed the
    batch from the kernel's copy and streams it to resuming clients. Before Journal.open
    fsynced what it replayed, this failed: 4 tokens received 16 s before their fsync in one
    run, 11 tokens clients saw taken by the power loss in another. A test-only variant that
    keeps the old open was caught in 2 runs of 3 (where clients resumed before the successor
    wrote anything of its own), too few for CI; tests/test_serving_durability.py holds the
    open's fsync itself."""
    result = run(scenario("crash_router_then_power_loss"), tmp_path, shared_cache, monkeypatch)
    assert not failed(result), failed(result)
    events = read_events(Path(result.run_dir) / "events.jsonl")
    (checked,) = [e.fields for e in events if e.event == "journal_checked"]
    assert checked["tokens_timed"] == checked["tokens_seen"] > 0, checked
    assert checked["early_tokens"] == 0, checked
    routers = [e.fields["generation"] for e in events
               if e.event == "hello" and e.fields.get("role") == "router"]
    assert routers == [0, 1, 2]  # restarted after the crash, and after the power loss


@pytest.mark.parametrize(("variant", "name", "check", "says"), [
    # Tokens shown before their record was fsynced, fsynced 50 ms later: every token is
    # timed against the fsyncs the lazy filesystem saw, so one run shows it wherever the
    # power went. (Before that, a loss after the fsync took 0 bytes in one run of three, and
    # failed CI once at 419345a.)
    ("shown_before_durable", "journal_power_loss", "acknowledged_durable",
     "before their journal record was durable (fsynced)"),
    # Never fsynced at all: the power took the tokens (or the request itself, acknowledged
    # before its `req` record was durable).
    ("never_synced", "journal_power_loss", "acknowledged_durable", "not in the journal"),
    # Re-POSTing clients get the same tokens from a redo: only the journal shows it.
    ("redo_after_crash", "crash_router_token_sent", "acknowledged_durable",
     "started again from scratch"),
    # Clients that never submit twice: the restarted router no longer has their requests.
    ("redo_after_crash", "crash_router_token_produced", "no_lost_requests",
     "did not complete"),
])
def test_each_broken_variant_fails_a_new_scenario(
        variant: str, name: str, check: str, says: str, tmp_path: Path, shared_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(scenario(name, variant), tmp_path, shared_cache, monkeypatch)
    assert check in failed(result), result.checks
    assert says in failed(result)[check]
    if variant == "redo_after_crash" and check == "acknowledged_durable":
        # Output checks cannot see a redo: the re-POSTing clients got the fault-free tokens.
        # (Not asserted of the power loss: where it took an acknowledged request's only
        # record, a client that never resubmits loses it, and the output checks see that
        # too, depending on when the power went.)
        assert "outputs_match" not in failed(result)
        assert "no_lost_requests" not in failed(result)


# 33 runs (about fifteen minutes): the evidence that the variants were blind spots, kept outside
# CI's time (make test-long); CI runs what catches them.
@pytest.mark.long
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", BEFORE)
def test_each_broken_variant_passes_the_serving_scenarios_shipped_before(
        variant: str, name: str, tmp_path: Path, shared_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(scenario(name, variant), tmp_path, shared_cache, monkeypatch)
    assert not failed(result), failed(result)
