"""Plug-ins: entry points loaded once, each object checked against its protocol, and a broken
one named in one line and skipped, never allowed to break what does not use it.

Aftershock has four entry-point groups (docs/extending.md): ``aftershock.faults`` (fault
kinds, faults/registry.py), ``aftershock.systems`` (system kinds, harness/systems/),
``aftershock.presets`` (log-probe presets, harness/presets.py) and ``aftershock.checks``
(checks, harness/check_registry.py). Each registry loads its
group with :func:`load` and checks every object with a table of :class:`Attr` (required
and optional attributes, their types and allowed values) through :func:`check`. An entry
point that cannot be imported, or whose object its registry refuses, becomes a
:class:`Broken` record: one warning line on stderr naming its distribution, entry point
and what is wrong. A scenario that uses it fails with that line (exit code 3); every other
scenario runs.

``AFTERSHOCK_NO_PLUGINS=1`` loads no entry point at all (as ``HYPOTHESIS_NO_PLUGINS`` and
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` do): the way out when a plug-in breaks the tool anyway.

Standard library only: the fault registry imports it, and the probe imports that package.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

#: Set (to anything but empty or ``0``) to load no entry point of any group.
NO_PLUGINS_ENV = "AFTERSHOCK_NO_PLUGINS"


class PluginProblem(ValueError):
    """What makes an object no valid plug-in, in one sentence."""


def disabled() -> bool:
    """Whether :data:`NO_PLUGINS_ENV` turns entry points off."""
    return os.environ.get(NO_PLUGINS_ENV, "").strip() not in ("", "0")


# --------------------------------------------------------------------------- the protocol


@dataclass(frozen=True, slots=True)
class Attr:
    """One attribute of a protocol: its name, what it must be (``what``, for the message,
    and ``test``), the values it may take (``allowed``; empty: any that passes ``test``),
    and whether an object may leave it out."""

    name: str
    what: str
    test: Callable[[Any], bool]
    allowed: tuple[Any, ...] = ()
    required: bool = True


def required(name: str, what: str, test: Callable[[Any], bool],
             allowed: Iterable[Any] = ()) -> Attr:
    return Attr(name, what, test, tuple(allowed), required=True)


def optional(name: str, what: str, test: Callable[[Any], bool],
             allowed: Iterable[Any] = ()) -> Attr:
    return Attr(name, what, test, tuple(allowed), required=False)


def is_callable(value: Any) -> bool:
    return callable(value)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def check(obj: Any, what: str, protocol: Iterable[Attr],
          name: Callable[[Any], Any] = lambda obj: None) -> dict[str, Any]:
    """The attributes of ``obj`` that ``protocol`` names (an optional one it leaves out is
    absent); PluginProblem naming every attribute that is missing, of the wrong type or
    not an allowed value. ``what``: the protocol, for the message (``fault kind``);
    ``name``: reads the name ``obj`` claims, for the message, where it can."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    for attr in protocol:
        try:
            value = getattr(obj, attr.name)
        except AttributeError:
            if attr.required:
                problems.append(f"no `{attr.name}` ({attr.what})")
            continue
        except Exception as exc:  # a property of the plug-in's that raises
            problems.append(f"`{attr.name}` raised {type(exc).__name__}: {exc}")
            continue
        if attr.allowed and not any(_same(value, a) for a in attr.allowed):
            listed = ", ".join(repr(a) for a in attr.allowed)
            problems.append(f"`{attr.name}` is {_short(value)}; allowed: {listed}")
        elif not attr.allowed and not _passes(attr.test, value):
            problems.append(f"`{attr.name}` is {_short(value)}, not {attr.what}")
        else:
            found[attr.name] = value
    if problems:
        raise PluginProblem(f"{what} {_label(obj, name)}: {'; '.join(problems)}")
    return found


def _label(obj: Any, name: Callable[[Any], Any]) -> str:
    try:
        claimed = name(obj)
    except Exception:  # best effort: the object is broken already
        claimed = None
    if isinstance(claimed, str) and claimed and len(claimed) <= 60:
        return claimed
    return f"(a {type(obj).__qualname__})"


def _same(value: Any, allowed: Any) -> bool:
    # `True == 1` must not make 1 an allowed `True`, nor a str subclass pass for a name.
    return type(value) is type(allowed) and bool(value == allowed)


