"""Loading scenarios: parse and validate a scenario's YAML (every problem at its line and
column), find scenario files, and write a scenario back as YAML or its format as JSON Schema.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import types
import typing
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from aftershock import faults
from aftershock.faults import registry
from aftershock.faults.plugins import Broken
from aftershock.harness import systems
from aftershock.harness.errors import PluginError, SpecError
from aftershock.harness.scenario import _own_records as own_records
from aftershock.harness.scenario._space import SpaceError, resolve
from aftershock.harness.scenario._yaml import (
    _check_text,
    _decode,
    _load_yaml,
    _Marks,
    _read_bounded,
)
from aftershock.harness.scenario.faults_spec import FAULT_MODELS
from aftershock.harness.scenario.spec import LoadedScenario, Scenario
from aftershock.harness.verdict import check_registry

SCENARIO_SUFFIXES = (".yaml", ".yml")


def _data_path(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Pydantic's error location without union tags: the path into the YAML data.

    A tag such as ``reference`` can also be a key, so both readings are tried
    and the one that follows the data furthest wins.
    """

    def walk(index: int, current: Any, path: tuple[Any, ...]) -> tuple[int, tuple[Any, ...]]:
        """(how many parts of ``loc`` this reading explains, the data path)."""
        if index == len(loc):
            return index, path
        part = loc[index]
        options: list[tuple[int, tuple[Any, ...]]] = []
        in_dict = isinstance(current, dict) and part in current
        in_list = isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        if in_dict or in_list:
            options.append(walk(index + 1, current[part], (*path, part)))
        if isinstance(part, str) and path_is_tag(part):
            options.append(walk(index + 1, current, path))
        if not options:
            # A missing or unknown key is the subject of the error: keep it.
            if isinstance(current, dict) and isinstance(part, str):
                return index + 1, (*path, part)
            return index, path
        return max(options, key=lambda option: option[0])

    return walk(0, data, ())[1]


def path_is_tag(part: str) -> bool:
    return (part in FAULT_MODELS or any(part in (k.name, k.tag[0]) for k in systems.kinds())
            or "[" in part)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType, list, dict):
        found: list[type[BaseModel]] = []
        for arg in typing.get_args(annotation):
            found.extend(_models_in(arg))
        return found
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _model_at(path: tuple[Any, ...], data: Any) -> type[BaseModel] | None:
    """The model that owns the mapping at ``path`` (to list its allowed keys)."""
    model: type[BaseModel] | None = Scenario
    current = data
    for part in path:
        if isinstance(part, int):
            current = current[part] if isinstance(current, list) else None
            continue
        if model is None or part not in model.model_fields:
            return None
        candidates = _models_in(model.model_fields[part].annotation)
        current = current.get(part) if isinstance(current, dict) else None
        if isinstance(current, list):
            pass
        model = _pick(candidates, current)
    if isinstance(current, list):
        return None
    return model


def _pick(candidates: list[type[BaseModel]], value: Any) -> type[BaseModel] | None:
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    sample = value[0] if isinstance(value, list) and value else value
    if isinstance(sample, dict):
        if "kind" in sample and sample["kind"] in FAULT_MODELS:
            return FAULT_MODELS[sample["kind"]]
        kind = systems.claimed(sample)
        if kind is not None:
            return kind.model
    return None


