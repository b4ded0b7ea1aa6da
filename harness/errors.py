"""The exception tree. Inside the engine, failures are data on the timeline;
these exceptions exist for the boundary (CLI exit codes, pytest failures)."""

from __future__ import annotations


class AftershockError(Exception):
    """Root of every error Aftershock raises on purpose."""


class SpecError(AftershockError):
    """A scenario file is invalid. Each problem is ``path:line:column: message``."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class HarnessError(AftershockError):
    """The harness itself could not do its job (exit code 3)."""


class TargetError(HarnessError):
    """The system under test could not be launched or observed."""
