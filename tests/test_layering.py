"""The dependency direction (faults <- harness, faults <- reference_impl) and the public
API between them hold, and what runs inside every rank stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from _helpers import ROOT


def imports(folder: Path) -> dict[Path, set[str]]:
    found: dict[Path, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[path] = names
    return found


def test_the_engine_imports_neither_the_harness_nor_the_reference_systems() -> None:
    bad = {str(p.relative_to(ROOT)): sorted(n for n in names
                                            if n.split(".")[0] in ("harness", "reference_impl"))
           for p, names in imports(ROOT / "faults").items()}
    assert not {p: n for p, n in bad.items() if n}


def test_the_harness_uses_the_engine_through_its_public_api() -> None:
    private = {str(p.relative_to(ROOT)): sorted(n for n in names
                                                if n.startswith("faults._"))
               for p, names in imports(ROOT / "harness").items()}
    assert not {p: n for p, n in private.items() if n}


def test_the_probe_and_the_in_process_engine_import_only_the_standard_library() -> None:
    code = ("import sys, harness.probe, faults.inproc, faults.nvml_sim; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'pydantic', 'torch', 'yaml', 'rich', 'typer', 'jinja2'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