def _describe(error: Any, path: tuple[Any, ...], data: Any) -> str:
    # A key is data: quoted unless a plain name, so a newline or an escape sequence in it
    # can neither split the one-line problem nor reach the terminal raw.
    where = ".".join(
        str(p) if re.fullmatch(r"[\w-]+", str(p)) else repr(str(p)) for p in path
    ) or "scenario"
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else "?"
        owner = _model_at(path[:-1], data)
        allowed = sorted(owner.model_fields) if owner else []
        hint = ""
        close = difflib.get_close_matches(str(key), allowed, n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
        listing = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{where}: unknown key {key!r}{listing}{hint}"
    if kind == "missing":
        return f"{where}: required key is missing"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        message = (
            f"unknown kind {ctx.get('tag')!r} (allowed: {ctx.get('expected_tags')})"
        )
    return f"{where}: {message}"



def unreachable(spec: Scenario, scenario_dir: Path | None) -> list[tuple[int, str]]:
    """Faults that cannot reach this system, by index, each with why: what the fault needs
    (aftershock.faults.registry.CAPABILITIES) that the system's target does not offer, or the
    in-process probe that its job does not call, or a ``target`` coordinate it can never
    resolve (``replica`` on a job that reports none: ``SystemKind.unresolved``)
    (``scenario_dir``: where the scenario file is, to read the files its command names;
    None: only what needs no file is known)."""
    kind = systems.of(spec.system)
    offered = set(kind.capabilities(spec.system))
    no_probe = kind.probe(spec.system, scenario_dir)
    if no_probe is None:
        offered.add("probe")
    # Optional: why a kind's target can never find the processes a fault's `target` names.
    unresolved = systems.unresolved(kind)
    found: list[tuple[int, str]] = []
    for index, fault in enumerate(spec.faults):
        fault_kind = faults.get(fault.kind)
        missing = registry.needs(fault_kind, fault, fault.at.phase) - offered
        if fault.target.node is not None and not offered & {"containers", "slurm"}:
            found.append((index, f"target {{node: {fault.target.node}}} names a node of a "
                          f"multi-node system (`nodes: N`, docs/nodes.md), which a "
                          f"{kind.shape} system is not"))
            continue
        if "probe" in missing:
            how = ""
            if registry.hooks(fault_kind).acts == "either":
                how = f" {registry.hooks(fault_kind).inside_when}".rstrip()
            found.append((index, f"{fault.kind}{how} is applied inside the target by the "
                          "in-process probe, which the job must start by calling "
                          f"aftershock.probe.install() (docs/faults.md); but {no_probe}"))
        elif missing:
            what = "; ".join(faults.CAPABILITIES.get(c, c) for c in sorted(missing))
            found.append((index, f"{fault.kind} needs {what}, which a {kind.shape} system's "
                          "target does not offer"))
        elif unresolved is not None:
            why = unresolved(spec.system, fault.target, no_probe is None)
            if why is not None:
                found.append((index, f"target {fault.target.describe()} can never be found: "
                              f"{why}"))
    return found


def unawaited(spec: Scenario) -> list[tuple[int, str]]:
    """Faults whose ``at.after`` waits for an event the system never reports, by index, each
    with why (``SystemKind.unawaited``): the fault would wait for the whole run."""
    hook = systems.unawaited(systems.of(spec.system))
    if hook is None:
        return []
    return [(index, why) for index, fault in enumerate(spec.faults)
            if fault.at.after is not None
            for why in [hook(spec.system, fault.at.after)] if why is not None]


_Where = tuple[str | int, ...]


def _broken_plugins(data: dict[str, Any]) -> list[tuple[_Where, Broken]]:
    """The plug-ins skipped as broken (faults/plugins.py) that a scenario which failed to
    validate names, each with where it names it: such a scenario is not what is wrong."""
    return [*_broken_in_system(data.get("system")), *_broken_kinds(data),
            *_broken_checks(data.get("expect"))]


def _broken_in_system(system: Any) -> list[tuple[_Where, Broken]]:
    """A broken system kind or preset the ``system:`` block names."""
    from aftershock.harness.scenario import presets

    if not isinstance(system, dict):
        return []
    found: list[tuple[_Where, Broken]] = []
    skipped = systems.broken_for(system)
    if skipped is not None:
        found.append((("system",), skipped))
    chosen = system.get("preset")
    names = [chosen] if isinstance(chosen, str) else chosen if isinstance(chosen, list) else []
    for name in names:
        if isinstance(name, str) and (skipped := presets.broken_for(name)) is not None:
            found.append((("system", "preset"), skipped))
    return found


def _broken_kinds(data: dict[str, Any]) -> list[tuple[_Where, Broken]]:
    """Broken fault kinds the ``faults:`` list or an ``explore:`` block's kinds name (as
    ``- kind`` or ``- {kind: kind, params: ...}``)."""
    found: list[tuple[_Where, Broken]] = []
    listed = data.get("faults")
    for index, fault in enumerate(listed if isinstance(listed, list) else []):
        kind = fault.get("kind") if isinstance(fault, dict) else None
        if isinstance(kind, str) and (skipped := registry.broken_kind(kind)) is not None:
            found.append((("faults", index, "kind"), skipped))
    space = data.get("explore")
    kinds = space.get("kinds") if isinstance(space, dict) else None
    for index, entry in enumerate(kinds if isinstance(kinds, list) else []):
        where: _Where = ("explore", "kinds", index)
        kind = entry.get("kind") if isinstance(entry, dict) else entry
        if isinstance(kind, str) and (skipped := registry.broken_kind(kind)) is not None:
            found.append(((*where, "kind") if isinstance(entry, dict) else where, skipped))
    return found


def _broken_checks(expect: Any) -> list[tuple[_Where, Broken]]:
    """Broken plug-in checks ``expect: checks:`` asks for."""
    asked = expect.get("checks") if isinstance(expect, dict) else None
    return [(("expect", "checks", name), skipped)
            for name in (asked if isinstance(asked, dict) else {})
            if isinstance(name, str) and (skipped := check_registry.broken_for(name)) is not None]


def parse_scenario(text: str, file: str = "<string>", *, folder: Path | None = None) -> Scenario:
    """Parse and validate scenario YAML; raise SpecError with every problem found.
    ``folder``: where its relative file names point (default: the folder of ``file``, if it
    is a file)."""
    _check_text(text, file)
    data, marks = _load_yaml(text, file)
    spec = _validated(data, marks, file)
    if spec.explore is not None:
        problems = _explore_problems(spec, marks, file)
        if problems:
            raise SpecError(problems)
    base = folder if folder is not None else Path(file).parent if Path(file).is_file() else None
    problems = _file_problems(spec, base, marks, file)
    if problems:
        raise SpecError(problems)
    return spec


def _validated(data: dict[Any, Any], marks: _Marks, file: str) -> Scenario:
    """The scenario model of ``data``; SpecError names each problem where it is in the file
    (PluginError where it uses a plug-in that was skipped)."""
    # Check plug-ins load here, not when first asked for: a broken one is reported by every
    # command that reads a scenario, as a broken fault kind is.
    check_registry.from_plugins()
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        used = _broken_plugins(data)
        if used:
            raise PluginError([
                "{}:{}:{}: {}: {}".format(
                    file, *(marks.values.get(where) or marks.keys.get(where) or (1, 1)),
                    ".".join(map(str, where)), skipped.line())
                for where, skipped in used]) from None
        problems: list[str] = []
        for error in exc.errors():
            path = _data_path(tuple(error["loc"]), data)
            lookup = marks.keys if error["type"] == "extra_forbidden" else marks.values
            position = None
            probe = path
            while position is None:
                position = lookup.get(probe) or marks.keys.get(probe)
                if position is None:
                    if not probe:
                        position = (1, 1)
                    probe = probe[:-1]
            problems.append(f"{file}:{position[0]}:{position[1]}: {_describe(error, path, data)}")
        raise SpecError(problems) from None


def _explore_problems(spec: Scenario, marks: _Marks, file: str) -> list[str]:
    """What is wrong with the scenario's search space, each where it is in the file."""
    try:
        resolve(spec.system, spec.explore)
    except SpaceError as exc:
        problems: list[str] = []
        for where, message in exc.problems:
            path = ("explore", *where)
            probe = path
            position = None
            while position is None and probe:
                position = marks.values.get(probe) or marks.keys.get(probe)
                probe = probe[:-1]
            line, col = position or (1, 1)
            name = ".".join(str(p) for p in path)
            problems.append(f"{file}:{line}:{col}: {name}: {message}")
        return problems
    return []


def _file_problems(spec: Scenario, base: Path | None, marks: _Marks, file: str) -> list[str]:
    """What the scenario names that is missing, unreachable or the run's own records."""
    problems: list[str] = []
    if base is not None:
        for where, problem in systems.of(spec.system).file_problems(spec.system, base):
            line, col = marks.values.get(("system", *where), (1, 1))
            problems.append(f"{file}:{line}:{col}: system.{'.'.join(map(str, where))}: "
                            f"{problem}")
    for index, problem in unreachable(spec, base):
        line, col = marks.values.get(("faults", index), (1, 1))
        problems.append(f"{file}:{line}:{col}: faults.{index}: {problem}")
    for index, problem in unawaited(spec):
        line, col = (marks.values.get(("faults", index, "at", "after"))
                     or marks.values.get(("faults", index), (1, 1)))
        problems.append(f"{file}:{line}:{col}: faults.{index}.at.after: {problem}")
    for index, field, problem in own_records.refused(spec, base):
        line, col = (marks.values.get(("faults", index, field))
                     or marks.values.get(("faults", index, "root"))
                     or marks.values.get(("faults", index), (1, 1)))
        problems.append(f"{file}:{line}:{col}: faults.{index}.{field}: {problem}")
    return problems


def to_yaml(spec: Scenario) -> str:
    """``spec`` as scenario YAML that parses back to an equal Scenario: the keys its author
    (or the code that built it) gave, defaults left implicit as they were; durations
    exactly, in ms or s."""
    data = _plain(spec.model_dump(mode="python", exclude_unset=True))
    if data.get("explore", "") is None:
        del data["explore"]
    # A fault reads kind first, as people write it (the model lists its own fields last).
    data["faults"] = [{"kind": f.pop("kind"), **f} for f in data.get("faults", [])]
    if not data["faults"]:
        del data["faults"]
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, timedelta):
        micro = round(value.total_seconds() * 1_000_000)
        if micro % 1_000_000 == 0:
            return f"{micro // 1_000_000}s"
        return f"{micro // 1000}ms" if micro % 1000 == 0 else f"{micro}us"
    return value


