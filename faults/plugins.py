"""Plug-ins: entry points loaded once, each object checked against its protocol, and a broken
one named in one line and skipped, never allowed to break what does not use it.

Aftershock has four entry-point groups (docs/extending.md): ``aftershock.faults`` (fault
kinds, faults/registry.py), ``aftershock.systems`` (system kinds, harness/systems/),
``aftershock.presets`` (log-probe presets, harness/scenario/presets.py) and ``aftershock.checks``
(checks, harness/verdict/check_registry.py). Each is one :class:`Registry`: built-ins registered
when their modules are imported, the group loaded once, on first use (:func:`load`), every
object checked as it registers against a table of :class:`Attr` (required and optional
attributes, their types and allowed values) through :func:`check`. An entry point that
cannot be imported, or whose object its registry refuses, becomes a :class:`Broken`
record: one warning line on stderr naming its distribution, entry point and what is wrong.
A scenario that uses it fails with that line (exit code 3); every other scenario runs.

``AFTERSHOCK_NO_PLUGINS=1`` loads no entry point at all (as ``HYPOTHESIS_NO_PLUGINS`` and
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` do): the way out when a plug-in breaks the tool anyway.

Standard library only: the fault registry imports it, and the probe imports that package.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

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


# --------------------------------------------------------------------------- the registry

T = TypeVar("T")


class Registry(Generic[T]):
    """One kind of plug-in, found by name: Aftershock's own, registered as their modules are
    imported (``built_ins`` imports those that are not yet, on first use), and the objects of
    the entry-point group ``group`` (None: built-ins only), loaded once, on first use.

    An object is checked as it registers: against ``protocol`` (:func:`check`), then by
    ``accept``, which may refuse it (a ValueError saying why) and gives the entry to keep (the
    object, or what is read from it); one from an entry point also by ``from_plugin``. Its
    name (``name``, also the label of a refused object) must match ``names`` (the pattern, and
    what it allows, for the message) where given, and may not be another entry's.

    ``noun`` names the kind in messages (``fault kind``); an unknown name is refused naming
    the ``known_as`` ones (``none_known`` where there are none) and the skipped plug-in it
    may come from; with ``lists_skipped``, inside the parentheses, listing every skipped one
    when none claims the name (the presets' message)."""

    def __init__(
        self, noun: str, group: str | None, *, name: Callable[[Any], str],
        protocol: Sequence[Attr] = (), accept: Callable[[Any, dict[str, Any]], T] | None = None,
        from_plugin: Callable[[T], object] | None = None,
        built_ins: Callable[[], object] | None = None,
        claims: Callable[[Any], Iterable[str]] | None = None,
        names: tuple[re.Pattern[str], str] | None = None,
        known_as: str = "known", none_known: str = "", lists_skipped: bool = False,
    ) -> None:
        self.noun, self.group = noun, group
        self._name, self._protocol, self._accept = name, tuple(protocol), accept
        self._from_plugin, self._built_ins, self._names = from_plugin, built_ins, names
        self._claims = claims if claims is not None else lambda obj: [name(obj)]
        self._known_as, self._none_known, self._lists_skipped = known_as, none_known, lists_skipped
        self._entries: dict[str, T] = {}  # in the order they registered
        self._skipped: list[Broken] = []
        self._loaded = False

    # ------------------------------------------------------------------ registering

    def register(self, obj: Any) -> T:
        """Add ``obj``; ValueError (PluginProblem) when it is no valid entry or its name is
        another entry's. The same entry twice is no conflict (a module imported twice)."""
        return self._store(self._accepted(obj))

    def _accepted(self, obj: Any) -> T:
        found = check(obj, self.noun, self._protocol, self._name) if self._protocol else {}
        entry: T = self._accept(obj, found) if self._accept is not None else obj
        name = self._name(entry)
        if self._names is not None and not self._names[0].match(name):
            raise PluginProblem(f"{self.noun} name {name!r}: {self._names[1]}")
        return entry

    def _store(self, entry: T) -> T:
        name = self._name(entry)
        taken = self._entries.get(name)
        if taken is not None and taken is not entry and taken != entry:
            raise ValueError(f"{self.noun} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def _register_plugin(self, obj: Any) -> None:
        entry = self._accepted(obj)
        if self._from_plugin is not None:
            self._from_plugin(entry)
        self._store(entry)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first: a built-in module that looks something up finds it done
        if self._built_ins is not None:
            self._built_ins()
        if self.group is not None:
            self._skipped.extend(load(self.group, self._register_plugin, self._claims))

    # ------------------------------------------------------------------ looking up

    def get(self, name: str) -> T:
        """The entry called ``name``; KeyError saying which exist, and the skipped plug-in
        it may come from, otherwise."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self._unknown(name)) from None

    def _unknown(self, name: str) -> str:
        known = ", ".join(self.names()) or self._none_known
        why = why_unknown(self._skipped, name)
        if not self._lists_skipped:
            return f"unknown {self.noun} {name!r} ({self._known_as}: {known}){why}"
        if not why and self._skipped:
            listed = sorted({f"{b.name} ({b.value})" for b in self._skipped})
            why = f"; skipped as broken: {', '.join(listed)}"
        return f"unknown {self.noun} {name!r} ({self._known_as}: {known}{why})"

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def names(self) -> list[str]:
        """Every entry's name, sorted."""
        self._load()
        return sorted(self._entries)

    def entries(self) -> list[T]:
        """Every entry, in the order they registered."""
        self._load()
        return list(self._entries.values())

    def broken(self) -> list[Broken]:
        """The entry points of the group that were skipped, and why."""
        self._load()
        return list(self._skipped)

    def broken_for(self, name: str) -> Broken | None:
        """The skipped plug-in that a scenario naming ``name`` may be asking for, if any."""
        self._load()
        return None if name in self._entries else provider(self._skipped, name)

    # ------------------------------------------------------------------ for tests

    @contextmanager
    def added(self, obj: Any) -> Iterator[T]:
        """For tests: ``obj``, checked as any object is, registered for the block in place
        of any entry of its name; afterwards the registry is as it was."""
        self._load()  # now: loaded inside the block, built-ins would leave with it
        entry = self._accepted(obj)
        name = self._name(entry)
        before = self._entries.get(name)
        self._entries[name] = entry
        try:
            yield entry
        finally:
            if before is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = before

    @contextmanager
    def reloaded(self) -> Iterator[None]:
        """For tests: the entry-point group read again on first use in the block (it finds
        a distribution the test made); afterwards the registry is as it was."""
        self._load()
        entries, skipped = dict(self._entries), list(self._skipped)
        self._skipped.clear()
        self._loaded = False
        try:
            yield
        finally:
            self._entries.clear()
            self._entries.update(entries)
            self._skipped[:] = skipped
            self._loaded = True
