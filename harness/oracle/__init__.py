"""Oracles: the expected result of a run, computed without the code under test.

A check that compares a run with a second run of the same code (a replay, a fault-free twin)
cannot see a bug both share. An oracle here restates the reference trainer's math from its
specification (``aftershock.harness.oracle.trainer_math``; it imports nothing from
``reference_impl``)
and recomputes the final parameters a run must end with.

Why in the harness: an oracle is part of the judge. It knows the reference trainer only as a
specification (the model, the data, the optimizer and the membership the run recorded), the way
a scenario knows a system only by its command line. This module stays torch-free (``import
harness`` must not import torch); the math runs in a fresh process of the same interpreter,
with one thread like a rank.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aftershock._root import child_pythonpath
from aftershock.harness.run import _files

if TYPE_CHECKING:
    from aftershock.harness.systems.trainer import TrainerSystem

#: The math takes ~1 s for 60 steps on a 2-core machine; this only bounds a hang.
TIMEOUT_S = 300.0
#: The largest membership log read: one short line per generation.
MEMBERSHIP_LIMIT = 4 << 20


@dataclass(frozen=True, slots=True)
class Generation:
    """From step ``first_step`` (1-based) on, the data-parallel replicas ``replicas`` train."""

    first_step: int
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Expected:
    """What an oracle expects: each rank's final digest, or None and why not."""

    digests: dict[int, str] | None
    note: str


def read_membership(path: Path) -> list[Generation]:
    """A run's ``membership.jsonl`` → the generations whose steps count, in order.

    Each line is ``{"gen", "first_step", "replicas"}``, written when a generation resumed. A
    generation that resumed at or before an earlier one's first step replaces it from there
    (the earlier one's later steps were never kept). Raises ValueError for a malformed log.
    """
    # Written by the job under test: a regular file of the run folder, capped.
    text = _files.read_capped(path, MEMBERSHIP_LIMIT, what="a membership log")
    schedule: list[Generation] = []
    for number, line in enumerate(text.decode(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = _files.loads(line, depth=4)
            first = int(entry["first_step"])
            replicas = tuple(sorted(int(r) for r in entry["replicas"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a membership entry ({exc})") from None
        while schedule and schedule[-1].first_step >= first:
            schedule.pop()
        schedule.append(Generation(first, replicas))
    if not schedule:
        raise ValueError(f"{path}: no generation recorded")
    if schedule[0].first_step != 1:
        raise ValueError(f"{path}: the first generation starts at step "
                         f"{schedule[0].first_step}, not 1")
    return schedule


def full_membership(system: TrainerSystem) -> list[Generation]:
    """A run without membership changes: every replica, every step."""
    return [Generation(1, tuple(range(system.world.replicas)))]


def unsupported(*, backend: str, replicas: int, shards: int, schedule: list[Generation]
                ) -> str | None:
    """Why the oracle cannot reproduce this layout bitwise, or None (see trainer_math)."""
    if backend == "nccl" and (shards != 1 or replicas != 1):
        return (f"backend nccl with {replicas} replicas x {shards} shards: only one NCCL "
                "rank is restated (on the GPU: a sum of one term); NCCL's sums of several "
                "are out of reach")
    if backend not in ("gloo", "nccl"):
        return f"backend {backend}: only Gloo on CPU and one NCCL rank are restated"
    if shards not in (1, 2):
        return (f"{shards} shards: a tensor-parallel sum of more than 2 terms depends on "
                "Gloo's reduction order")
    for generation in schedule:
        if not 1 <= len(generation.replicas) <= 2:
            return (f"{len(generation.replicas)} live replicas from step "
                    f"{generation.first_step}: a data-parallel sum of more than 2 terms "
                    "depends on Gloo's reduction order")
        outside = [r for r in generation.replicas if not 0 <= r < replicas]
        if outside:
            return f"replicas {outside} from step {generation.first_step} are not in the world"
    return None


def trainer_digests(system: TrainerSystem, *, seed: int, schedule: list[Generation],
                    env: Mapping[str, str] | None = None) -> Expected:
    """The reference trainer's final digests for this system, seed and membership, from its
    math alone. ``digests`` is None (with the reason) when the layout is not reproducible
    bitwise, or when the computation failed: the check then fails as not observed. ``env``:
    settings over the harness's environment that change how kernels round (MKL_CBWR, ...),
    as the trainer's ranks get them."""
    why = unsupported(backend=system.backend, replicas=system.world.replicas,
                      shards=system.world.shards, schedule=schedule)
    if why is not None:
        return Expected(None, f"not observed: the independent oracle cannot reproduce {why}")
    request = {
        "replicas": system.world.replicas, "shards": system.world.shards, "seed": seed,
        "steps": system.steps, "device": "cuda" if system.backend == "nccl" else "cpu",
        "schedule": [[g.first_step, list(g.replicas)] for g in schedule],
    }
    answer = ask("aftershock.harness.oracle.trainer_math", request, env)
    if isinstance(answer, str):
        return Expected(None, f"not observed: the independent oracle {answer}")
    try:
        found = answer["digests"]
        digests = {int(rank): str(value) for rank, value in found.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Expected(None, f"not observed: the independent oracle said nothing usable ({exc})")
    shown = ", ".join(f"{g.replicas} from step {g.first_step}" for g in schedule)
    return Expected(digests, f"recomputed from the model's math (replicas {shown})")


def ask(module: str, request: Mapping[str, Any],
        env: Mapping[str, str] | None = None) -> dict[str, Any] | str:
    """An oracle's answer to ``request``: ``python -m module`` in a process of its own (the
    interpreter that runs the harness, this copy first on its path), the request as JSON on
    its stdin, its answer as a JSON object on its stdout; or why there is none ("did not
    run (...)", "failed (...)", "said nothing usable (...)")."""
    child = {**os.environ, **(env or {}), "PYTHONPATH": child_pythonpath()}
    asked = (module, json.dumps(request, sort_keys=True), tuple(sorted(child.items())))
    if asked in _ANSWERS:
        return copy.deepcopy(_ANSWERS[asked])
    answer = _ask(module, request, child)
    if isinstance(answer, dict):
        _ANSWERS[asked] = copy.deepcopy(answer)
    return answer


#: The oracles' answers in this process, by module, request and environment: an oracle is a
#: pure computation of those, and a search asks the same question (its twin's) every run.
_ANSWERS: dict[tuple[str, str, tuple[tuple[str, str], ...]], dict[str, Any]] = {}


def _ask(module: str, request: Mapping[str, Any], child: dict[str, str]) -> dict[str, Any] | str:
    """``ask`` in a fresh process, every time."""
    try:
        proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(request),
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=child,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"did not run ({exc})"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"failed ({tail[0]})"
    try:
        answer = json.loads(proc.stdout)
    except ValueError as exc:
        return f"said nothing usable ({exc})"
    return answer if isinstance(answer, dict) else "said nothing usable (not a JSON object)"
