"""The HTML report, opened in headless Chromium: it loads with no console error, asks the
network for nothing, draws one series per rank and one marker per injected fault, and its
screenshot is not blank.

The pages are made from saved run folders of shipped scenarios (tests/fixtures/recorded/,
recorded by `aftershock run`; see docs/report.md), not by running them here. The oracles
are the run's own files (events.jsonl, scenario.yaml), read independently of the report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _browser import Browser, chromium, png_pixels
from _helpers import cli, read_events

from aftershock.harness.reporting.html import render
from aftershock.harness.run.rundir import load_run

RUNS = Path(__file__).parent / "fixtures" / "recorded"
TRAINING = RUNS / "train-kill-rank-hot-spare"
SERVING = RUNS / "serve-kill-worker"
READY = "window.aftershock && window.aftershock.ready"

needs_browser = pytest.mark.skipif(
    chromium() is None,
    reason="headless Chromium is not installed (apt-get install chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield b
    finally:
        b.close()


def _page(tmp_path: Path, *runs: Path) -> Path:
    out = tmp_path / "report.html"
    made = cli("report", *map(str, runs), "--html", str(out))
    assert made.returncode == 0, made.stdout + made.stderr
    return out


def _traces(browser: Browser, session: str, chart: int = 0) -> list[dict]:
    """What plotly drew: each trace's role and how many points and lines reached the SVG."""
    return list(browser.evaluate(session, f"""(function () {{
        var div = window.aftershock.figures[{chart}].div;
        return div._fullData.map(function (t) {{
            // Each trace's SVG group is classed with its uid.
            var g = div.querySelector('.scatterlayer .trace' + t.uid);
            var line = g ? g.querySelector('path.js-line') : null;
            return {{name: t.name, role: t.meta && t.meta.role,
                     points: g ? g.querySelectorAll('path.point').length : 0,
                     line: !!(line && line.getAttribute('d'))}};
        }});
    }})()"""))


def _not_blank(png: bytes) -> None:
    width, height, rows = png_pixels(png)
    assert width == 1400  # the window's width; its height less the (headless) browser's own
    assert height > 600
    pixels = [row[i:i + 3] for row in rows[::4] for i in range(0, len(row), 12)]
    colours = set(pixels)
    inked = sum(1 for p in pixels if p != b"\xff\xff\xff" and p != b"\xfa\xfa\xfa")
    assert len(colours) > 50, len(colours)
    assert inked > len(pixels) * 0.05, inked / len(pixels)


def _clean_load(page_console: list[str], exceptions: list[str], requests: list[str],
                url: str) -> None:
    assert page_console == []
    assert exceptions == []
    assert requests == [url]  # the file itself, and nothing else


@needs_browser
def test_training_report_in_a_browser(tmp_path: Path, browser: Browser) -> None:
    html = _page(tmp_path, TRAINING)
    url = html.as_uri()
    session, page = browser.open(url, ready=READY)
    _clean_load(page.console, page.exceptions, page.requests, url)
    traces = _traces(browser, session)
    # One series per rank of the scenario's world, each drawn as a line.
    system = yaml.safe_load((TRAINING / "scenario.yaml").read_text())["system"]
    world = system["world"]["replicas"] * system["world"]["shards"]
    ranks = [t for t in traces if t["role"] == "rank"]
    assert sorted(t["name"] for t in ranks) == [f"rank {r}" for r in range(world)]
    assert all(t["line"] for t in ranks)
    steps = read_events(TRAINING / "events.jsonl", "step")
    for t in ranks:
        rank = int(t["name"].split()[1])
        assert t["points"] == sum(1 for e in steps if e["rank"] == rank)
    # One marker per injected fault.
    faults = read_events(TRAINING / "events.jsonl", "fault_injected")
    (marker,) = [t for t in traces if t["role"] == "fault"]
    assert marker["points"] == len(faults) == 1
    # Detection and recovery are marked with the metric values.
    text = browser.evaluate(session, "document.querySelector('.chart').textContent")
    metrics = json.loads((TRAINING / "result.json").read_text())["metrics"]
    assert f"detected +{metrics['time_to_detect_s'] * 1000:.0f} ms" in text
    assert f"recovered +{metrics['time_to_recover_s']:.2f} s" in text
    _not_blank(browser.screenshot(session))


