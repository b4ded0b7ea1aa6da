"""Hostile scenario files: every one is an invalid-input error naming file:line:col, in bounds.

Each case here was a traceback (exit 1) or an exhausted machine before the loader bounded
what it reads: bytes, characters, numbers, nesting, aliases. The in-process tests pin the
message and position; the CLI tests pin the exit code and the resources one process used.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _helpers import bounded_cli

from aftershock.harness.errors import SpecError
from aftershock.harness.scenario._yaml import MAX_FILE_BYTES
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import TrainerSystem

BASE = "name: x\nsystem: {reference: trainer}\n"


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The billion-laughs shape: each level holds ``width`` aliases of the level below."""
    lines = [BASE.rstrip("\n"), f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def nested(depth: int) -> str:
    return BASE + "description: " + "[" * depth + "]" * depth + "\n"


# (file bytes, where the problem is, what the message says)
MALFORMED: dict[str, tuple[bytes, str, str]] = {
    "nul": (b"name: x\x00\nsystem: {reference: trainer}\n", "1:8",
            "control character U+0000 is not allowed"),
    "bell": (b"name: x\x07y\nsystem: {reference: trainer}\n", "1:8", "U+0007"),
    "escape": (b"name: x\nsystem: {reference: trainer}\ndescription: '\x1b[31m'\n", "3:15",
               "U+001B"),
    "not-utf8": (b"name: x\nsystem: {reference: trainer}\ndescription: caf\xe9\n", "3:17",
                 "not UTF-8 text: byte 0xe9"),
    "utf16-bom": (BASE.encode("utf-16"), "1:1", "UTF-16"),
    "utf16-no-bom": (BASE.encode("utf-16-le"), "1:2", "is the file UTF-16?"),
    "utf32-bom": (BASE.encode("utf-32"), "1:1", "UTF-32"),
    "date": (b"name: x\nseed: 2024-13-45\nsystem: {reference: trainer}\n", "2:7",
             "seed: Input should be a valid integer"),
    "5000-digits": (f"name: x\nseed: {'9' * 5000}\nsystem: {{reference: trainer}}\n".encode(),
                    "2:7", "an integer of 5000 digits is out of range"),
    "big-hex": (f"name: x\nseed: 0x{'f' * 30}\nsystem: {{reference: trainer}}\n".encode(),
                "2:7", "out of range"),
    "bad-int-tag": (b"name: x\nseed: !!int 12x\nsystem: {reference: trainer}\n", "2:7",
                    "'12x' is not a valid !!int"),
    "bad-date-tag": (b"name: x\ndescription: !!timestamp 2024-13-45\n"
                     b"system: {reference: trainer}\n", "2:14", "not a valid !!timestamp"),
    "inf-timeout": (b"name: x\nsystem: {reference: trainer, timeout: .inf}\n", "2:39",
                    "system.timeout: a duration must be finite"),
    "nan-timeout": (b"name: x\nsystem: {reference: trainer, timeout: .nan}\n", "2:39",
                    "a duration must be finite"),
    "huge-timeout": (b'name: x\nsystem: {reference: trainer, timeout: "99999999999999999h"}\n',
                     "2:39", "a duration is at most 168h"),
    "deep": (nested(1000).encode(), "3:45", "nested more than 32 levels deep"),
    "recursive-alias": (b"name: x\nsystem: &s {reference: trainer, env: *s}\n", "2:38",
                        "alias *s refers to a value that contains it"),
    "alias-bomb": (alias_bomb().encode(), "12:10",
                   "aliases expand the scenario to 4,412,961,522 values, more than the limit"),
    "too-large": (BASE.encode() + b"#" * MAX_FILE_BYTES, "1:1",
                  "larger than 256 KiB, the limit for a scenario file"),
    "steps-10^400": (f"name: x\nsystem: {{reference: trainer, steps: 1{'0' * 400}}}\n".encode(),
                     "2:37", "out of range"),
    "steps-10^12": (b"name: x\nsystem: {reference: trainer, steps: 1000000000000}\n", "2:37",
                    "system.steps: Input should be less than or equal to 10000000"),
    "world-64x64": (b"name: x\nsystem: {reference: trainer, world: {replicas: 64, shards: 64}}\n",
                    "2:37", "system.world: 4096 processes (replicas × shards); at most 256"),
    "inf-rate": (b"name: x\nsystem: {reference: server, load: {rate: .inf}}\n", "2:42",
                 "system.load.rate: Input should be a finite number"),
    "seed-2^40": (b"name: x\nseed: 1099511627776\nsystem: {reference: trainer}\n", "2:7",
                  "seed: Input should be less than or equal to 4294967295"),
    "unhashable-key": (b"name: x\nsystem: {reference: trainer}\n[a, b]: 1\n", "3:1",
                       "a key must be a plain name, not a list"),
    "regex-overflow": (b"name: x\nsystem: {command: [x], probes: [{pattern: 'a{99999999999}', "
                       b"event: step}]}\n", "2:43", "not a valid regular expression"),
    "regex-deep": (b"name: x\nsystem: {command: [x], probes: [{pattern: '" + b"(" * 600
                   + b")" * 600 + b"', event: step}]}\n", "2:43",
                   "not a valid regular expression"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_an_error_at_its_position(tmp_path: Path, case: str) -> None:
    raw, where, says = MALFORMED[case]
    path = tmp_path / "s.yaml"
    path.write_bytes(raw)
    with pytest.raises(SpecError) as info:
        load_scenario(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}:{where}"), problem
    assert says in problem, problem


def test_problem_lines_stay_short_whatever_the_value(tmp_path: Path) -> None:
    """A bad value is quoted, but a 100 KB value does not become a 100 KB message."""
    path = tmp_path / "s.yaml"
    path.write_text(f"name: x\nsystem: {{reference: trainer, timeout: '{'9' * 100_000}x'}}\n")
    with pytest.raises(SpecError) as info:
        load_scenario(path)
    (problem,) = info.value.problems
    assert "expected a duration like 500ms" in problem
    assert len(problem) < 400


def test_a_key_with_a_newline_stays_on_one_problem_line() -> None:
    """Found by the fuzz test: an unknown key is quoted, so it cannot split or forge lines."""
    with pytest.raises(SpecError) as info:
        parse_scenario(BASE + 'expect: {"a\\nb.yaml:1:1: forged\\e[2J": 1}\n', "s.yaml")
    (problem,) = info.value.problems
    assert problem.startswith("s.yaml:3:10: expect.'a\\nb.yaml:1:1: forged\\x1b[2J': unknown key")
    assert "\n" not in problem
    assert "\x1b" not in problem


def test_world_of_256_processes_is_the_largest_allowed() -> None:
    spec = parse_scenario("name: x\nsystem: {reference: trainer, world: {replicas: 16, "
                          "shards: 16}}\n")
    assert isinstance(spec.system, TrainerSystem)
    assert spec.system.world.size == 256


def test_ordinary_yaml_features_still_work() -> None:
    """The bounds reject abuse, not YAML: a BOM, an alias reused, dates kept as text."""
    text = ("\ufeffname: x\ndescription: 2024-01-05\nsystem: {reference: trainer}\n"
            "faults:\n"
            "  - {kind: process.kill, target: &one {rank: 1}, at: {step: 3}}\n"
            "  - {kind: process.kill, target: *one, at: {step: 9}}\n")
    spec = parse_scenario(text)
    assert spec.description == "2024-01-05"
    assert [f.target.rank for f in spec.faults] == [1, 1]


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    # /proc/self/mem is a regular file whose first page cannot be read (EIO): a real
    # unreadable file, even for root, for whom permission bits do not apply.
    with pytest.raises(SpecError) as info:
        load_scenario("/proc/self/mem")
    (problem,) = info.value.problems
    assert problem.startswith("/proc/self/mem:1:1: cannot read scenario: ")


# ------------------------------------------------------------- through the real command line


def assert_invalid_in_bounds(path: Path | str, says: str) -> None:
    """`aftershock validate PATH`: exit 2 naming the file, within 5 CPU seconds and 300 MB."""
    result = bounded_cli("validate", str(path), cpu_s=5, wall_s=30)
    assert not result.timed_out, "validate hung"
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{path}:"), result.stderr[-2000:]
    assert says in result.stderr, result.stderr[-2000:]
    assert result.cpu_s < 5
    assert result.max_rss_mb < 300


def test_alias_bomb_is_refused_in_bounds(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert_invalid_in_bounds(path, "aliases expand the scenario")


def test_50_mb_file_is_refused_in_bounds(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    with path.open("w") as handle:
        handle.write(BASE)
        for _ in range(50):
            handle.write("# " + "x" * (1024 * 1024 - 3) + "\n")
    assert_invalid_in_bounds(path, ":1:1: the file is larger than 256 KiB")


def test_deep_nesting_is_refused_in_bounds(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(nested(100_000))
    assert_invalid_in_bounds(path, "nested more than 32 levels deep")


def test_dev_zero_is_refused_in_bounds() -> None:
    assert_invalid_in_bounds("/dev/zero", "/dev/zero:1:1: not a regular file (a character "
                             "device)")


def test_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    assert_invalid_in_bounds(path, ":1:1: not a regular file (a named pipe)")


def test_the_memory_bound_is_the_clis_own_not_the_test_process() -> None:
    """A forked child starts with a copy of its parent's page tables, and the kernel's peak
    RSS of a process survives exec: measured on a direct child of pytest, every bound above
    counted pytest's own memory too, and failed once a long suite had grown it past 300 MB
    (330 MB for a 0.4 s `validate`)."""
    ballast = bytearray(400 * 1024 * 1024)
    ballast[::4096] = b"\x01" * len(range(0, len(ballast), 4096))  # every page resident
    result = bounded_cli("--help")
    del ballast
    assert result.returncode == 0, result.stderr
    assert result.max_rss_mb < 200, result.max_rss_mb
    assert 0 < result.cpu_s < 5
