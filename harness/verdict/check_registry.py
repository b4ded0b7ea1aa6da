"""The check registry: every check declared once by name, built in or from a plug-in.

A check is one :class:`Check`: its name, the one line the docs give it, its evaluation
over the run (:class:`Run`), the metric it judges, and where a scenario asks for it. The
built-in checks (harness/verdict/checks.py) are fields of ``expect:`` (``expect: {params_match:
fault_free}``); a check from another package is asked for under ``expect: {checks: {NAME:
ARGS}}``, its ARGS validated by its own ``model`` (a pydantic model; without one, ``true``).

Other packages add checks through the ``aftershock.checks`` entry-point group (an object,
or a list of them), loaded on first use like fault kinds (faults/plugins.py): an object
that is not a valid check is named in one line and skipped, and only a scenario that asks
for it fails (exit 3).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from aftershock.faults import plugins
from aftershock.harness.run.records import CheckResult, Event, FaultRecord
from aftershock.harness.scenario.schema import Strict
from aftershock.harness.verdict.metrics import Output

#: The base of a check's arguments model: unknown keys are errors, with file:line:col.
CheckParams = Strict

ENTRY_POINT_GROUP = "aftershock.checks"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the system under test ended, as the harness saw it."""

    exit_code: int | None
    timed_out: bool
    duration_s: float


@dataclass(frozen=True, slots=True)
class Run:
    """What a check judges: the run as the harness saw it.

    ``metrics``: the run's metrics (harness/verdict/metrics.py, docs/metrics.md); ``digests`` and
    ``baseline``: final parameter digests by rank, of the run and of its fault-free twin;
    ``outputs`` and ``baseline_outputs``: each request's tokens, likewise; ``world``: the
    configured world size; ``file_triggers``: fault index -> its `at.when`, for the faults a
    file triggers."""

    outcome: Outcome
    metrics: Mapping[str, float | int | None]
    faults: Sequence[FaultRecord] = ()
    digests: Mapping[int, str] = field(default_factory=dict)
    baseline: Mapping[int, str] | None = None
    events: Sequence[Event] = ()
    outputs: Mapping[str, Output] = field(default_factory=dict)
    baseline_outputs: Mapping[str, Output] | None = None
    world: int | None = None
    file_triggers: Mapping[int, str] = field(default_factory=dict)


#: A check's evaluation: (what the scenario expects, the run) -> its result(s).
Evaluate = Callable[[Any, Run], CheckResult | Iterable[CheckResult]]


@dataclass(frozen=True, slots=True)
class Check:
    """One check.

    ``evaluate`` gets what the scenario wrote for it (validated: an instance of ``model``,
    or ``True`` without one) and the run, and returns a CheckResult (or several). It must
    not guess in the system's favour: what it cannot see fails as "not observed".
    ``metric``: the metric it judges, if any (a key of ``Run.metrics``). ``field``: for a
    built-in check, the ``expect:`` field that asks for it (empty: it always runs, and
    returns nothing when it has nothing to judge)."""

    name: str
    doc: str
    evaluate: Evaluate
    model: type[BaseModel] | None = None
    metric: str | None = None
    field: str | None = None


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


#: What a plug-in check must offer (faults/plugins.py checks it at registration).
PROTOCOL = (
    plugins.required("name", "a lower-case name: letters, digits, '_'",
                     lambda v: isinstance(v, str) and bool(_NAME.match(v))),
    plugins.required("doc", "a one-line description", lambda v: isinstance(v, str) and bool(v)),
    plugins.required("evaluate", "a function (expectation, run) -> CheckResult",
                     plugins.is_callable),
    plugins.optional("model", "a pydantic model (the check's arguments) or None",
                     lambda v: v is None or _is_model(v)),
    plugins.optional("metric", "a metric name or None", lambda v: v is None or isinstance(v, str)),
)

def _from_object(obj: Any, found: dict[str, Any]) -> Check:
    check = Check(name=found["name"], doc=" ".join(found["doc"].split()),
                  evaluate=found["evaluate"], model=found.get("model"),
                  metric=found.get("metric"))
    if check.name in BUILT_IN:
        raise ValueError(f"check {check.name!r} is a built-in check's name")
    return check


def _name(check: Any) -> str:
    name: str = check.name
    return name


#: Aftershock's own checks (harness/verdict/checks.py), in the order they run and a report lists
# them.
BUILT_IN: plugins.Registry[Check] = plugins.Registry("check", None, name=_name)
#: The checks other packages add, by name (their entry points are loaded on first use).
PLUGINS: plugins.Registry[Check] = plugins.Registry(
    "check", ENTRY_POINT_GROUP, name=_name, protocol=PROTOCOL, accept=_from_object,
    known_as="plug-in checks", none_known="none installed")


def built_in(check: Check) -> Check:
    """Add one of Aftershock's own checks (harness/verdict/checks.py); they run in this order."""
    return BUILT_IN.register(check)


def register(obj: Any) -> Check:
    """Add a check from another package: a :class:`Check`, or any object with its
    attributes (:data:`PROTOCOL`); PluginProblem (a ValueError) saying what is wrong."""
    return PLUGINS.register(obj)


def built_ins() -> list[Check]:
    """Aftershock's own checks, in the order a report lists them."""
    return BUILT_IN.entries()


def from_plugins() -> list[Check]:
    """The checks other packages added (their entry points are loaded on first use)."""
    return PLUGINS.entries()


def plugin(name: str) -> Check:
    """The plug-in check ``name``; KeyError saying which exist (and a skipped plug-in that
    may have provided it) otherwise."""
    return PLUGINS.get(name)


def broken_for(name: str) -> plugins.Broken | None:
    """The skipped plug-in a scenario asking for check ``name`` may be asking for."""
    return PLUGINS.broken_for(name)


def run_one(check: Check, expectation: Any, run: Run) -> list[CheckResult]:
    """``check``'s results on ``run``. A plug-in's evaluation that raises, or returns
    something other than CheckResults, fails its check saying so: it cannot break the run's
    other checks."""
    try:
        got = check.evaluate(expectation, run)
        results = [got] if isinstance(got, CheckResult) else list(got)
    except Exception as exc:
        return [CheckResult(check.name, False, None, "a result",
                            f"not observed: the check raised {type(exc).__name__}: {exc}")]
    if all(isinstance(r, CheckResult) for r in results):
        return results
    return [CheckResult(check.name, False, None, "a result",
                        f"not observed: the check returned {results!r:.80}, not CheckResults")]


def parse_args(name: str, value: Any) -> Any:
    """What ``expect: {checks: {NAME: VALUE}}`` asks of plug-in check ``name``: VALUE
    validated by its model (``True`` for a check without one); ValueError otherwise."""
    check = plugin(name)
    if check.model is None:
        if value is not True:
            raise ValueError(f"check {name!r} takes no arguments: write `{name}: true`")
        return True
    return check.model.model_validate({} if value is True else value)
