"""Reading a scenario file, bounded: its bytes (a regular file, UTF-8, at most
MAX_FILE_BYTES), its YAML (nesting, values, integers and aliases bounded) and where each
key and value is in it, so a problem is reported at its line and column.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from aftershock.harness.errors import SpecError

#: Bounds on a scenario file, so that validating a hostile or broken file costs a fraction of
#: a second and a few MB instead of the machine: far above any real scenario (the shipped ones
#: are at most 1.2 KB, 70 values and 5 levels deep), far below what would hurt.
MAX_FILE_BYTES = 256 * 1024
#: Values (scalars, lists, mappings) once every alias is expanded: a billion-laughs file of a
#: few hundred bytes expands to 10**9 of them.
MAX_VALUES = 10_000
#: Nesting levels, the top-level mapping being level 1.
MAX_DEPTH = 32
#: Integers in a scenario fit in 64 bits; longer digit strings are refused before Python
#: converts them (which costs time quadratic in the digits, and fails past 4,300).
_MAX_INT = 2**64 - 1
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
#: Characters YAML forbids (C0/C1 controls but tab, LF, CR and NEL; surrogates; U+FFFE/F).
_NON_PRINTABLE = yaml.reader.Reader.NON_PRINTABLE


class _LoadError(yaml.MarkedYAMLError):
    """A problem the bounded loader found, at a position in the file."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: nesting, values and integers, and no recursive aliases.

    Composition counts values and depth as the events arrive, so a deep or huge file stops at
    the limit, before PyYAML's recursive composer runs out of stack. Aliases are not copied
    at composition (one node, many parents), so what they expand to is measured afterwards
    on the node graph (``_expanded``) before anything walks the expanded tree.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0
        self.values = 0
        self.finished: set[int] = set()
        #: Each alias: where it is, how deep it sits, and the node it names.
        self.aliases: list[tuple[Any, int, yaml.Node]] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: Any = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            # An anchor is registered when its node starts: naming it before the node is
            # finished makes a cycle, which every later walk would follow forever.
            if target is not None and id(target) not in self.finished:
                raise _LoadError(f"alias *{event.anchor} refers to a value that contains it "
                                 "(a recursive alias)", event.start_mark)
            node = super().compose_node(parent, index)
            if node is not None:
                self.aliases.append((event.start_mark, self.depth, node))
            return node
        self.depth += 1
        self.values += 1
        if self.depth > MAX_DEPTH:
            raise _LoadError(f"nested more than {MAX_DEPTH} levels deep (the limit)",
                             event.start_mark)
        if self.values > MAX_VALUES:
            raise _LoadError(f"more than {MAX_VALUES:,} values (the limit for a scenario)",
                             event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        self.finished.add(id(node))
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML lets a scalar's own conversion errors escape (int('12x') for `!!int 12x`,
        # a bad `!!timestamp`): make them errors at the scalar's position.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            value = _quote(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise _LoadError(f"{value} is not a valid {tag} ({_quote(str(exc), 100)[1:-1]})",
                             node.start_mark) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = re.sub(r"[^0-9a-fA-F]", "", str(node.value))
        if len(digits) > 40:
            raise _LoadError(f"an integer of {len(digits)} digits is out of range (integers "
                             f"in a scenario fit in 64 bits)", node.start_mark)
        value = super().construct_yaml_int(node)
        if abs(value) > _MAX_INT:
            raise _LoadError(f"{_quote(node.value)} is out of range (integers in a scenario "
                             "fit in 64 bits)", node.start_mark)
        return value


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
# Dates stay text: no scenario key is a date, and a bad one (2024-13-45) raised ValueError out
# of PyYAML instead of a type error at its position.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _quote(value: Any, limit: int = 60) -> str:
    """A bad value for a message: quoted, and shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-4:]}"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _expanded(root: yaml.Node) -> dict[int, tuple[int, int]]:
    """For every node: (values, depth) once aliases are expanded, without expanding them.

    The node graph is acyclic (the loader refuses recursive aliases), so each node is
    measured once from its children's measures; iterative, since expanded depth is not
    bounded by the composer's limit.
    """
    measured: dict[int, tuple[int, int]] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in measured:
            continue
        children = _children(node)
        if not ready:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in measured)
            continue
        values = 1 + sum(measured[id(child)][0] for child in children)
        depth = 1 + max((measured[id(child)][1] for child in children), default=0)
        measured[id(node)] = (values, depth)
    return measured


def _check_aliases(loader: _Loader, root: yaml.Node) -> None:
    """Refuse a file whose aliases expand it past the value or depth limit."""
    if not loader.aliases:
        return  # the composer's own counts are the expanded ones
    measured = _expanded(root)
    values, depth = measured[id(root)]
    if values > MAX_VALUES:
        mark, _, node = max(loader.aliases, key=lambda alias: measured[id(alias[2])][0])
        raise _LoadError(
            f"aliases expand the scenario to {values:,} values, more than the limit of "
            f"{MAX_VALUES:,} (this alias alone is {measured[id(node)][0]:,})", mark)
    if depth > MAX_DEPTH:
        mark, _, node = max(loader.aliases,
                            key=lambda alias: alias[1] + measured[id(alias[2])][1])
        raise _LoadError(f"aliases nest the scenario {depth} levels deep, more than the "
                         f"limit of {MAX_DEPTH}", mark)


@dataclass(slots=True)
class _Marks:
    keys: dict[tuple[Any, ...], tuple[int, int]]
    values: dict[tuple[Any, ...], tuple[int, int]]


def _collect_marks(
    node: yaml.Node, path: tuple[Any, ...], marks: _Marks, problems: list[str], file: str
) -> None:
    # Walks the expanded tree: bounded by MAX_VALUES and MAX_DEPTH (checked before).
    marks.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            where = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if not isinstance(key_node, yaml.ScalarNode):
                shape = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                problems.append(f"{file}:{where[0]}:{where[1]}: a key must be a plain name, "
                                f"not a {shape}")
                continue
            key = key_node.value
            if key in seen:
                problems.append(f"{file}:{where[0]}:{where[1]}: duplicate key {key!r}")
            seen.add(key)
            marks.keys[(*path, key)] = where
            _collect_marks(value_node, (*path, key), marks, problems, file)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_marks(item, (*path, index), marks, problems, file)


def _position(text: str, index: int) -> tuple[int, int]:
    """Line and column of ``text[index]``, counted as PyYAML counts them (1-based)."""
    before = text[:index]
    breaks = list(re.finditer(r"\r\n|[\r\n\x85\u2028\u2029]", before))
    line_start = breaks[-1].end() if breaks else 0
    return len(breaks) + 1, len(before[line_start:].replace("\ufeff", "")) + 1


def _check_text(text: str, file: str) -> None:
    """Refuse a scenario too long to be one, or with a control character YAML refuses."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError([f"{file}:1:1: the scenario is longer than {MAX_FILE_BYTES // 1024} "
                         "KiB, the limit for a scenario file"])
    bad = _NON_PRINTABLE.search(text)
    if bad is not None:
        line, col = _position(text, bad.start())
        hint = " (is the file UTF-16? scenarios are UTF-8)" if bad.group() == "\0" else ""
        raise SpecError([f"{file}:{line}:{col}: control character U+{ord(bad.group()):04X} "
                         f"is not allowed in YAML{hint}"])


