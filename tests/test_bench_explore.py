"""`python -m bench.explore`: what it reads from an exploration (the explore CLI's JSON, a
run's timeline, `python -X importtime`) and how it judges an A/B pair (the ratio, and any
verdict that differs fails the comparison). No torch job runs here: the CLI is a stand-in
script that writes what `aftershock explore --json` writes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from bench.explore import (
    AROUND,
    PHASES,
    cli_module,
    compare,
    explore_once,
    importtime_total,
    markdown,
    ratio,
    read_events,
    split_events,
    split_exploration,
    verdict_differences,
)

PASS = ["search", "process.kill rank 0 @ step 11", "pass"]
FAIL = ["search", "process.kill rank 0 @ step 11", "fail"]
OTHER = ["search", "net.reset rank 1 @ step 20", "pass"]


def test_equal_verdicts_have_no_difference() -> None:
    assert verdict_differences([PASS, OTHER], [PASS, OTHER]) == []


def test_a_changed_verdict_a_changed_schedule_and_a_missing_run_each_differ() -> None:
    assert verdict_differences([FAIL], [PASS]) == [
        "run 1: this search process.kill rank 0 @ step 11 fail; "
        "baseline search process.kill rank 0 @ step 11 pass"]
    assert len(verdict_differences([OTHER], [PASS])) == 1
    assert verdict_differences([PASS, OTHER], [PASS]) == [
        "run 2: this search net.reset rank 1 @ step 20 pass; baseline (no run)"]


def test_ratio_is_this_over_baseline_and_none_without_both() -> None:
    assert ratio(22.0, 5.5) == 4.0
    assert ratio(None, 5.5) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None


def row(system: str, code: str, verdicts: list[list[str]], per_minute: float) -> dict[str, Any]:
    return {"system": system, "code": code, "verdicts": verdicts, "exit": 0, "runs":
            len(verdicts), "runs_per_minute": per_minute, "end_to_end_per_minute":
            per_minute / 2, "wall_s": 60.0, "twin": "ran (x)", "loadavg_start": 1.0,
            "loadavg_end": 2.0, "error": None}


def test_compare_gives_ratios_and_flags_a_differing_verdict_or_a_missing_row() -> None:
    rows = [row("restart", "this", [PASS], 20.0), row("restart", "baseline", [PASS], 5.0),
            row("command", "this", [FAIL], 10.0), row("command", "baseline", [PASS], 10.0),
            row("hot_spare", "this", [PASS], 8.0)]
    found = {c["system"]: c for c in compare(rows, ["restart", "command", "hot_spare"])}
    assert found["restart"] == {"system": "restart", "runs_per_minute": 4.0,
                                "end_to_end_per_minute": 4.0, "differences": []}
    assert len(found["command"]["differences"]) == 1
    assert found["command"]["runs_per_minute"] == 1.0
    assert "baseline did not run" in found["hot_spare"]["differences"]
    record = {"command": "python -m bench.explore", "baseline_ref": "HEAD~1",
              "machine": {"description": "test", "loadavg_start": [1.5, 1.0, 1.0],
                          "loadavg_end": [1.0, 1.0, 1.0]},
              "settings": {"seed": 1, "runs": 1, "shrink_runs": 0, "max_faults": None},
              "rows": rows, "comparisons": list(found.values())}
    text = markdown(record)
    assert "| `restart` | 4.0 | 4.0 | yes |" in text
    assert "| `command` | 1.0 | 5.0 | NO: run 1:" not in text  # end to end is 5 / 5
    assert "| `command` | 1.0 | 1.0 | NO: run 1: this search" in text
    # Other work when the bench began (a load of 1.5 on 1 core) is said, so no one reads a
    # speed-up into it; the bench's own runs raising the load during it (2.0) are not.
    assert "not a measurement of speed" in text
    record["machine"]["cores"] = 2
    assert "not a measurement of speed" not in markdown(record)


def test_importtime_sums_only_the_top_level_imports() -> None:
    stderr = textwrap.dedent("""\
        import time: self [us] | cumulative | imported package
        import time:       100 |        100 |   _io
        import time:       200 |        300 | encodings
        import time:       300 |        300 |     typing_extensions
        import time:      1000 |    1500000 | torch
        import time:        50 |     250000 | torch.distributed
        """)
    # A nested import is printed before its parent, indented two spaces more per level.
    assert importtime_total(stderr) == 1.7503


def event(t: float, name: str, source: str = "rank0", **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": name, "source": source, **fields}


#: A restart run: torchrun sees its workers after 2 s, they say hello at 7, train to step
#: 11, rank 0 is killed, the world restarts (new workers at 8.5, hello at 14), recomputes
#: steps 11 (from the step-10 checkpoint) and goes on from 12 to the end.
RESTART = [
    event(0.0, "launch", "harness"),
    event(2.0, "process_started", "launcher", generation=0),
    event(7.0, "hello", generation=0), event(7.0, "hello", "rank1", generation=0),
    event(7.1, "step", step=1, generation=0),
    event(7.5, "step", step=11, generation=0),
    event(7.6, "fault_injected", "harness"),
    event(7.7, "failure_detected", "rank1", generation=0),
    event(8.0, "process_exited", "harness"),
    event(8.5, "process_started", "launcher", generation=1),
    event(14.0, "hello", generation=1),
    event(14.2, "step", step=11, generation=1),
    event(14.4, "step", step=12, generation=1),
    event(15.0, "step", step=60, generation=1),
    event(15.1, "params", generation=1),
    event(15.2, "exit", generation=1),
    event(16.5, "teardown", "harness"),
    event(16.6, "run_end", "harness"),
]


def test_a_restart_runs_seconds_go_to_one_phase_each() -> None:
    split = split_events(RESTART)
    assert set(split) == set(PHASES)
    assert abs(sum(split.values()) - 16.6) < 1e-6
    expected = {"launcher start": 2.0, "rank start": 5.0 + 5.5, "to first step": 0.1 + 0.2,
                "training": 0.5 + 0.7, "recovery": 0.9 + 0.2, "finish": 0.1,
                "launcher exit": 1.3, "harness checks": 0.1}
    for phase, seconds in expected.items():
        assert abs(split[phase] - seconds) < 1e-6, phase


def test_ranks_started_without_a_launcher_are_the_ranks_start() -> None:
    split = split_events([event(0.0, "launch", "harness"), event(4.0, "hello"),
                          event(4.5, "step", step=1), event(5.0, "exit"),
                          event(5.5, "teardown", "harness"), event(5.6, "run_end", "harness")])
    assert split["launcher start"] == 0.0
    assert split["rank start"] == 4.0


def test_a_run_without_its_end_is_not_split() -> None:
    assert split_events(RESTART[:-1]) == {}


def test_a_cut_last_line_is_left_out_and_the_harness_time_is_what_the_span_leaves(
        tmp_path: Path) -> None:
    run = tmp_path / "out" / "runs" / "x" / "001-search"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in RESTART) + '{"t": 17.0, "event": "sa')
    assert len(read_events(run)) == len(RESTART)
    # The run found no twin in the cache and ran its own first (5 s), in its folder.
    (run / "fault_free").mkdir()
    (run / "fault_free" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        event(100.0, "launch", "harness"), event(104.0, "hello"), event(104.5, "step", step=1),
        event(104.9, "teardown", "harness"), event(105.0, "run_end", "harness")]))
    result = {"out": str(tmp_path / "out"), "wall_s": 30.0,
              "attempts": [{"index": 1, "stage": "search", "run_dir": str(run),
                            "duration_s": 22.6}]}
    split = split_exploration(result)
    assert split["runs"][0]["phases"]["twin"] == 5.0
    assert split["runs"][0]["phases"][AROUND] == 1.0
    assert split["totals"]["twin"] == 5.0
    assert split["totals"]["CLI start, hypothesis, between runs"] == 7.4


def test_explore_once_reads_the_clis_json_and_keeps_a_failed_clis_output(
        tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "aftershock").mkdir(parents=True)
    assert cli_module(checkout) == "harness"
    # A stand-in CLI: writes what `aftershock explore --json FILE` writes, and exits with
    # the code the scenario's name asks for.
    (checkout / "aftershock" / "__init__.py").write_text("")
    (checkout / "aftershock" / "__main__.py").write_text(textwrap.dedent("""\
        import json, sys
        args = sys.argv[1:]
        code = int(args[1].rsplit("-", 1)[1].split(".")[0])
        attempt = {"index": 1, "stage": "search", "schedule": "process.kill rank 0 @ step 11",
                   "verdict": "fail" if code == 1 else "pass", "failed": [], "reason": "",
                   "duration_s": 1.5, "run_dir": "r"}
        if code != 3:
            json.dump([{"runs_per_minute": 40.0, "twin": "cached (x)", "stopped": "budget",
                        "attempts": [attempt]}], open(args[args.index("--json") + 1], "w"))
        print("the harness failed" if code == 3 else "ok")
        sys.exit(code)
        """))
    assert cli_module(checkout) == "aftershock"
    found = explore_once(checkout, Path("space-1.yaml"), tmp_path / "w1", runs=1, seed=1,
                         shrink_runs=0, max_faults=None)
    assert found["error"] is None
    assert found["verdicts"] == [["search", "process.kill rank 0 @ step 11", "fail"]]
    assert found["runs"] == 1
    assert found["runs_per_minute"] == 40.0
    assert found["end_to_end_per_minute"] is not None
    failed = explore_once(checkout, Path("space-3.yaml"), tmp_path / "w3", runs=1, seed=1,
                          shrink_runs=0, max_faults=None)
    assert failed["exit"] == 3
    assert "the harness failed" in failed["error"]
    assert failed["verdicts"] == []
