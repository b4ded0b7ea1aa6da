"""No function of the harness or the engine has more than 15 ways through it (cyclomatic
complexity, as radon counts it): past that a function is read as several, and is tested as
none of them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from _helpers import ROOT
from radon import complexity

LIMIT = 15


def too_complex(folders: list[Path], *, skip: tuple[str, ...] = ()) -> list[str]:
    """``path:line name (complexity)`` for each function over :data:`LIMIT` under
    ``folders``, methods and nested functions included; ``skip``: files (``path``) or
    functions (``path:name``) left out."""
    found: set[str] = set()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in skip:
                continue
            for block in _functions(complexity.cc_visit(path.read_text())):
                name = f"{block.classname}.{block.name}" if block.classname else block.name
                if block.complexity > LIMIT and f"{where}:{name}" not in skip:
                    found.add(f"{where}:{block.lineno} {name} ({block.complexity})")
    return sorted(found)  # a method comes both alone and in its class


def _functions(blocks: list[object]) -> Iterator[object]:
    for block in blocks:
        if hasattr(block, "methods"):  # a class: its methods are counted one by one
            yield from _functions(block.methods)
        else:
            yield block
            yield from _functions(getattr(block, "closures", []))


def test_no_function_of_the_harness_or_the_engine_is_over_the_limit() -> None:
    over = too_complex([ROOT / "harness", ROOT / "faults"])
    assert not over, "split these into named steps:\n" + "\n".join(over)


def test_the_complexity_check_names_a_function_over_the_limit() -> None:
    over = too_complex([ROOT / "tests" / "broken" / "complexity"])
    assert over == ["tests/broken/complexity/tangled.py:7 tangled (16)"]
