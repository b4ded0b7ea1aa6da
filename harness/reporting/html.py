"""The HTML report: one self-contained file per run (or per set of runs) to open and share.

Scripts and styles are inline and the page's Content-Security-Policy forbids every
fetch, so it works offline and leaks nothing when opened. Charts are drawn by
plotly.js's "basic" bundle (scatter, bar and pie: all the report draws), kept in
``harness/reporting/templates/`` as its authors publish it (plotly.js-basic-dist-min, MIT): about
1.2 MB per file instead of the full bundle's 4.8 MB, and no plotly Python package to
install (docs/report.md says why). The page is made with jinja2 from
``harness/reporting/templates/``, which escapes everything a run recorded.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from aftershock.harness.reporting import figures
from aftershock.harness.reporting.compare import Comparison, compare
from aftershock.harness.reporting.compare import show as _num
from aftershock.harness.reporting.report import NOTABLE, describe
from aftershock.harness.run.records import Event
from aftershock.harness.run.rundir import LOG_SHOWN, LogLine, ProcessLog, RecordedRun

#: Lines of one log shown in the page; the rest is named with its file.
LOG_LINES_SHOWN = 4000


#: The plotly.js bundle inlined in every page (its version is on its first lines; to
#: update it, replace the file with the same version's plotly-basic.min.js from npm).
PLOTLY_JS = "plotly-basic.min.js"


def plotly_js() -> str:
    """plotly.js's basic bundle, shipped with the package (no download, no plotly package)."""
    return _template(PLOTLY_JS)


def _template(name: str) -> str:
    return (
        resources.files("aftershock.harness.reporting")
        .joinpath("templates", name)
        .read_text(encoding="utf-8")
    )


def _script_safe(data: Any) -> str:
    """JSON that cannot end its <script> element early (``</script>`` in a log line)."""
    text = json.dumps(data, separators=(",", ":"), default=str, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _clean(value: Any) -> Any:
    """NaN and infinity are not JSON: a loss of NaN is shown as text."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class _Shown:
    lines: list[LogLine]
    cut: int  # bytes before the first line shown


def _log_lines(log: ProcessLog) -> _Shown:
    """The end of a log, where a crash says why: at most LOG_LINES_SHOWN lines within its
    last LOG_SHOWN bytes, read without holding the rest."""
    lines, cut = log.tail(LOG_SHOWN, LOG_LINES_SHOWN)
    return _Shown(lines, cut)


_STORY_CLASS = {
    "fault_injected": "fault",
    "fault_failed": "fault",
    "timeout": "fault",
    "failure_detected": "detect",
    "recovery_done": "recover",
}


def _story(run: RecordedRun) -> list[tuple[Event, str]]:
    """The notable events (the terminal's list), plus generations and checkpoints."""
    extra = {"hello", "checkpoint_saved", "exit", "worker_started", "membership"}
    return [
        (e, _STORY_CLASS.get(e.event, ""))
        for e in run.events
        if e.event in NOTABLE or e.event in extra
    ]


def _who(e: Event) -> str:
    if e.rank is not None:
        return f"rank {e.rank}"
    pid = e.fields.get("pid")
    return f"{e.source} (pid {pid})" if isinstance(pid, int) else e.source


def _show(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _show_s(value: float | None) -> str:
    return "-" if value is None else f"+{value:.3f}s"


def render(
    runs: Sequence[RecordedRun], *, notes: Sequence[Sequence[str]] = (), title: str | None = None
) -> str:
    """The page for one run, or for several with a comparison on top."""
    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(
        autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    template = env.from_string(_template("report.html.j2"))
    comparison: Comparison | None = compare([r.result for r in runs]) if len(runs) > 1 else None
    name = title or (
        runs[0].result.name
        if len(runs) == 1
        else f"{len(runs)} runs of " + ", ".join(sorted({r.result.name for r in runs}))
    )
    stories = {id(r): _story(r) for r in runs}

    def launched(run: RecordedRun) -> str:
        wall = run.t0 + (run.wall_offset or 0.0)
        return datetime.datetime.fromtimestamp(wall, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[
            :-3
        ]

    return template.render(
        title=f"Aftershock: {name}",
        runs=list(runs),
        notes=[list(n) for n in notes] or [[] for _ in runs],
        comparison=comparison,
        any_wall=any(r.wall_offset is not None for r in runs),
        css=Markup(_template("report.css")),
        js=Markup(_template("report.js")),
        plotly=Markup(plotly_js()),
        figure_json=lambda r: Markup(_script_safe(_clean(figures.figure(r)))),
        show=_show,
        show_s=_show_s,
        num=_num,
        describe=describe,
        who=_who,
        story=lambda r: stories[id(r)],
        log_lines=_log_lines,
        launched=launched,
    )


def write_html(
    runs: Sequence[RecordedRun], path: Path, *, notes: Sequence[Sequence[str]] = ()
) -> None:
    path.write_text(render(runs, notes=notes), encoding="utf-8")
