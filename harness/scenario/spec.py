"""Scenario files: the typed, strict, frozen schema.

The pydantic models here and in the modules they come from (faults_spec.py, expect.py,
space_spec.py) are the truth about what a scenario may say (``aftershock schema``
publishes them as JSON Schema). The loader (load.py) keeps every key's line and column,
so each problem is reported as ``path:line:column: where: what is wrong (what is allowed)``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Discriminator, Field, Tag, model_validator

from aftershock import faults
from aftershock.faults import contract, registry
from aftershock.harness import systems

# The parts of a scenario live in their own modules (faults_spec.py, expect.py,
# space_spec.py), and the system kinds' models and the log probe with their kinds
# (harness/systems/, harness/run/logprobe.py, harness/run/loadgen.py); they are named here
# too, where the scenario format is.
from aftershock.harness.run.loadgen import Load as Load
from aftershock.harness.run.loadgen import PromptMix as PromptMix
from aftershock.harness.run.loadgen import Ready as Ready
from aftershock.harness.run.loadgen import ScenarioLoad as ScenarioLoad
from aftershock.harness.run.logprobe import LogEventKind as LogEventKind
from aftershock.harness.run.logprobe import LogProbe as LogProbe
from aftershock.harness.scenario.expect import Budget as Budget
from aftershock.harness.scenario.expect import CountBudget as CountBudget
from aftershock.harness.scenario.expect import DetectBudget as DetectBudget
from aftershock.harness.scenario.expect import Expect as Expect
from aftershock.harness.scenario.expect import Latency as Latency
from aftershock.harness.scenario.expect import RateFloor as RateFloor
from aftershock.harness.scenario.faults_spec import FAULT_MODELS as FAULT_MODELS
from aftershock.harness.scenario.faults_spec import WINDOWED as WINDOWED
from aftershock.harness.scenario.faults_spec import At as At
from aftershock.harness.scenario.faults_spec import Every as Every
from aftershock.harness.scenario.faults_spec import Fault as Fault
from aftershock.harness.scenario.faults_spec import FaultDuration as FaultDuration
from aftershock.harness.scenario.faults_spec import FileWhen as FileWhen
from aftershock.harness.scenario.faults_spec import HealWhen as HealWhen
from aftershock.harness.scenario.faults_spec import Phase as Phase
from aftershock.harness.scenario.faults_spec import Target as Target
from aftershock.harness.scenario.faults_spec import UntilEvent as UntilEvent
from aftershock.harness.scenario.faults_spec import _FaultBase as _FaultBase
from aftershock.harness.scenario.faults_spec import in_process as in_process
from aftershock.harness.scenario.schema import MAX_SEED as MAX_SEED
from aftershock.harness.scenario.schema import MAX_STEPS as MAX_STEPS
from aftershock.harness.scenario.schema import MAX_WORLD as MAX_WORLD
from aftershock.harness.scenario.schema import Strict as _Strict
from aftershock.harness.scenario.space_spec import EventTrigger as EventTrigger
from aftershock.harness.scenario.space_spec import Explore as Explore
from aftershock.harness.scenario.space_spec import FileTrigger as FileTrigger
from aftershock.harness.scenario.space_spec import KindSpace as KindSpace
from aftershock.harness.scenario.space_spec import ParamSpan as ParamSpan
from aftershock.harness.scenario.space_spec import ParamValue as ParamValue
from aftershock.harness.scenario.space_spec import Span as Span
from aftershock.harness.scenario.space_spec import TargetFamily as TargetFamily
from aftershock.harness.scenario.space_spec import TimeSpan as TimeSpan
from aftershock.harness.scenario.space_spec import TriggerSpace as TriggerSpace
from aftershock.harness.systems.command import CommandSystem as CommandSystem
from aftershock.harness.systems.command import uses as uses_variable
from aftershock.harness.systems.server import ServerSystem as ServerSystem
from aftershock.harness.systems.trainer import TrainerSystem as TrainerSystem
from aftershock.harness.systems.trainer import World as World


def _system_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = systems.claimed(value)
    else:
        try:
            kind = systems.of(value)
        except TypeError:
            return None
    return None if kind is None else kind.name


def _system_union() -> Any:
    """The ``system:`` block: one of the system kinds (harness/systems/), told apart by the
    key and value each one claims."""
    kinds = systems.kinds()
    members = tuple(Annotated[k.model, Tag(k.name)] for k in kinds)
    shapes = [k.shape for k in kinds]
    named = shapes[0] if len(shapes) == 1 else f"{', '.join(shapes[:-1])} or {shapes[-1]}"
    return Annotated[
        Union[members],  # noqa: UP007 (a union of a runtime tuple)
        Discriminator(_system_tag, custom_error_type="system_kind",
                      custom_error_message=f"system needs {named}"),
    ]


if typing.TYPE_CHECKING:
    System = Any  # the union of the system kinds' models, built when this module loads
else:
    System = _system_union()


class Scenario(_Strict):
    """One scenario: what to launch, which faults to inject when, what must hold."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=100)
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    system: System
    load: ScenarioLoad | None = Field(
        None, description="the built-in load generator driving the OpenAI-compatible "
        "completions endpoint a `command:` starts (docs/own-job.md, \"Your own server\"); "
        "the reference server takes its load as `system.load`")
    faults: list[Fault] = Field(default_factory=list)
    expect: Expect = Expect()
    explore: Explore | None = Field(
        None, description="the space of fault schedules `aftershock explore` searches, with "
        "`expect` as its oracle")

    @model_validator(mode="after")
    def _checks_are_possible(self) -> Scenario:
        self._fault_checks_are_possible()
        kind = systems.of(self.system)
        self._load_is_possible(kind)
        self._family_checks_are_possible(kind)
        if self.expect.params_match == "replay" and not kind.replays(self.system):
            raise ValueError("expect.params_match: replay needs the reference trainer with "
                             "`recovery: elastic` (the only system that records membership)")
        for problem in kind.problems(self):
            raise ValueError(problem)
        setting = faults.Setting(kind.name, kind.root_is_run_folder(self.system))
        for name in sorted({str(f.kind) for f in self.faults}):
            check = registry.hooks(faults.get(name)).check
            if check is not None:
                for problem in check([f for f in self.faults if f.kind == name], setting):
                    raise ValueError(problem)
        return self

    def _fault_checks_are_possible(self) -> None:
        """Checks about a fault need one, and ``faults_landed`` one that can land."""
        if not self.faults:
            for name in ("time_to_detect", "time_to_recover", "single_history",
                         "checkpoint_durable"):
                if getattr(self.expect, name) not in (None, False):
                    raise ValueError(f"expect.{name} needs at least one fault")
        if self.expect.faults_landed and not any(
                f.at.file is not None and f.at.when in WINDOWED for f in self.faults):
            raise ValueError(
                "expect.faults_landed needs a fault triggered inside a write: `at: {file: "
                "GLOB, when: opened}` (or `modified`, `created`); `closed` and `deleted` come "
                "after the write, so they have no window to land in")

    def _family_checks_are_possible(self, kind: systems.SystemKind) -> None:
        """A serving check needs a server and a load, a training check a trainer."""
        for name in Expect.TRAINING if kind.family == "serving" else Expect.SERVING:
            if getattr(self.expect, name) in (None, False):
                continue
            if name in Expect.SERVING:
                if self.load is not None:
                    continue  # they read what the load's clients received
                raise ValueError(
                    f"expect.{name} needs a load: add a `load:` block (scenario-level) with the "
                    "server's url (`load: {url: 'http://127.0.0.1:${port}'}`, the command "
                    "listening on `--port=${port}`; docs/own-job.md, \"Your own server\"), or "
                    "run `reference: server`")
            shapes = [k.shape.strip("`") for k in systems.kinds() if k.family == "training"]
            raise ValueError(f"expect.{name} needs a training system (`{'` or `'.join(shapes)}`)")

    def _load_is_possible(self, kind: systems.SystemKind) -> None:
        if self.load is None:
            return
        if kind.family == "serving":
            raise ValueError(f"{kind.shape} takes its load as `system.load` (it says itself "
                             "where it listens); a scenario-level `load:` is for a server a "
                             "`command:` starts")
        if "${port}" in self.load.url and not (
                isinstance(self.system, CommandSystem) and uses_variable(self.system, "port")):
            raise ValueError("load.url uses ${port}, the free port the harness picks for the "
                             "run; the command must listen on it: pass it in `command` or "
                             "`env` (e.g. `--port=${port}`)")

    def without_faults(self) -> Scenario:
        """The fault-free twin of this scenario, used as the golden reference.

        Test hooks that inject faults through the environment (``AFTERSHOCK_INJECT_*``)
        are faults too, so the twin goes without them.
        """
        system = self.system
        env: dict[str, str] = getattr(system, "env", {})
        clean = {k: v for k, v in env.items() if not k.startswith(contract.INJECT_PREFIX)}
        if clean != env:
            system = system.model_copy(update={"env": clean})
        return self.model_copy(update={"faults": [], "expect": Expect(), "system": system})


@dataclass(frozen=True, slots=True)
class LoadedScenario:
    spec: Scenario
    path: Path
    text: str


def __getattr__(name: str) -> type[_FaultBase]:
    # The fault models by name (ProcessFreeze, StorageLoseUnsynced, ...), built per kind
    # in faults_spec.py; an unknown name is this module's, as Python says it.
    for model in FAULT_MODELS.values():
        if model.__name__ == name:
            return model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