class _Dumper(yaml.SafeDumper):
    """Block style, except small mappings of plain values (`target: {rank: 1}`), as
    scenarios are written by hand."""

    def represent_dict(self, data: Any) -> yaml.MappingNode:
        node = super().represent_dict(data)
        small = len(data) <= 4 and all(
            isinstance(v, str | int | float | bool) and len(str(v)) < 40 for v in data.values())
        node.flow_style = small and bool(data)
        return node


_Dumper.add_representer(dict, _Dumper.represent_dict)


def load_scenario(path: str | Path) -> LoadedScenario:
    file = Path(path)
    text = _decode(_read_bounded(file), str(file))
    return LoadedScenario(spec=parse_scenario(text, str(file)), path=file, text=text)


def find_scenarios(paths: list[str | Path]) -> tuple[list[Path], list[str]]:
    """Scenario files under the given files and folders, sorted, each once; and a problem
    for each path that does not exist or cannot be read (a folder's unreadable subfolders
    included: skipping them would pass a suite that never ran)."""
    found: list[Path] = []
    problems: list[str] = []
    unreadable: list[OSError] = []
    for raw in paths:
        path = Path(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            problems.append(f"{path}:1:1: no such file or folder")
            continue
        except OSError as exc:
            problems.append(f"{path}:1:1: cannot read: {exc.strerror or exc}")
            continue
        if not is_dir:
            found.append(path)
            continue
        here: list[Path] = []
        for folder, _, names in os.walk(path, onerror=unreadable.append):
            here.extend(Path(folder, n) for n in names if Path(n).suffix in SCENARIO_SUFFIXES)
        found.extend(sorted(p for p in here if p.is_file()))
    problems.extend(f"{exc.filename}:1:1: cannot read folder: {exc.strerror or exc}"
                    for exc in unreadable)
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique, problems


def discover(paths: list[str | Path]) -> list[Path]:
    """Scenario files under the given files and folders; SpecError lists every bad path."""
    found, problems = find_scenarios(paths)
    if problems:
        raise SpecError(problems)
    return found


def json_schema() -> dict[str, Any]:
    schema = Scenario.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Aftershock scenario"
    return schema
