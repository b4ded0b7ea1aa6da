"""Worlds from evidence only (issue 46): torchrun's ``attempt_N`` names a world only when one
launcher started the whole job; torchft's quorum id, read by the ``torchft`` preset, names
the world of each committed step; lines' own dates anchor them on the timeline.

Timelines here are built the way a live run builds them: real log lines through the real
probes (harness/run/logprobe.py) and torchrun's real file layout (``file_fields``)."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from aftershock.harness.run.logprobe import (
    LogProbe,
    StreamStamps,
    compile_probes,
    file_fields,
    line_events,
)
from aftershock.harness.run.records import Event
from aftershock.harness.scenario import presets
from aftershock.harness.systems.command import CommandSystem
from aftershock.harness.verdict import metrics
from aftershock.harness.verdict.checks import _single_history

EPOCH_STEP = LogProbe(pattern=r"Epoch (?P<step>\d+) \|", event="step")
FAULT = 10.0


def read(line: str, t: float, path: str, probes: list[LogProbe],
         stamps: StreamStamps | None = None) -> list[Event]:
    """The events one line of a per-process file stands for, read at ``t``."""
    return line_events(line, compile_probes(probes, "logs"), read_t=t, clock_offset=0.0,
                       started=0.0, defaults=file_fields(path), stamps=stamps)


def started(t: float, pid: int, agent: int, attempt: int) -> Event:
    return Event(t, "process_started", "launcher",
                 {"pid": pid, "role": "worker", "agent": agent, "generation": attempt})


def fault() -> Event:
    return Event(FAULT, "fault_injected", "harness", {"kind": "process.freeze"})


def end() -> Event:
    return Event(40.0, "run_end", "harness", {"exit_code": 0})


def group_file(group: int, attempt: int = 0) -> str:
    """torchrun's per-process file of replica group ``group`` (each group its torchrun)."""
    return f"/run/torchrun/group{group}/none_{group}abc/attempt_{attempt}/0/stdout.log"


def test_file_fields_give_the_attempt_and_the_launcher_not_a_world() -> None:
    fields = file_fields(group_file(1, 2))
    assert fields["attempt"] == 2
    assert fields["rank"] == 0
    assert fields["launcher"] == "/run/torchrun/group1/none_1abc"
    assert "generation" not in fields


def two_launchers_split() -> list[Event]:
    """Two torchft replica groups, each its own torchrun, both at attempt_0; group 1 frozen
    at the fault, group 0 trains 10..19 alone, group 1 thawed trains 10..19 alone too."""
    events = [started(0.5, 100, 10, 0), started(0.5, 200, 20, 0), fault(), end()]
    for s in range(10):
        for g in (0, 1):
            events += read(f"Epoch {s} | loss 1.0", 1.0 + 0.5 * s + 0.01 * g, group_file(g),
                           [EPOCH_STEP])
    for s in range(10, 20):
        events += read(f"Epoch {s} | loss 1.0", 11.0 + 0.2 * s, group_file(0), [EPOCH_STEP])
        events += read(f"Epoch {s} | loss 1.0", 20.0 + 0.2 * s, group_file(1), [EPOCH_STEP])
    return events


def test_two_launchers_at_attempt_0_are_not_one_world() -> None:
    events = two_launchers_split()
    reading = metrics.Reading.of(events)
    assert metrics.one_launcher(events) is not None
    assert {c.world for c in reading.commits} == {None}
    # Rank 0 of each group is a rank of its own.
    assert {c.rank for c in reading.commits} == {0, 1}
    assert metrics.full_world(events, None) == 2
    assert metrics.forked_steps(events) is None
    check = _single_history(metrics.forked_steps(events), events)
    assert not check.passed
    assert "not observed" in check.message
    # Steps 10..19, each committed after the fault by both launchers: done twice.
    assert metrics.lost_steps(events) == 10


def test_one_launcher_seen_makes_its_attempts_worlds() -> None:
    """One torchrun (one agent, one folder): attempt_1 is a world after attempt_0."""
    path = "/run/torchrun/none_x/attempt_{}/{}/stdout.log"
    events = [started(0.5, 100, 10, 0), started(0.5, 101, 10, 0), fault(),
              started(12.0, 102, 10, 1), started(12.0, 103, 10, 1), end()]
    for s in range(10):
        for r in (0, 1):
            events += read(f"Epoch {s} |", 1.0 + 0.5 * s, path.format(0, r), [EPOCH_STEP])
    for s in range(8, 20):
        for r in (0, 1):
            events += read(f"Epoch {s} |", 13.0 + 0.2 * s, path.format(1, r), [EPOCH_STEP])
    assert metrics.one_launcher(events) is None
    assert {c.world for c in metrics.commits(events)} == {0, 1}
    assert metrics.forked_steps(events) == 0
    assert metrics.lost_steps(events) == 2  # steps 8 and 9 trained again


