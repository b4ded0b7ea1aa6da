"""The figures the docs state about the repository, and their links, checked against it.

A count in prose ("`make demo` runs the 21 scenarios") goes stale the day a scenario is
added, and a link the day a page or a heading moves. Each test reads the claim out of the
page and the fact out of the repository (the Makefile's recipe, the scenario folders as
`aftershock run` finds them, the files and headings a link names), so neither can drift.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from _helpers import ROOT

from aftershock.harness.scenario.load import discover

#: The longest a docs page may be: past it, a page is a notebook, not documentation.
MAX_PAGE_LINES = 400

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen", "twenty"]


def number(text: str) -> int:
    """A count as the docs write it: digits, or a number word up to twenty."""
    return int(text) if text.isdigit() else WORDS.index(text.lower())


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(found) > 10  # the docs, not an empty glob that passes every test
    return found


def make_recipe(target: str) -> list[str]:
    """The command lines of one Makefile target, as make runs them."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"{target}:")))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def demo_scenarios() -> list[Path]:
    """What `make demo` runs: the scenario files under the paths its `aftershock run` names."""
    runs = [line for line in make_recipe("demo") if "/aftershock run " in line]
    assert len(runs) == 1, make_recipe("demo")
    paths = [arg for arg in runs[0].split("aftershock run ", 1)[1].split()
             if not arg.startswith("-")]
    return discover([ROOT / path for path in paths])


DEMO_COUNT = re.compile(r"`make demo` runs the (\w+)\s+scenarios of `([^`]+)`")

#: "aftershock run scenarios/serving/   # the sixteen shipped scenarios": a count in a
#: command's comment, about the folder the command runs.
RUN_COUNT = re.compile(r"aftershock run (\S+?)/?\s+# the (\w+) (?:shipped )?scenarios")


def demo_count_errors(readme: str) -> list[str]:
    claim = DEMO_COUNT.search(readme)
    if not claim:
        return ["README.md no longer says how many scenarios `make demo` runs"]
    scenarios = demo_scenarios()
    errors = []
    if number(claim.group(1)) != len(scenarios):
        errors.append(f"README.md says `make demo` runs {claim.group(1)} scenarios; it runs "
                      f"{len(scenarios)}: {[p.name for p in scenarios]}")
    if not all(p.is_relative_to(ROOT / claim.group(2)) for p in scenarios):
        errors.append(f"`make demo` runs scenarios outside {claim.group(2)}")
    return errors


def run_count_errors(name: str, text: str) -> list[str]:
    errors = []
    for match in RUN_COUNT.finditer(text):
        found = discover([ROOT / match.group(1)])
        if number(match.group(2)) != len(found):
            errors.append(f"{name}: `aftershock run {match.group(1)}` says {match.group(2)} "
                          f"scenarios; the folder has {len(found)}")
    return errors


def test_the_readme_says_how_many_scenarios_make_demo_runs() -> None:
    assert demo_count_errors((ROOT / "README.md").read_text()) == []


def test_the_demo_scenarios_are_the_world_the_readme_describes() -> None:
    """README: the reference trainer, 2 replicas × 2 shards, under the three strategies."""
    systems = [yaml.safe_load(path.read_text())["system"] for path in demo_scenarios()]
    assert all(s["reference"] == "trainer" for s in systems)
    assert all(s["world"] == {"replicas": 2, "shards": 2} for s in systems)
    assert {s.get("recovery", "restart") for s in systems} == {"restart", "hot_spare", "elastic"}


def test_every_count_of_a_folders_scenarios_matches_the_folder() -> None:
    texts = {page.name: page.read_text() for page in pages()}
    assert any(RUN_COUNT.search(text) for text in texts.values()), (
        "no page counts a folder's scenarios any more: drop this test")
    assert [e for name, text in texts.items() for e in run_count_errors(name, text)] == []


def test_the_count_checks_catch_a_stale_number() -> None:
    """Yesterday's README and an old serving page: both counts are caught."""
    stale = "`make demo` runs the twelve\nscenarios of `scenarios/training/`"
    assert len(demo_count_errors(stale)) == 1
    assert demo_count_errors("`make demo` runs everything") != []
    line = "aftershock run scenarios/serving/      # the eleven shipped scenarios\n"
    assert len(run_count_errors("serving.md", line)) == 1


#: docs/benchmarks.md's tables, each the newest run's as its record in bench/results/ has it
#: (the record, and how the table's header row starts).
BENCH_TABLES = [
    ("results.md", "| row | what | steps/s |"),
    ("results.md", "| target | value | limit | met |"),
    ("results.md", "| ours | peer |"),
    ("serving.md", "| row | tokens/s |"),
    ("harness_overhead.md", "| scenario | code | run |"),
]


def table(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{len(starts)} tables start with {header!r}"
    end = starts[0]
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[starts[0]:end]


@pytest.mark.parametrize(("record", "header"), BENCH_TABLES)
def test_the_benchmarks_page_shows_the_newest_run(record: str, header: str) -> None:
    """A new run's record without the page's table updated (or the other way) fails here:
    copy the table from bench/results/ into docs/benchmarks.md."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    newest = (ROOT / "bench" / "results" / record).read_text()
    assert table(page, header) == table(newest, header)


def test_no_docs_page_is_over_the_limit() -> None:
    over = {page.name for page in (ROOT / "docs").glob("*.md")
            if len(page.read_text().splitlines()) > MAX_PAGE_LINES}
    assert not over, (
        f"over {MAX_PAGE_LINES} lines: {sorted(over)}; move the history of measurements to "
        "bench/results/ and keep the page task-shaped")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def links(text: str) -> list[str]:
    """Every Markdown link target outside fenced code blocks and inline code."""
    targets: list[str] = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            targets += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return targets


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped, spaces
    to hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not the repository's
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", [*pages(), *sorted((ROOT / "bench" / "results").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_and_heading(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_catches_a_moved_page_and_a_renamed_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## Not done yet\n\n## Not done yet\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#not-done-yet) [b](other.md#not-done-yet-1) "
                    "[c](gone.md) [d](other.md#renamed)\n```\n[e](in-code.md)\n```\n")
    assert broken_links(page) == ["gone.md: no such file", "other.md#renamed: no such heading"]