def _passes(test: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(test(value))
    except Exception:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- broken ones


@dataclass(frozen=True, slots=True)
class Broken:
    """An entry point that was skipped: where it comes from and what is wrong with it.

    ``claims`` are the names it would have registered, where they could be read (a fault
    kind's ``info.kind``); when none could, its entry point's name stands for it."""

    group: str
    name: str  # the entry point's name
    value: str  # what it points at: ``module:attribute``
    distribution: str  # ``name version`` of the distribution that declares it
    problem: str
    claims: tuple[str, ...] = ()

    def line(self) -> str:
        """The one line that reports it."""
        return (f"plug-in skipped: {self.distribution}, entry point {self.group}: "
                f"{self.name} = {self.value}: {self.problem}")

    def provides(self, name: str) -> bool:
        """Whether a scenario that names ``name`` (a fault kind, a system's tag, a preset)
        may be asking for this plug-in: one of its claims, or, when it claims nothing
        readable, a name its entry point's name stands for (``preempt_notice``:
        ``preempt.notice``; ``slurm``: ``slurm.drain``)."""
        if self.claims:
            return name in self.claims
        wanted, entry = _normal(name), _normal(self.name)
        return wanted == entry or wanted.startswith(entry + "-")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 400 else line[:397] + "..."


_warned: set[tuple[str, str, str]] = set()


def warn(broken: Broken) -> None:
    """Say on stderr, once per process, that ``broken`` was skipped."""
    key = (broken.group, broken.name, broken.problem)
    if key in _warned:
        return
    _warned.add(key)
    print(f"aftershock: warning: {broken.line()}", file=sys.stderr, flush=True)


def provider(broken: Iterable[Broken], name: str) -> Broken | None:
    """The broken plug-in that ``name`` may be asking for, if any."""
    return next((b for b in broken if b.provides(name)), None)


def why_unknown(broken: Iterable[Broken], name: str) -> str:
    """What an "unknown NAME" message adds: the skipped plug-in it may come from, or that
    plug-ins are off; empty otherwise."""
    skipped = provider(broken, name)
    if skipped is not None:
        return f"; {skipped.line()}"
    return f"; plug-ins are off ({NO_PLUGINS_ENV})" if disabled() else ""


# --------------------------------------------------------------------------- loading


def load(group: str, register: Callable[[Any], object],
         claims: Callable[[Any], Iterable[str]] = lambda obj: ()) -> list[Broken]:
    """Register every object the entry points of ``group`` give (an object, or a list or
    tuple of them) with ``register``; nothing when plug-ins are off (:func:`disabled`).

    What cannot be imported, or what ``register`` refuses (any exception: a plug-in's
    property may raise anything), is skipped, warned about (:func:`warn`) and returned.
    ``claims`` reads, best effort, the names a refused object would have registered."""
    if disabled():
        return []
    skipped: list[Broken] = []
    for entry in entry_points(group=group):
        try:
            loaded = entry.load()
        except Exception as exc:
            skipped.append(_broken(entry, f"cannot be imported: {type(exc).__name__}: {exc}",
                                   ()))
            continue
        many = isinstance(loaded, list | tuple)
        for index, obj in enumerate(loaded if many else [loaded]):
            try:
                register(obj)
            except Exception as exc:
                where = f"item {index}: " if many else ""
                problem = str(exc) if isinstance(exc, ValueError) else (
                    f"{type(exc).__name__}: {exc}")
                skipped.append(_broken(entry, where + problem, _claims(claims, obj)))
    for broken in skipped:
        warn(broken)
    return skipped


def _claims(claims: Callable[[Any], Iterable[str]], obj: Any) -> tuple[str, ...]:
    try:
        return tuple(c for c in claims(obj) if isinstance(c, str) and c)
    except Exception:  # best effort: the object is broken already
        return ()


def _broken(entry: EntryPoint, problem: str, claims: tuple[str, ...]) -> Broken:
    dist = entry.dist
    distribution = (f"{dist.name} {dist.version}" if dist is not None
                    else "an unnamed distribution")
    return Broken(group=entry.group, name=entry.name, value=entry.value,
                  distribution=distribution, problem=_one_line(problem), claims=claims)