def test_attempts_without_launcher_evidence_name_no_world() -> None:
    """No worker was seen starting: nothing proves one torchrun ran the whole job."""
    path = "/run/torchrun/none_x/attempt_0/0/stdout.log"
    events = [fault(), end()] + [e for s in range(12) for e in
                                 read(f"Epoch {s} |", 1.0 + s, path, [EPOCH_STEP])]
    assert "no launcher" in (metrics.one_launcher(events) or "")
    assert metrics.forked_steps(events) is None


# ------------------------------------------------------------------------- torchft preset

FT = presets.probes("torchft")


def ft_file(group: int, attempt: int = 0) -> str:
    return f"/run/torchrun/group{group}/none_{group}abc/attempt_{attempt}/0/stderr.log"


def ft_lines(group: int, uuid: str, quorum: int, first: int, last: int, t0: float,
             attempt: int = 0) -> list[Event]:
    """What torchft's Manager logs (Python's logging.basicConfig) for steps first..last of
    replica group ``group`` in quorum ``quorum``: one reconfigure, then a commit a step."""
    path = ft_file(group, attempt)
    who = f"[train_ddp_{group}:{uuid}/0 - step {{}}]"
    events = read(f"INFO:torchft.manager:{who.format(first)} reconfiguring for "
                  f"quorum_id={quorum} store_prefixed_addr='x'", t0, path, FT)
    for i, s in enumerate(range(first, last + 1)):
        events += read(f"INFO:torchft.manager:{who.format(s)} should_commit=True "
                       "enough_replicas=True, errored=None", t0 + 0.1 * (i + 1), path, FT)
    return events


U0, U1, U1B = "8b4303f8-9c91-4f2b", "a01eaa3d-03c2-40a1", "0c0ffee0-1111-2222"


def test_the_preset_reads_the_quorum_a_process_entered_as_the_world_of_its_steps() -> None:
    events = ft_lines(1, U1, 7, 3, 4, 1.0)
    assert [e.event for e in events] == ["world_changed", "step", "step"]
    step = events[1]
    assert step.fields["step"] == 3
    assert step.fields["replica"] == 1
    assert step.fields["replica_id"] == f"train_ddp_1:{U1}"
    assert [c.world for c in metrics.commits(events)] == [7, 7]


def test_a_torchft_group_frozen_until_the_other_finished_fails_single_history() -> None:
    """Group 1 frozen at step 10; group 0 trains 10..19 in quorum 2 alone and ends; group 1,
    thawed, trains 10..19 in quorum 3 alone: two histories from step 10."""
    events = [started(0.5, 100, 10, 0), started(0.5, 200, 20, 0), fault(), end()]
    events += ft_lines(0, U0, 1, 0, 9, 1.0) + ft_lines(1, U1, 1, 0, 9, 1.0)
    events += ft_lines(0, U0, 2, 10, 19, 11.0) + ft_lines(1, U1, 3, 10, 19, 25.0)
    assert metrics.forked_steps(events) == 10
    assert not _single_history(metrics.forked_steps(events), events).passed
    assert metrics.lost_steps(events) == 10


def test_a_torchft_group_killed_and_healed_is_one_history() -> None:
    """Group 1 killed at step 10; group 0 trains 10..14 in quorum 2 alone; group 1, restarted
    by its torchrun (attempt_1, a new uuid), heals at 15 and both train 15..19 in quorum 3."""
    events = [started(0.5, 100, 10, 0), started(0.5, 200, 20, 0), fault(),
              started(13.0, 201, 20, 1), end()]
    events += ft_lines(0, U0, 1, 0, 9, 1.0) + ft_lines(1, U1, 1, 0, 9, 1.0)
    events += ft_lines(0, U0, 2, 10, 14, 11.0)
    events += ft_lines(0, U0, 3, 15, 19, 14.0) + ft_lines(1, U1B, 3, 15, 19, 14.0, attempt=1)
    assert metrics.forked_steps(events) == 0
    check = _single_history(metrics.forked_steps(events), events)
    assert check.passed, check.message
    assert metrics.lost_steps(events) == 0


