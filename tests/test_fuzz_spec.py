"""Property: whatever bytes a scenario file holds, `validate` says ok or names the problem.

Hypothesis mutates the shipped scenarios (bytes, lines, values of the wrong type, huge and
odd numbers, deep nesting, aliases, other encodings) and checks the loader's contract: the
file loads, or SpecError lists problems that each start with ``file:line:col:`` (a line
that exists); never another exception. A few batches go through the real command line
under CPU and memory limits: exit 0 or 2, no traceback, every file answered.

``make test`` runs a fixed sample (derandomized, about 10 s); ``make fuzz`` sets
AFTERSHOCK_FUZZ_EXAMPLES=10000 and explores at random, keeping failures in .hypothesis/.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from _helpers import ROOT, bounded_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from aftershock.harness.errors import SpecError
from aftershock.harness.scenario.load import _models_in, load_scenario
from aftershock.harness.scenario.spec import FAULT_MODELS, Scenario

EXAMPLES = int(os.environ.get("AFTERSHOCK_FUZZ_EXAMPLES", "0"))
FUZZING = EXAMPLES > 0
# The bounded sample is derandomized: `make test` checks the same inputs on every machine, and
# a failure there reproduces; exploration is `make fuzz`'s job.
IN_PROCESS = settings(
    max_examples=EXAMPLES or 300,
    derandomize=not FUZZING,
    database=settings.default.database if FUZZING else None,
    deadline=5000,  # ms: the brief's "within 5 s" for one file
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Files per command-line batch, and batches (each batch is one `aftershock validate`).
BATCH = 25
THROUGH_CLI = settings(IN_PROCESS, max_examples=max(2, EXAMPLES // 200), deadline=None)

SHIPPED = [p.read_bytes() for p in sorted((ROOT / "scenarios").rglob("*.yaml"))]

#: Values that have broken, or could break, a loader or a model: wrong types, odd numbers,
#: YAML tags, aliases, markup and control characters in data.
ODD_VALUES = [
    "~", "''", "[]", "{}", "-1", "0", "-0", "1e400", "-1e400", ".inf", "-.inf", ".nan",
    "9" * 5000, "-" + "9" * 300, "0x" + "f" * 40, "0b" + "1" * 100, "1_000_000_000_000_000",
    "190:20:30", "2024-13-45", "2024-01-01", "2024-01-01T25:61:00Z", "yes", "off", "True",
    "!!binary aGVsbG8=", "!!binary '%%%'", "!!python/object:os.system x", "!!int 12x",
    "!!float x", "!!timestamp 2024-13-45", "!!set {a, b}", "!!omap [a: 1]", "!!str 1",
    "*undefined", "&a [1, *a]", "'[/]'", "'[bold red]x[/]'", "':smile:'", "\"\\x00\\x1b\"",
    "\"\\uD800\"", "'%s%n'", "\"\\N\"", "'" + "a" * 5000 + "'", "[" * 40 + "]" * 40,
    "{" * 40 + "}" * 40, "99999999999999999h", "1e999s", "-5s", "0.0000001s", "1.5m",
    "'a{99999999999}'", "'" + "(" * 400 + ")" * 400 + "'", "{rank: 99999999999999999999}",
    "{replicas: 64, shards: 64}", "[SIGKILL, SIGTERM]", "<<: *a", "!!merge <<", "|\n  x\n  y",
    ">-\n  folded", "? [a, b]\n: c", "'\u202e\u200b'", "\"\\uFEFF\"", "- a\n- b",
]

#: Whole lines to insert: keys at any level, anchors, merges, documents.
ODD_LINES = [
    "---", "...", "%YAML 1.1", "%TAG ! tag:x,2000:", "seed: 2024-13-45", "  x: 1",
    "name: &n x", "description: *n", "<<: {name: y}", "? complex\n: key", "- item",
    "\t", "  ", "#", "key with spaces: 1", "'quoted': 2", "\"\\0\": 3", "1: int key",
    "null: nullkey", "[a, b]: listkey", "{a: 1}: mapkey", "system: &s {reference: trainer, "
    "env: *s}", "faults: [{kind: process.kill, target: {rank: 1}, at: {step: 1e400}}]",
]


def _alias_bomb(levels: int, width: int) -> bytes:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines).encode()


@st.composite
def mutated_scenarios(draw: st.DrawFn) -> bytes:
    """A shipped scenario, mutated one to four times, then perhaps re-encoded."""
    lines = draw(st.sampled_from(SHIPPED)).split(b"\n")
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["value"] * 8 + ["line"] * 2 + [
            "bytes", "insert-bytes", "delete", "duplicate", "swap", "indent", "truncate",
            "nest", "bomb"]))
        lines = lines or [b""]
        at = draw(st.integers(0, len(lines) - 1))
        line = lines[at]
        if op == "value" and b": " in line:
            key = line.split(b": ", 1)[0]
            lines[at] = key + b": " + draw(st.sampled_from(ODD_VALUES)).encode(
                "utf-8", "surrogatepass")
        elif op == "bytes" and line:
            col = draw(st.integers(0, len(line) - 1))
            lines[at] = line[:col] + bytes([draw(st.integers(0, 255))]) + line[col + 1:]
        elif op == "insert-bytes":
            col = draw(st.integers(0, len(line)))
            lines[at] = line[:col] + draw(st.binary(min_size=1, max_size=6)) + line[col:]
        elif op == "delete":
            del lines[at]
        elif op == "duplicate":
            lines.insert(at, line)
        elif op == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], lines[at]
        elif op == "line":
            lines.insert(at, draw(st.sampled_from(ODD_LINES)).encode())
        elif op == "indent":
            lines[at] = b" " * draw(st.integers(0, 12)) + line.lstrip(b" ")
        elif op == "truncate":
            lines = lines[: at + 1]
            lines[-1] = line[: draw(st.integers(0, len(line)))]
        elif op == "nest":
            depth = draw(st.integers(1, 2000))
            opener, closer = draw(st.sampled_from([(b"[", b"]"), (b"{a: ", b"}")]))
            lines.insert(at, b"description: " + opener * depth + closer * depth)
        elif op == "bomb":
            lines.append(_alias_bomb(draw(st.integers(1, 12)), draw(st.integers(1, 12))))
    data = b"\n".join(lines)
    encoding = draw(st.sampled_from(
        [None] * 30 + ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1", "utf-8-sig"]))
    if encoding is not None:
        data = data.decode("utf-8", "replace").encode(encoding, "replace")
    return data


def _field_names() -> list[str]:
    """Every key the schema knows, so that random trees hit real fields with wrong values."""
    names: set[str] = set()
    todo: list[type[BaseModel]] = [Scenario, *FAULT_MODELS.values()]
    while todo:
        model = todo.pop()
        for name, field in model.model_fields.items():
            names.add(name)
            todo.extend(m for m in _models_in(field.annotation) if m.__name__ not in names)
            names.add(model.__name__)
    return sorted(n for n in names if not n[0].isupper())


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
    st.sampled_from(["500ms", "2s", "1h", "-1s", "process.kill", "trainer", "server",
                     "fault_free", "replay", "heap", "random", "launcher", "SIGKILL", "[/]"]),
)
_TREES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(_field_names()) | st.text(max_size=6), children,
                        max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def rewritten_scenarios(draw: st.DrawFn) -> bytes:
    """A shipped scenario with one to three of its values replaced by random trees."""
    data = yaml.safe_load(draw(st.sampled_from(SHIPPED)))
    for _ in range(draw(st.integers(1, 3))):
        parent: Any = data
        key: Any = None
        node: Any = data
        while isinstance(node, dict | list) and node and draw(st.integers(0, 3)):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, draw(st.sampled_from(keys))
            node = node[key]
        if key is None:
            continue
        parent[key] = draw(_TREES)
    return yaml.safe_dump(data, allow_unicode=draw(st.booleans())).encode()


def scenario_files() -> st.SearchStrategy[bytes]:
    return st.one_of(mutated_scenarios(), rewritten_scenarios())


def _lines_in(data: bytes) -> int:
    """How many lines a problem may point at: PyYAML counts CR, NEL, LS and PS as breaks."""
    text = data.decode("utf-8", "replace")
    return len(re.findall(r"\r\n|[\r\n\x85\u2028\u2029]", text)) + 1


def check_problem(problem: str, path: Path, data: bytes) -> None:
    match = re.match(rf"{re.escape(str(path))}:(\d+):(\d+): \S", problem)
    assert match, f"a problem without file:line:col: {problem!r}"
    line, col = int(match.group(1)), int(match.group(2))
    assert 1 <= line <= _lines_in(data), problem
    assert col >= 1, problem
    assert "\n" not in problem, problem


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@IN_PROCESS
@given(data=scenario_files())
def test_any_file_loads_or_names_its_problem(work_dir: Path, data: bytes) -> None:
    path = work_dir / "scenario.yaml"
    path.write_bytes(data)
    try:
        load_scenario(path)
    except SpecError as exc:
        problems = exc.problems
    else:
        event("loads")
        return
    assert problems
    for problem in problems:
        check_problem(problem, path, data)
    # `make fuzz` shows these (--hypothesis-show-statistics): which layer refused the file.
    first = problems[0].split(": ", 1)[1]
    layers = {"invalid YAML": "YAML", "not UTF-8": "encoding", "the file is UTF": "encoding",
              "control character": "encoding", "duplicate key": "YAML",
              "a key must be": "YAML", "a scenario must be": "not a mapping"}
    event("refused: " + next((layer for start, layer in layers.items()
                              if first.startswith(start)), "schema"))


@THROUGH_CLI
@given(files=st.lists(scenario_files(), min_size=BATCH, max_size=BATCH))
def test_validate_exits_0_or_2_in_bounds(work_dir: Path, files: list[bytes]) -> None:
    folder = work_dir / "batch"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    paths = [folder / f"s{index:02}.yaml" for index in range(len(files))]
    for path, data in zip(paths, files, strict=True):
        path.write_bytes(data)
    # One process for the batch: the 5 CPU s and 300 MB hold for all of its files together.
    result = bounded_cli("validate", *map(str, paths), cpu_s=5, wall_s=60)
    assert not result.timed_out, "validate hung"
    assert result.returncode in (0, 2), result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.max_rss_mb < 300
    answered = {line.removeprefix("ok ") for line in result.stdout.splitlines()}
    for line in result.stderr.splitlines():
        path = Path(line.split(":", 1)[0])
        assert path in paths, f"a problem line that names no file: {line!r}"
        check_problem(line, path, files[paths.index(path)])
        answered.add(str(path))
    assert answered == set(map(str, paths)), "a file got no answer"
    assert (result.returncode == 0) == (not result.stderr)