@needs_browser
def test_serving_report_in_a_browser(tmp_path: Path, browser: Browser) -> None:
    html = _page(tmp_path, SERVING)
    url = html.as_uri()
    session, page = browser.open(url, ready=READY)
    _clean_load(page.console, page.exceptions, page.requests, url)
    traces = _traces(browser, session)
    sent = read_events(SERVING / "events.jsonl", "request_sent")
    done = read_events(SERVING / "events.jsonl", "request_done")
    # A row per request: its hover point, and its streaming line.
    (rows,) = [t for t in traces if t["role"] == "hover"]
    assert rows["points"] == len(sent) == 40
    (streaming,) = [t for t in traces if t["role"] == "request"]
    assert streaming["line"]
    (tokens,) = [t for t in traces if t["role"] == "token"]
    assert tokens["points"] == sum(len(e["times"]) for e in done)
    (moved,) = [t for t in traces if t["role"] == "migrated"]
    assert moved["points"] == len(read_events(SERVING / "events.jsonl", "request_migrated"))
    faults = read_events(SERVING / "events.jsonl", "fault_injected")
    (marker,) = [t for t in traces if t["role"] == "fault"]
    assert marker["points"] == len(faults) == 1
    assert sum(1 for t in traces if t["role"] == "latency") == 4  # ttft, tpot: p50, p99
    _not_blank(browser.screenshot(session))


@needs_browser
def test_the_clock_switches_to_wall_time(tmp_path: Path, browser: Browser) -> None:
    html = _page(tmp_path, TRAINING)
    session, _ = browser.open(html.as_uri(), ready=READY)
    launch = read_events(TRAINING / "events.jsonl", "launch")[0]
    first = read_events(TRAINING / "events.jsonl", "step")[0]
    browser.evaluate(session, "document.getElementById('clock').value = 'wall';"
                              "document.getElementById('clock').dispatchEvent("
                              "new Event('change'))")
    browser.drain(0.5)
    axis = browser.evaluate(session, "window.aftershock.figures[0].div._fullLayout.xaxis.type")
    assert axis == "date"
    x0 = browser.evaluate(session, "window.aftershock.figures[0].div.data[0].x[0]")
    assert x0 == pytest.approx((first["t"] + launch["wall_offset"]) * 1000, abs=1)
    stamp = browser.evaluate(session, "document.querySelector('.story .lt').textContent")
    assert stamp.startswith("20")  # a date, no longer "+0.000s"


@needs_browser
def test_runs_compared_in_one_page(tmp_path: Path, browser: Browser) -> None:
    html = _page(tmp_path, TRAINING, SERVING)
    url = html.as_uri()
    session, page = browser.open(url, ready=READY)
    _clean_load(page.console, page.exceptions, page.requests, url)
    assert browser.evaluate(session, "window.aftershock.figures.length") == 2
    rows = browser.evaluate(session, """Array.from(document.querySelectorAll('#compare tr'))
        .map(function (r) { return Array.from(r.cells).map(function (c) {
            return c.textContent.trim(); }); })""")
    detect = next(r for r in rows if r[0] == "time_to_detect_s")
    values = [json.loads((r / "result.json").read_text())["metrics"]["time_to_detect_s"]
              for r in (TRAINING, SERVING)]
    # metric, median, min, max, measured in, then each run's value
    assert detect[1:5] == [f"{sum(values) / 2:.3f}", f"{min(values):.3f}",
                           f"{max(values):.3f}", "2/2"]
    assert detect[5:] == [f"{v:.3f}" for v in values]
    verdicts = next(r for r in rows if r[0].startswith("#1"))
    assert "FAIL" not in verdicts
    assert "PASS" in verdicts