# ----------------------------------------------------------------------------- presets


def test_a_command_takes_its_presets_probes_before_its_own() -> None:
    own = {"pattern": r"\[(?P<step>\d+)\] loss", "event": "step"}
    system = CommandSystem.model_validate({"command": ["x"], "preset": "torchft",
                                           "probes": [own]})
    probes = system.all_probes()
    assert probes[-1].pattern == own["pattern"]
    assert {p.event for p in probes} >= {"world_changed", "step", "failure_detected"}
    # torchft includes torchrun's agent lines.
    assert any("exitcode" in p.pattern for p in probes)


def test_an_unknown_preset_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'deepspeed' \(known: .*torchft"):
        CommandSystem.model_validate({"command": ["x"], "preset": "deepspeed"})


def test_presets_are_validated_when_they_register() -> None:
    with pytest.raises(ValueError, match=r"not an aftershock\.harness\.scenario\.presets\.Preset"):
        presets.register("torchft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="registered twice"):
        presets.register(presets.Preset("torchft", "again", presets.TORCHFT.probes))


def test_a_third_party_preset_loads_by_entry_point_and_a_broken_one_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_presets.py").write_text(
        "from aftershock.harness.run.logprobe import LogProbe\n"
        "from aftershock.harness.scenario.presets import Preset\n"
        "MINE = Preset('myframework', 'its step lines',\n"
        "              (LogProbe(pattern=r'iter (?P<step>\\d+) done', event='step'),))\n")
    info = tmp_path / "my_presets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-presets\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[aftershock.presets]\nmine = my_presets:MINE\nbad = json:loads\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with presets.PRESETS.reloaded():
        system = CommandSystem.model_validate({"command": ["x"], "preset": "myframework"})
        assert [p.pattern for p in system.all_probes()] == [r"iter (?P<step>\d+) done"]
        assert list(presets.broken()) == ["bad (json:loads)"]
        with pytest.raises(ValueError, match=r"skipped as broken: bad \(json:loads\)"):
            CommandSystem.model_validate({"command": ["x"], "preset": "nope"})
    assert "myframework" not in presets.names()


def test_torchruns_agent_line_is_a_failure_at_its_own_glog_time() -> None:
    offset = time.time() - time.monotonic()
    now = time.monotonic()
    stamp = datetime.datetime.fromtimestamp(now - 2 + offset).strftime("%m%d %H:%M:%S.%f")
    line = (f"E{stamp} 12093 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
            "(exitcode: -9) local_rank: 0 (pid: 12177) of binary: /usr/bin/python")
    (event,) = line_events(line, compile_probes(presets.probes("torchrun"), "stderr"),
                           read_t=now, clock_offset=offset, started=now - 10)
    assert event.event == "failure_detected"
    assert event.fields["cause"] == "-9"
    assert event.fields["pid"] == 12177
    assert event.fields["clock"] == "line"
    assert event.t == pytest.approx(now - 2, abs=1e-5)
    restart = (f"I{stamp} 12093 torch/distributed/elastic/agent/server/api.py:942] [default] "
               "Worker group FAILED. 1/3 attempts left; will restart worker group")
    (event,) = line_events(restart, compile_probes(presets.probes("torchrun"), "stderr"),
                           read_t=now, clock_offset=offset, started=now - 10)
    assert event.event == "failure_detected"
    assert event.fields["cause"].startswith("Worker group FAILED. 1/3 attempts left")


# ------------------------------------------------------------------------------ times


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-12-06T05:27:42.123Z", datetime.datetime(2026, 12, 6, 5, 27, 42, 123000,
                                                   tzinfo=datetime.UTC)),
    ("2026-12-06 07:27:42,5+02:00", datetime.datetime(2026, 12, 6, 5, 27, 42, 500000,
                                                      tzinfo=datetime.UTC)),
    ("2026-12-06T05:27:42", datetime.datetime(2026, 12, 6, 5, 27, 42)),  # local time
    ("I1206 05:27:42.123456", datetime.datetime(2026, 12, 6, 5, 27, 42, 123456)),
])
def test_dates_in_lines_are_read_as_wall_clock(text: str, expected: datetime.datetime) -> None:
    now = datetime.datetime(2026, 12, 6, 6, 0).timestamp()
    from aftershock.harness.run.logprobe import wall_time
    assert wall_time(text, now) == pytest.approx(expected.timestamp(), abs=1e-6)


