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
class ProcessEnd:
    """How one process of the system ended (a torchrun worker, or the launcher itself), as
    far as the evidence shows (harness/run/attempts.py); ``None`` where it shows nothing."""

    role: str  # "worker" or "launcher"
    attempt: int | None  # torchrun's restart count of the attempt it ended (attempt_N)
    rank: int | None
    local_rank: int | None
    pid: int | None
    agent: int | None  # the pid of the torchrun agent that started it
    exit_code: int | None
    signal: str | None  # "SIGKILL": the signal that ended it, or torchrun sent it
    exception: str | None  # its last exception's line: "EOFError: Ran out of input"
    where: str | None  # the last frame of the job's own code: "in load (train.py:31)"
    log: str | None  # the file the exception was read from
    evidence: tuple[str, ...] = ()  # what says so (harness/run/attempts.py: CHILD, LOG, GONE, ...)
    root_cause: bool = False  # the first failure torchrun saw in its attempt


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
    # What proves each time metric that was observed (metrics.metric_proofs): its events'
    # own clocks, or read times that only bound it from above.
    proofs: dict[str, str] = field(default_factory=dict)
    # How each process of the system ended (harness/run/attempts.py), and one line when every
    # restart died the same way ("2 restarts, each ended by EOFError: ...").
    ends: tuple[ProcessEnd, ...] = ()
    crash_loop: str | None = None

    def failed_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["checks"] = [asdict(c) for c in self.checks]
        data["faults"] = [asdict(f) for f in self.faults]
        data["ends"] = [asdict(e) for e in self.ends]
        return data
