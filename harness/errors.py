"""The exception tree. Inside the engine, failures are data on the timeline;
these exceptions exist for the boundary (CLI exit codes, pytest failures)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aftershock.harness.run.records import RunResult


class AftershockError(Exception):
    """Root of every error Aftershock raises on purpose."""


class SpecError(AftershockError):
    """A scenario file is invalid. Each problem is ``path:line:column: message``."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class PluginError(SpecError):
    """A scenario uses a plug-in that was skipped as broken (faults/plugins.py): exit code 3,
    since the installation, not the scenario, is at fault. Each problem names the plug-in's
    distribution and entry point and what is wrong with it, in one line."""


class RunDirBusy(AftershockError):
    """Another run holds the run folder (exit code 2): nothing was run, and nothing of the
    other run was touched."""


class HarnessError(AftershockError):
    """The harness itself could not do its job (exit code 3)."""


class TargetError(HarnessError):
    """The system under test could not be launched or observed."""


class PreflightError(HarnessError):
    """This machine lacks what a scenario's faults need (a tool, a kernel feature, a
    privilege); found before anything is launched. The message says how to get it."""


class RunFailed(HarnessError):
    """A scenario run ended in a harness error; ``result`` is its record, already written
    to the run folder, so `--json` and JUnit can show the run too."""

    def __init__(self, message: str, result: RunResult) -> None:
        super().__init__(message)
        self.result = result
