"""The CLI's contract: exit codes, error format, catalogue, schema, report."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from _helpers import ROOT, cli, quick_scenario
from rich.console import Console

from aftershock.harness.reporting.report import LiveObserver, PlainObserver, junit_xml
from aftershock.harness.run.records import CheckResult, Event, RunResult

pytestmark = pytest.mark.timeout(120)


MISSPELT = """\
name: misspelt
system:
  reference: trainer
faults:
  - kind: process.kill
    target: {rank: 1}
    at: {step: 5}
    signall: SIGKILL
"""


@pytest.mark.parametrize("command", ["validate", "run"])
def test_misspelt_key_exits_2_with_position_and_no_traceback(
    tmp_path: Path, command: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MISSPELT)
    proc = cli(command, str(path))
    assert proc.returncode == 2
    assert f"{path}:8:5: faults.0.signall: unknown key 'signall'" in proc.stderr
    assert "did you mean 'signal'?" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_validate_accepts_the_shipped_scenarios() -> None:
    proc = cli("validate", str(ROOT / "scenarios"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") >= 3


def test_missing_path_exits_2() -> None:
    proc = cli("validate", "no/such/file.yaml")
    assert proc.returncode == 2
    assert "no/such/file.yaml:1:1: no such file or folder" in proc.stderr


def test_faults_catalogue_json() -> None:
    proc = cli("faults", "--json")
    assert proc.returncode == 0
    kinds = {row["kind"]: row for row in json.loads(proc.stdout)}
    assert {"process.kill", "process.term", "process.freeze"} <= set(kinds)
    assert "SIGSTOP" in kinds["process.freeze"]["caused_by"]


def test_unknown_fault_kind_in_catalogue_exits_2() -> None:
    proc = cli("faults", "nope.nothing")
    assert proc.returncode == 2
    assert "unknown fault kind 'nope.nothing'" in proc.stderr


def test_schema_is_json_schema() -> None:
    proc = cli("schema")
    schema = json.loads(proc.stdout)
    assert schema["title"] == "Aftershock scenario"
    assert "system" in schema["properties"]


def quick(tmp_path: Path, name: str, extra: str = "") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(quick_scenario(name, extra))
    return path


def freeze(rank: int, duration: str, rest: str) -> str:
    """A scenario's faults: one freeze of ``rank`` at step 3; ``rest``: its further keys
    (indented) or the scenario's ``expect:``."""
    return ("faults:\n  - kind: process.freeze\n    target: {rank: " + str(rank)
            + "}\n    at: {step: 3}\n    duration: " + duration + "\n" + rest)