def test_everything_a_run_recorded_is_escaped(tmp_path: Path) -> None:
    """A log line or an event field holding markup is shown as text: it can neither end the
    page's scripts nor add elements."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    for name in ("result.json", "scenario.yaml"):
        (run / name).write_bytes((TRAINING / name).read_bytes())
    evil = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"
    lines = (TRAINING / "events.jsonl").read_text().splitlines()
    detected = json.dumps({"t": json.loads(lines[-1])["t"], "event": "failure_detected",
                           "source": "rank0", "rank": 0, "cause": evil})
    (run / "events.jsonl").write_text("\n".join([*lines, detected]) + "\n")
    (run / "logs" / "launcher.stderr.log").write_text(evil + "\n")
    page = render([load_run(run)])
    assert "<img src=x" not in page
    assert "<script>alert" not in page
    # The page's own scripts only: the figure data, plotly.js and the report's code.
    assert page.count("<script") == 3


def test_comparison_names_the_runs_that_failed() -> None:
    """Per metric the median and spread over the runs that measured it; per check, which
    runs failed it (terminal and HTML read the same Comparison)."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from aftershock.harness.reporting.compare import compare, render_comparison
    from aftershock.harness.run.records import CheckResult
    from aftershock.harness.run.rundir import read_result

    base = read_result(TRAINING / "result.json")
    slow = CheckResult("time_to_recover", False, 9.0, "<= 3s", "recovery took 9s")
    runs = [
        replace(base, metrics={**base.metrics, "time_to_recover_s": 1.0}),
        replace(base, passed=False, metrics={**base.metrics, "time_to_recover_s": 9.0},
                checks=tuple(slow if c.name == "time_to_recover" else c for c in base.checks)),
        replace(base, metrics={**base.metrics, "time_to_recover_s": None}),
    ]
    comparison = compare(runs)
    spread = next(s for s in comparison.spreads if s.metric == "time_to_recover_s")
    assert (spread.median, spread.low, spread.high) == (5.0, 1.0, 9.0)
    assert len(spread.measured) == 2  # the run that never recovered is not a zero
    assert comparison.failures()["time_to_recover"] == [1]
    assert comparison.failures()["completes"] == []
    buffer = io.StringIO()
    render_comparison(comparison, Console(file=buffer, width=80))
    text = buffer.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines())
    row = next(line for line in text.splitlines() if "time_to_recover " in line)
    assert "2/3" in row
    assert "#2" in row