def _load_yaml(text: str, file: str) -> tuple[dict[Any, Any], _Marks]:
    """The scenario's YAML as data, with where each key and value is in the file."""
    problems: list[str] = []
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_aliases(loader, node)
            marks = _Marks(keys={}, values={})
            # Before construction: merge keys (`<<`) rewrite the nodes they are in.
            _collect_marks(node, (), marks, problems, file)
            if problems:
                raise SpecError(problems)
            data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        # PyYAML's context says what it was reading ("expected a single document in the
        # stream"); its problem alone ("but found another document") reads as a fragment.
        detail = f"{exc.context}: {exc.problem}" if exc.context else exc.problem
        raise SpecError([f"{file}:{line}:{col}: invalid YAML: {detail}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{file}:1:1: invalid YAML: {exc}"]) from None
    finally:
        loader.dispose()
    if node is None or not isinstance(data, dict):
        raise SpecError(
            [f"{file}:1:1: a scenario must be a mapping with `name`, `system`, `faults`, `expect`"]
        )
    return data, marks


_FILE_KINDS = {
    stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket",
}


def _read_bounded(file: Path) -> bytes:
    """The file's bytes, if it is a regular file of at most MAX_FILE_BYTES."""

    def refuse(what: str) -> SpecError:
        return SpecError([f"{file}:1:1: {what}"])

    try:
        # Look before opening: opening a named pipe waits for a writer, and opening a
        # device can have effects of its own.
        kind = stat.S_IFMT(os.stat(file).st_mode)
        if kind != stat.S_IFREG:
            raise refuse(f"not a regular file ({_FILE_KINDS.get(kind, 'not a file')}); a "
                         "scenario is a YAML file")
        # O_NONBLOCK: should the path be swapped for a pipe meanwhile, open does not wait.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise refuse("not a regular file; a scenario is a YAML file")
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot read scenario: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise refuse(f"the file is larger than {MAX_FILE_BYTES // 1024} KiB, the limit for a "
                     "scenario file")
    return data


_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
)


def _decode(data: bytes, file: str) -> str:
    """UTF-8 text (YAML also allows UTF-16 and 32; we keep scenario files to one encoding)."""
    for bom, name in _WIDE_BOMS:  # UTF-32's little-endian BOM starts with UTF-16's
        if data.startswith(bom):
            raise SpecError([f"{file}:1:1: the file is {name} text; scenarios are UTF-8 "
                             f"(convert it: iconv -f {name} -t UTF-8)"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = data[: exc.start].decode("utf-8")
        line, col = _position(good, len(good))
        raise SpecError([f"{file}:{line}:{col}: not UTF-8 text: byte 0x{data[exc.start]:02x} "
                         f"({exc.reason}); scenarios are UTF-8"]) from None
