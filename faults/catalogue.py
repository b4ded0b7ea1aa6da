"""The fault catalogue, from the kinds' own declarations: ``aftershock faults`` (a table or
JSON) and the generated part of docs/faults.md.

Nothing here is written by hand per kind: a kind's summary, cause and undo come from its
``info``, its parameters (names, types, defaults, meanings) from its ``params`` model,
where it acts and what it needs from its ``acts`` and ``needs``. ``python -m
aftershock.faults.catalogue docs/faults.md`` (``make docs``) rewrites the generated part of the
page;
tests/test_docs_faults.py fails when it is stale.
"""

from __future__ import annotations

import enum
import sys
import typing
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from aftershock.faults import registry
from aftershock.faults._duration import format_duration

BEGIN = (
    "<!-- Generated from each kind's declaration by `make docs` "
    "(python -m aftershock.faults.catalogue "
    "docs/faults.md): edit the kind in faults/, not this part. -->"
)
END = "<!-- End of the generated part. -->"


def _type_words(annotation: Any) -> str:
    """A parameter's type in words: ``duration``, ``integer``, ``a | b | c``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner = typing.get_args(annotation)[0]
        return "duration" if inner is timedelta else _type_words(inner)
    if origin is typing.Literal:
        return " | ".join(str(v) for v in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and origin is not None and origin not in (list, dict):
        return " | ".join(_type_words(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    names = {
        bool: "true | false",
        int: "integer",
        float: "number",
        str: "text",
        timedelta: "duration",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default_words(field: FieldInfo) -> str | None:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return None  # the description says what its absence means
    if isinstance(value, bool):
        return f"default {str(value).lower()}"
    if isinstance(value, timedelta):
        return f"default {format_duration(value)}"
    if isinstance(value, enum.Enum):
        return f"default {value.value}"
    return f"default {value}"


def parameters(kind: registry.FaultKind) -> dict[str, str]:
    """Each parameter's meaning, type and default, in words (name -> text)."""
    if not registry.declared(kind):
        return dict(kind.info.params)
    found: dict[str, str] = {}
    for name, field in kind.params.model_fields.items():
        extra = "; ".join(w for w in (_type_words(field.annotation), _default_words(field)) if w)
        meaning = field.description or ""
        found[name] = f"{meaning} ({extra})" if meaning else extra
    return found


def where(kind: registry.FaultKind) -> str:
    """Where a kind acts, in words."""
    hooks = registry.hooks(kind)
    if hooks.acts == "either":
        return f"outside; inside {hooks.inside_when}".rstrip()
    return hooks.acts


def describe(kind: registry.FaultKind) -> dict[str, Any]:
    """A kind as ``aftershock faults --json`` prints it."""
    return {
        "kind": kind.info.kind,
        "summary": kind.info.summary,
        "caused_by": kind.info.caused_by,
        "params": parameters(kind),
        "reverted_by": kind.info.reverted_by,
        "acts": where(kind),
        "needs": sorted(registry.hooks(kind).needs),
    }


def applicable(kind: registry.FaultKind, offered: Iterable[str]) -> bool:
    """Whether a system that offers ``offered`` (CAPABILITIES) can take this kind in some
    form (a kind that acts either way needs only one of its ways)."""
    have = set(offered)
    acts = registry.hooks(kind).acts
    outside = registry.hooks(kind).needs <= have
    inside = "probe" in have
    return {"outside": outside, "inside": inside, "either": outside or inside}.get(acts, False)


def builtin() -> list[registry.FaultKind]:
    """This package's kinds (an installed third-party kind is documented by its package)."""
    return [
        k
        for k in registry.kinds()
        if registry.declared(k) and type(k).__module__.startswith("aftershock.faults.")
    ]


def _cell(text: str) -> str:
    return text.replace("|", "&#124;").replace("\n", " ")


def markdown(kinds: Sequence[registry.FaultKind]) -> str:
    """The generated part of docs/faults.md: a table of every kind, then each kind's own
    section where it declares one (``info.details``)."""
    lines = [
        BEGIN,
        "",
        "## Kinds",
        "",
        "| kind | what | where it acts | parameters | how it is really caused | undone by |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind in kinds:
        params = "<br>".join(f"`{n}`: {_cell(t)}" for n, t in parameters(kind).items()) or "none"
        lines.append(
            f"| `{kind.info.kind}` | {_cell(kind.info.summary)} | {where(kind)} | "
            f"{params} | {_cell(kind.info.caused_by)} | "
            f"{_cell(kind.info.reverted_by)} |"
        )
    for kind in kinds:
        if kind.info.details:
            lines += ["", f"### `{kind.info.kind}`", "", kind.info.details.strip()]
    lines += ["", END]
    return "\n".join(lines) + "\n"


def rewrite(page: str, kinds: Sequence[registry.FaultKind]) -> str:
    """``page`` with its generated part (between BEGIN and END) made anew."""
    try:
        head, rest = page.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(
            f"the page has no generated part (a line {BEGIN!r}, later one {END!r})"
        ) from None
    return head + markdown(kinds).rstrip("\n") + tail


def main(argv: Sequence[str]) -> int:
    """``python -m aftershock.faults.catalogue PAGE [--check]``: rewrite PAGE's generated part, or
    with
    --check only say whether it is up to date (exit 1 if not)."""
    paths = [a for a in argv if not a.startswith("--")]
    if len(paths) != 1:
        print("usage: python -m aftershock.faults.catalogue PAGE [--check]", file=sys.stderr)
        return 2
    path = Path(paths[0])
    page = path.read_text()
    fresh = rewrite(page, builtin())
    if "--check" in argv:
        if fresh != page:
            print(f"{path} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        path.write_text(fresh)
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