@pytest.mark.slow
def test_run_writes_html_and_trace_and_junit_links_them(tmp_path: Path) -> None:
    from xml.etree import ElementTree as ET

    from _helpers import quick_scenario

    scenario = tmp_path / "quick.yaml"
    scenario.write_text(quick_scenario("quick-html", """\
faults:
  - kind: process.freeze
    target: {rank: 1}
    at: {step: 3}
    duration: 200ms
expect:
  time_to_recover: {max: 10s}
"""))
    html, trace, junit = tmp_path / "r.html", tmp_path / "r.trace.json", tmp_path / "r.xml"
    done = cli("run", str(scenario), "--run-dir", str(tmp_path / "runs"), "--html", str(html),
               "--trace", str(trace), "--junit", str(junit), "--repeat", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    # The launch records the wall clock's offset from the timeline's monotonic clock.
    launch = read_events(tmp_path / "runs" / "quick-html-1" / "events.jsonl", "launch")[0]
    assert launch["t"] + launch["wall_offset"] == pytest.approx(
        (tmp_path / "runs" / "quick-html-1" / "scenario.yaml").stat().st_mtime, abs=60)
    cases = ET.parse(junit).getroot().findall("testcase")
    assert len(cases) == 2
    for index, case in enumerate(cases, start=1):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert (Path(props["run_dir"]) / "events.jsonl").is_file()
        assert props["html"] == f"{html.resolve()}#run-{index}"
    page = html.read_text()
    assert html.stat().st_size < MAX_PAGE_BYTES  # two runs and their comparison
    assert 'id="run-1"' in page
    assert 'id="run-2"' in page
    assert 'id="compare"' in page
    document = json.loads(trace.read_text())
    names = [e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"]
    assert any(n.startswith("quick-html #2") for n in names)
    # The same runs again from their folder (a --repeat's), the runs compared.
    again = cli("report", str(tmp_path / "runs"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 runs" in again.stdout
    assert "#2 PASSED" in again.stdout


#: A report page must stay small enough to mail and attach to a ticket (docs/report.md).
MAX_PAGE_BYTES = 1_500_000

#: What a core install (`pip install aftershock`, no extras) lacks.
EXTRAS_ONLY = ("plotly", "docker", "hypothesis")

_BLOCK = f"""\
import sys


class _NotInstalled:
    # As if a core install: these packages come only with an extra.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRAS_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def test_core_dependencies_leave_out_plotly_docker_and_hypothesis() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    core = " ".join(project["project"]["dependencies"]).lower()
    assert [name for name in EXTRAS_ONLY if name in core] == []
    extras = project["project"]["optional-dependencies"]
    assert any(d.startswith("hypothesis") for d in extras["explore"])
    assert any(d.startswith("docker") for d in extras["nodes"])


def test_report_page_size(tmp_path: Path) -> None:
    """The recorded runs' pages, alone and compared in one page, stay under the bound."""
    for runs in ([TRAINING], [SERVING], [TRAINING, SERVING]):
        page = render([load_run(r) for r in runs])
        assert len(page.encode()) < MAX_PAGE_BYTES, (runs, len(page.encode()))


@pytest.mark.slow
def test_a_core_install_runs_and_writes_a_small_report(tmp_path: Path) -> None:
    """With plotly, docker and hypothesis unimportable (in every process of the run), a
    scenario validates, runs with a fault and writes its HTML report, under 1.5 MB."""
    import subprocess
    import sys

    from _helpers import quick_scenario

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    scenario = tmp_path / "quick.yaml"
    scenario.write_text(quick_scenario("quick-core", """\
faults:
  - kind: process.kill
    target: {rank: 1}
    at: {step: 3}
"""))
    html = tmp_path / "r.html"

    def aftershock(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aftershock", *args], capture_output=True,
                              text=True, timeout=110, env=env)

    blocked = subprocess.run([sys.executable, "-c", "import hypothesis"], env=env,
                             capture_output=True, text=True, timeout=30)
    assert "No module named 'hypothesis'" in blocked.stderr  # the block itself works
    checked = aftershock("validate", str(scenario))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    done = aftershock("run", str(scenario), "--run-dir", str(tmp_path / "runs"),
                      "--html", str(html))
    assert done.returncode in (0, 1), done.stdout + done.stderr  # ran; its verdict is its own
    assert "No module named" not in done.stdout + done.stderr
    assert len(read_events(tmp_path / "runs" / "quick-core" / "events.jsonl",
                           "fault_injected")) == 1
    page = html.read_text()
    assert page.count('class="figure"') == 1
    assert '"role":"fault"' in page
    assert html.stat().st_size < MAX_PAGE_BYTES


def test_explore_without_hypothesis_names_the_extra(tmp_path: Path) -> None:
    """A core install has no hypothesis: `aftershock explore` says which extra to install
    (exit 2, invalid input) instead of a harness error with a traceback."""
    import subprocess
    import sys

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BLOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(
        [sys.executable, "-m", "aftershock", "explore", "scenarios/explore/elastic.yaml",
         "--runs", "1"], capture_output=True, text=True, timeout=60, env=env,
        cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'aftershock[explore]'" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