def test_glog_takes_the_year_that_is_not_in_the_future() -> None:
    from aftershock.harness.run.logprobe import wall_time
    new_year = datetime.datetime(2027, 1, 1, 0, 0, 5).timestamp()
    found = wall_time("I1231 23:59:58.000000", new_year)
    assert found == pytest.approx(datetime.datetime(2026, 12, 31, 23, 59, 58).timestamp())


def test_an_iso_time_group_is_anchored_with_the_wall_clock_offset() -> None:
    offset = 1_700_000_000.0
    probe = LogProbe(pattern=r"(?P<time>\S+) step (?P<step>\d+)", event="step")
    stamp = datetime.datetime.fromtimestamp(offset + 50.25, datetime.UTC).isoformat()
    (event,) = line_events(f"{stamp} step 3", compile_probes([probe], "stdout"), read_t=51.0,
                           clock_offset=offset, started=0.0)
    assert event.fields["clock"] == "line"
    assert event.t == pytest.approx(50.25)


def test_a_line_without_a_time_is_written_after_the_stamped_line_before_it() -> None:
    """torchft's Rust half stamps its lines, its Python half does not: the commit line is
    known to come after the stamped one just before it in the same file."""
    offset = 1_700_000_000.0
    stamps = StreamStamps()
    rust = datetime.datetime.fromtimestamp(offset + 12.5).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    path = ft_file(0)
    assert not line_events(f"{rust} [INFO] [torchft::manager] - [Replica train_ddp_0] "
                           "should_commit completed should_commit=true",
                           compile_probes(FT, "logs"), read_t=12.6, clock_offset=offset,
                           started=0.0, defaults=file_fields(path), stamps=stamps)
    events: list[Any] = line_events(
        f"INFO:torchft.manager:[train_ddp_0:{U0}/0 - step 4] should_commit=True "
        "enough_replicas=True, errored=None", compile_probes(FT, "logs"), read_t=12.7,
        clock_offset=offset, started=0.0, defaults=file_fields(path), stamps=stamps)
    (step,) = events
    assert step.t == 12.7  # still the read time: only an upper bound
    assert step.fields["written_after"] == pytest.approx(12.5)
    (commit,) = metrics.commits(events)
    assert commit.written_after == pytest.approx(12.5)


# ------------------------------------------------------------------- what the user reads


def test_the_live_view_names_the_launcher_of_each_rank_0() -> None:
    """Each torchft replica group's torchrun starts its own rank 0: the live view says
    whose."""
    from aftershock.harness.reporting.report import describe
    shown = {describe(Event(1.0, "process_started", "launcher",
                            {"pid": pid, "role": "worker", "rank": 0, "agent": agent,
                             "generation": 0}))
             for pid, agent in ((100, 10), (200, 20))}
    assert shown == {"rank 0 of launcher pid 10 started (pid 100)",
                     "rank 0 of launcher pid 20 started (pid 200)"}
    (step,) = ft_lines(1, U1, 7, 3, 3, 1.0)[1:]
    assert describe(step) == "replica 1 rank 0 step 3"


def test_lost_steps_says_what_a_step_is() -> None:
    from aftershock.harness.scenario.spec import CountBudget
    from aftershock.harness.verdict.checks import _lost_steps
    events = two_launchers_split()
    check = _lost_steps(metrics.lost_steps(events), CountBudget(max=0), events)
    assert not check.passed
    assert "in steps as its step lines number them ('Epoch 0 | loss 1.0')" in check.message


def test_a_date_without_the_runs_wall_clock_anchor_keeps_the_read_time() -> None:
    """A timeline recorded before the anchor was: no guess, the line's read time stays."""
    probe = LogProbe(pattern=r"^(?P<time>[IWEF]\d{4} [\d:.]+) .* step (?P<step>\d+)",
                     event="step")
    (event,) = line_events("I1206 05:27:42.123456 12 x.py:1] step 3",
                           compile_probes([probe], "stdout"), read_t=5.0,
                           clock_offset=float("nan"), started=0.0)
    assert event.t == 5.0
    assert event.fields["clock"] == "read"
    assert "time_rejected" in event.fields
