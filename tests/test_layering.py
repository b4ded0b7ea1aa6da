"""The dependency direction (faults <- harness, faults <- reference_impl) and the public
API between them hold, and what runs inside every rank stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from _helpers import ROOT

BROKEN = ROOT / "tests" / "broken" / "layering"


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
        # Inside the repository the three folders are the aftershock package's parts.
        found[path] = {n.removeprefix("aftershock.") for n in names}
    return found


def test_the_engine_imports_neither_the_harness_nor_the_reference_systems() -> None:
    bad = {str(p.relative_to(ROOT)): sorted(n for n in names
                                            if n.split(".")[0] in ("harness", "reference_impl"))
           for p, names in imports(ROOT / "faults").items()}
    assert not {p: n for p, n in bad.items() if n}


def test_every_import_of_the_project_goes_through_the_aftershock_namespace() -> None:
    """In a checkout the three folders also import as top-level names; an install has only
    ``aftershock``, so an import of ``harness``, ``faults`` or ``reference_impl`` would work
    here and break every user."""
    bare: dict[str, list[str]] = {}
    for folder in ("harness", "faults", "reference_impl", "tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(ROOT / "bench" / "results"):
                continue  # records of past measurements, kept as they ran
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                         and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import)
                         else [])
                wrong = [n for n in names
                         if n.split(".")[0] in ("harness", "faults", "reference_impl")]
                if wrong:
                    bare.setdefault(str(path.relative_to(ROOT)), []).extend(wrong)
    assert not bare


def test_the_harness_uses_the_engine_through_its_public_api() -> None:
    private = {str(p.relative_to(ROOT)): sorted(n for n in names
                                                if n.startswith("faults._"))
               for p, names in imports(ROOT / "harness").items()}
    assert not {p: n for p, n in private.items() if n}


def test_the_probe_and_the_in_process_engine_import_only_the_standard_library() -> None:
    code = (
        "import sys, aftershock.harness.probe, aftershock.faults.inproc, "
        "aftershock.faults.nvml_sim; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'pydantic', 'torch', 'yaml', 'rich', 'typer', 'jinja2'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def loaded(
    modules: list[str], *, argv: list[str] | None = None, path: Path | None = None
) -> set[str]:
    """Every module a fresh interpreter has loaded after importing ``modules`` (then, with
    ``argv``, after running ``python -m aftershock ARGV`` to its exit)."""
    code = "import importlib, runpy, sys\n"
    if path is not None:
        code += f"sys.path.insert(0, {str(path)!r})\n"
    code += f"for name in {modules!r}: importlib.import_module(name)\n"
    if argv is not None:
        code += (
            f"sys.argv = ['aftershock', *{argv!r}]\n"
            "try:\n    runpy.run_module('aftershock', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
        )
    code += "print('modules:', *sorted(sys.modules))"  # the last line, after any help text
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    last = done.stdout.splitlines()[-1].split()
    assert last[0] == "modules:", done.stdout
    return set(last[1:])


def tops(modules: set[str]) -> set[str]:
    return {m.removeprefix("aftershock.").split(".")[0] for m in modules}


#: Never needed to start the command line or print its help: each costs tens of milliseconds
#: of every `aftershock` call, or is an optional extra (bench/results/investigations-2026-12.md,
#: "What `aftershock run` costs beyond the job").
NOT_FOR_HELP = {
    "pydantic",
    "pydantic_core",
    "yaml",
    "faults",
    "torch",
    "docker",
    "hypothesis",
    "jinja2",
    "numpy",
}
#: Not needed to load and run a training scenario: the serving client's HTTP, JUnit's XML,
#: and what lives behind its own extra.
NOT_FOR_A_RUN = {
    "http.client",
    "ssl",
    "xml.etree.ElementTree",
    "torch",
    "docker",
    "hypothesis",
    "numpy",
}
RUN_PATH = [
    "aftershock.harness.cli",
    "aftershock.harness.run.runner",
    "aftershock.harness.reporting.report",
    "aftershock.harness.scenario.load",
    "aftershock.harness.scenario.spec",
]


def test_the_command_line_and_its_help_load_no_heavy_module() -> None:
    for found in (loaded(["aftershock.harness.cli"]), loaded([], argv=["--help"])):
        heavy = tops(found) & NOT_FOR_HELP
        assert not heavy
        ours = {m for m in found if m.startswith("aftershock.harness.")}
        assert ours == {"aftershock.harness.cli"}


def test_the_run_path_loads_neither_serving_nor_junit_nor_optional_extras() -> None:
    found = loaded(RUN_PATH)
    needless = (found | tops(found)) & NOT_FOR_A_RUN
    assert not needless


def test_the_import_checks_catch_a_command_line_that_imports_eagerly() -> None:
    found = loaded(["eager_cli"], path=BROKEN)
    assert {"pydantic", "yaml", "faults"} <= tops(found) & NOT_FOR_HELP
    assert {"http.client", "xml.etree.ElementTree"} <= found & NOT_FOR_A_RUN


def _module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: at its top level, in class bodies and
    under ``try``/``if``/``with``, but not inside functions nor under ``if TYPE_CHECKING:``."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo.extend(child for child in ast.iter_child_nodes(node)
                        if isinstance(child, ast.stmt))


def import_graph(folders: dict[str, Path]) -> dict[str, set[str]]:
    """Which of the modules under ``folders`` (package name → folder) each imports at import.
    ``from p import m`` is an edge to the module ``p.m`` when there is one, else to ``p``."""
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif node.module and not node.level:
                edges.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                             else node.module for a in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in import order, the first again at the
    end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path: list[str] = []
        stack = [(start, iter(sorted(graph[start])))]
        on_path = {start}
        path.append(start)
        while stack:
            node, rest = stack[-1]
            nxt = next(rest, None)
            if nxt is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
                on_path.add(nxt)
    return None


def test_no_module_of_the_package_imports_itself_in_a_cycle_at_import() -> None:
    """A cycle of module-level imports works only in the order Python happens to meet it,
    and makes the modules one: none can be read, tested or moved without the others."""
    graph = import_graph({f"aftershock.{f}": ROOT / f
                          for f in ("harness", "faults", "reference_impl")})
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph) or [])


def test_the_cycle_check_names_a_cycle_and_only_module_level_imports_count() -> None:
    graph = import_graph({"cycle": BROKEN / "cycle"})
    assert cycle_in(graph) == ["cycle.a", "cycle.b", "cycle.a"]
    assert graph["cycle.b"] == {"cycle.a"}  # not c: only for types
    assert graph["cycle.c"] == set()  # b only inside a function


def test_the_harness_packages_import_nothing_when_imported() -> None:
    """A package of harness/ is a folder of modules: its ``__init__`` imports nothing, so
    importing one module never runs another behind the import graph's back (where a cycle
    would hide from the test above)."""
    heavy = {str(init.relative_to(ROOT)): ast.unparse(node)
             for init in (ROOT / "harness").glob("*/__init__.py")
             if init.parent.name in HARNESS_PACKAGES
             for node in _module_level_imports(ast.parse(init.read_text()))
             if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")}
    assert not heavy


#: The concept packages of harness/ (regrouped by /work/notes/regroup.py).
HARNESS_PACKAGES = {"reporting", "run", "scenario", "search", "twin", "verdict"}
