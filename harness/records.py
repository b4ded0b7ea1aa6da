"""Runtime records: what a run produced, as small frozen types.

These are the JSON run record of DESIGN.md ("Run record"), one field for one
key, so `to_json` is a plain `asdict` and the contract is visible here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    """One line of ``events.jsonl``.

    ``t`` is ``time.monotonic()`` of the process that wrote it (one clock per
    host); ``event`` its kind; ``source`` who wrote it (``harness``, ``rank3``,
    ``log``); the remaining keys are the event's own fields.
    """

    t: float
    event: str
    source: str
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int | None:
        value = self.fields.get("rank")
        return int(value) if isinstance(value, int | str) and str(value).isdigit() else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        data = dict(data)
        t = float(data.pop("t"))
        event = str(data.pop("event"))
        source = str(data.pop("source", "unknown"))
        return cls(t=t, event=event, source=source, fields=data)

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.event, "source": self.source, **self.fields}


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    passed: bool
    observed: Any
    expected: Any
    message: str


@dataclass(frozen=True, slots=True)
class FaultRecord:
    kind: str
    target: str
    injected_at_s: float | None
    healed_at_s: float | None
    detail: str = ""
    fault: int | None = None  # its index in the scenario's `faults`


@dataclass(frozen=True, slots=True)
class RunResult:
    name: str
    file: str
    passed: bool
    seed: int
    duration_s: float
    checks: tuple[CheckResult, ...]
    metrics: dict[str, float | int | None]
    faults: tuple[FaultRecord, ...]
    run_dir: str
    error: str | None = None  # why the run has no verdict (interrupted, harness error)
    interrupted: bool = False  # Ctrl-C or SIGTERM ended it before its checks

    def failed_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["checks"] = [asdict(c) for c in self.checks]
        data["faults"] = [asdict(f) for f in self.faults]
        return data