@pytest.mark.slow
def test_run_writes_json_and_junit_and_report_rerenders(tmp_path: Path) -> None:
    scenario = quick(tmp_path, "quick-pass",
                     freeze(0, "200ms", "expect:\n  time_to_recover: {max: 10s}\n"))
    proc = cli("run", str(scenario), "--json", str(tmp_path / "out.json"),
               "--junit", str(tmp_path / "out.xml"), "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads((tmp_path / "out.json").read_text())
    assert record["passed"] is True
    assert {c["name"] for c in record["checks"]} == {"completes", "faults_injected",
                                                     "time_to_recover"}
    fault = record["faults"][0]
    assert fault["kind"] == "process.freeze"
    assert fault["healed_at_s"] - fault["injected_at_s"] == pytest.approx(0.2, abs=0.15)
    run_dir = Path(record["run_dir"])
    for name in ("events.jsonl", "scenario.yaml", "result.json", "logs/launcher.stdout.log"):
        assert (run_dir / name).exists(), name
    junit = (tmp_path / "out.xml").read_text()
    assert 'name="quick-pass"' in junit
    assert "<failure" not in junit
    again = cli("report", str(run_dir))
    assert again.returncode == 0
    assert "time_to_recover" in again.stdout


@pytest.mark.slow
def test_failed_check_exits_1_and_names_it(tmp_path: Path) -> None:
    scenario = quick(tmp_path, "quick-fail",
                     freeze(1, "300ms", "expect:\n  time_to_recover: {max: 1ms}\n"))
    proc = cli("run", str(scenario), "--json", "-", "--junit", str(tmp_path / "out.xml"),
               "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1
    (record,) = json.loads(proc.stdout)  # --json - : the record alone on stdout
    failed = [c for c in record["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["time_to_recover"]
    assert failed[0]["expected"] == "<= 1ms"
    # The table (on stderr when the record takes stdout): the failed row shows its
    # observed value next to the expected one, and the summary counts the failure.
    line = next(ln for ln in proc.stderr.splitlines() if "time_to_recover" in ln)
    assert "FAIL" in line
    assert "<= 1ms" in line
    assert "1 failed" in proc.stderr
    assert "<failure" in (tmp_path / "out.xml").read_text()


@pytest.mark.slow
def test_repetitions_that_never_came_fail_faults_injected(tmp_path: Path) -> None:
    # Two freezes asked for, an hour apart: the job is over long before the second. It
    # fired once, so it was not "never fired", and faults_injected passed as 1/1.
    scenario = quick(tmp_path, "quick-repeat",
                     freeze(0, "100ms", "    every: {time: 1h, times: 2}\n"))
    proc = cli("run", str(scenario), "--json", "-", "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (record,) = json.loads(proc.stdout)
    (check,) = [c for c in record["checks"] if c["name"] == "faults_injected"]
    assert not check["passed"], check
    assert check["observed"] == "1/2"
    assert "repetition 2 of 2 never came" in check["message"]


@pytest.mark.slow
def test_a_crashing_system_fails_completes(tmp_path: Path) -> None:
    path = tmp_path / "crash.yaml"
    command = f"[{sys.executable}, -c, 'raise SystemExit(3)']"
    path.write_text(f"name: crash\nsystem: {{command: {command}}}\n")
    proc = cli("run", str(path), "--json", "-", "--run-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1
    (record,) = json.loads(proc.stdout)
    assert record["checks"][0]["observed"] == "exit 3"


# ------------------------------------------------ output paths are checked before anything runs


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--run-dir", "{tmp}/a-file", "--run-dir {tmp}/a-file: cannot create the folder"),
        ("--run-dir", "/proc/aftershock/runs", "--run-dir /proc/aftershock/runs: cannot create"),
        ("--json", "/nonexistent/x.json", "--json /nonexistent/x.json: cannot write"),
        ("--json", "{tmp}", "--json {tmp}: cannot write"),
        ("--junit", "/nonexistent/x.xml", "--junit /nonexistent/x.xml: cannot write"),
    ],
)
def test_unusable_output_path_exits_2_before_running(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    (tmp_path / "a-file").write_text("not a folder\n")
    scenario = quick(tmp_path, "never-runs", "expect: {completes: true}\n")
    runs = tmp_path / "runs"
    args = ["run", str(scenario), option, value.format(tmp=tmp_path)]
    if option != "--run-dir":
        args += ["--run-dir", str(runs)]
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says.format(tmp=tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not runs.exists(), "the scenario ran although its record could not be kept"
    assert not (tmp_path / ".aftershock").exists()


# ---------------------------------------------------------- reports print data, never markup


MARKUP = "[/][bold red]x[/bold red] :smile: [link=file:///etc]y[/link]"


def marked_up_result(run_dir: Path) -> RunResult:
    """A run record whose every free-text field carries Rich markup, as a target may log it."""
    return RunResult(
        name=f"markup {MARKUP}", file=f"{run_dir}/s[/].yaml", passed=False, seed=0, duration_s=1.0,
        checks=(CheckResult(name="params_match", passed=False, observed=MARKUP,
                            expected="[/]", message=f"rank 0: {MARKUP} != [/]\x1b[31m\x00"),),
        metrics={"lost_steps": None}, faults=(), run_dir=str(run_dir),
    )


def test_report_prints_markup_in_a_record_as_text(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "x[/]y"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(marked_up_result(run_dir).to_json()))
    proc = cli("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "MarkupError" not in proc.stderr
    # The verdict lines are not folded like the table's cells: they show every field as written.
    assert f"FAILED markup {MARKUP} in 1.0s, seed 0\nrun dir {run_dir}\n" in proc.stdout
    assert "\x1b" not in proc.stdout  # off a terminal: no styles, and none from the data


def test_live_and_plain_views_print_markup_in_events_as_text() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=300, color_system=None)
    events = [
        Event(t=0.0, event="hello", source="rank0", fields={"rank": 0, "pid": "[/]"}),
        Event(t=0.1, event="fault_injected", source="harness",
              fields={"kind": "[/]", "rank": 0, "detail": MARKUP}),
        Event(t=0.2, event="failure_detected", source="rank0",
              fields={"rank": 0, "cause": MARKUP}),
    ]
    with LiveObserver(console, total_steps=10) as live:
        live.phase("s[/]", "run [/]")
        for event in events:
            live.event(event)
        live.finished(marked_up_result(Path("runs/x[/]y")))
    plain = PlainObserver(console)
    plain.phase("s[/]", "run")
    for event in events:
        plain.event(event)
    text = buffer.getvalue()
    assert f"FAILED markup {MARKUP} in 1.0s, seed 0\nrun dir runs/x[/]y" in text
    assert f"detected failure: {MARKUP}" in text


def test_junit_keeps_control_characters_out_of_the_xml() -> None:
    xml = junit_xml([marked_up_result(Path("runs/x"))])
    case = ElementTree.fromstring(xml.encode()).find("testcase")
    assert case is not None
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("message", "").endswith(f"rank 0: {MARKUP} != [/]\\x1b[31m\\x00")


@pytest.mark.slow
def test_markup_in_a_captured_digest_and_the_run_dir_keeps_the_record(tmp_path: Path) -> None:
    """A digest `[/]...` from a log line, in a run folder named `x[/]y`: the check fails
    (exit 1) and the JSON and JUnit records hold the run."""
    scenario = tmp_path / "markup.yaml"
    # The pid makes the digests differ, so the check's message quotes both.
    job = "import os; print(f'rank 0 params [/]{os.getpid()}', flush=True)"
    scenario.write_text(f"""\
name: markup
system:
  command: [{sys.executable}, -c, "{job}"]
  probes:
    - {{pattern: 'rank (?P<rank>\\d+) params (?P<digest>\\S+)', event: params}}
expect:
  params_match: fault_free
""")
    run_dir = tmp_path / "x[/]y"
    proc = cli("run", str(scenario), "--run-dir", str(run_dir), "--json",
               str(tmp_path / "out.json"), "--junit", str(tmp_path / "out.xml"),
               cache=tmp_path / "cache")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (record,) = json.loads((tmp_path / "out.json").read_text())
    (check,) = [c for c in record["checks"] if c["name"] == "params_match"]
    assert "[/]" in check["message"]
    assert check["message"].split(": ", 1)[1] in proc.stdout
    assert 'name="markup"' in (tmp_path / "out.xml").read_text()


@pytest.mark.parametrize(
    "damage",
    [{"duration_s": "soon"}, {"checks": [{"name": "x"}]}, {"checks": 5}, {"seed": [1]},
     {"metrics": {"a": "b"}}],
)
def test_report_on_a_damaged_record_exits_2(tmp_path: Path, damage: dict[str, object]) -> None:
    record = {**marked_up_result(tmp_path).to_json(), **damage}
    (tmp_path / "result.json").write_text(json.dumps(record))
    proc = cli("report", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"{tmp_path}/result.json:1:1: not a recorded run")
    assert "Traceback" not in proc.stderr


def test_docs_give_every_command_its_exit_codes() -> None:
    from aftershock.harness.cli import app

    table = (ROOT / "docs" / "cli.md").read_text().split("## Exit codes", 1)[1]
    names = [c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands]
    assert len(names) >= 6
    for name in names:
        assert f"| `aftershock {name}" in table, f"docs/cli.md has no exit codes for {name}"


def _as_unprivileged() -> list[str]:
    """A command prefix under which permission bits apply (root reads any file otherwise)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permission bits cannot be tested")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def test_unreadable_files_and_folders_are_named_with_a_position(tmp_path: Path) -> None:
    """Typer's own readable-path check printed a usage box without file:line:col, and
    stopped at the first unreadable path."""
    good = quick(tmp_path, "good")
    unreadable = quick(tmp_path, "unreadable")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "inside.yaml").write_text(good.read_text())
    sub = tmp_path / "tree" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "tree" / "ok.yaml").write_text(good.read_text())
    unreadable.chmod(0)
    locked.chmod(0)
    sub.chmod(0)
    try:
        proc = subprocess.run(
            [*_as_unprivileged(), sys.executable, "-m", "aftershock", "validate", str(good),
             str(unreadable), str(locked / "inside.yaml"), str(tmp_path / "tree")],
            capture_output=True, text=True, timeout=60, env={**os.environ},
        )
    finally:
        for path in (unreadable, locked, sub):
            path.chmod(0o755)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Usage:" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"{locked}/inside.yaml:1:1: cannot read: Permission denied",
        f"{sub}:1:1: cannot read folder: Permission denied",
        f"{unreadable}:1:1: cannot read scenario: Permission denied",
    ]
    assert proc.stdout.splitlines() == [f"ok {good}", f"ok {tmp_path}/tree/ok.yaml"]
