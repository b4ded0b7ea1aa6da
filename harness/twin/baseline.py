"""The fault-free twin of a scenario: its cache key, its cache, and what it produced.

`params_match: fault_free` and `outputs_match: fault_free` compare a run with the same
scenario run without faults. That twin is itself a run; this module never runs one: it is
handed the function that does (``run``), so the run loop can depend on it and not the
other way round. Results are cached by what decides them (:func:`baseline_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aftershock.faults import contract
from aftershock.harness import systems
from aftershock.harness.run import _files
from aftershock.harness.run.loadgen import twin_key as load_key
from aftershock.harness.run.records import Event
from aftershock.harness.scenario.spec import LoadedScenario, Scenario
from aftershock.harness.twin import golden
from aftershock.harness.twin._paths import cache_dir as cache_dir  # re-exported: runner, recheck
from aftershock.harness.twin._paths import untrusted
from aftershock.harness.verdict import metrics as _metrics
from aftershock.harness.verdict.checks import Outcome

CACHE_ENV = contract.CACHE_ENV


class Ran(Protocol):
    """What a run of the twin left: its timeline and how it ended."""

    @property
    def events(self) -> list[Event]: ...

    @property
    def outcome(self) -> Outcome: ...


#: Runs a scenario (the twin) to its end.
RunTwin = Callable[[Scenario], Ran]


def _code_fingerprint(spec: Scenario, scenario_dir: Path) -> str:
    """The code a fault-free twin runs, by content (its system kind says what that is)."""
    return systems.of(spec.system).fingerprint(spec.system, scenario_dir)


def baseline_key(spec: Scenario, seed: int, *, scenario_dir: Path = Path(".")) -> str:
    """The cache key of a scenario's fault-free twin: what decides its result (the system
    without pacing, detection and what only recovery keeps: golden.twin_system), its
    environment, the seed, the code it runs (``scenario_dir``: where the scenario file
    is, from which a command's relative paths are found) and the platform it runs on."""
    system = golden.twin_system(spec)
    # The twin's environment: test hooks that break the system through it (AFTERSHOCK_INJECT_*)
    # are faults, which the twin goes without.
    system["env"] = dict(spec.without_faults().system.env)
    # The platform: the same code on another ISA, CPU or torch gives other bits.
    material: dict[str, Any] = {"system": system, "seed": seed,
                                "code": _code_fingerprint(spec, scenario_dir),
                                "platform": golden.platform_key(spec)}
    if spec.load is not None:  # the requests the twin's server answered
        material["load"] = load_key(spec.load)
    text = json.dumps(material, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def twin_of(spec: Scenario) -> Scenario:
    """The scenario the fault-free twin runs: no faults, no checks, and no pacing (pacing
    never changes the math; the golden run goes at full speed)."""
    twin = spec.without_faults()
    return twin.model_copy(update={"system": systems.of(twin.system).twin(twin.system)})


def fault_free_result(
    loaded: LoadedScenario, *, seed: int, run_dir: Path, use_cache: bool, what: str,
    run: RunTwin,
) -> tuple[dict[str, Any] | None, str]:
    """What the fault-free twin produced (``what``: its final parameter ``digests`` or its
    requests' ``outputs``), from the cache or by running it with ``run``."""
    spec = loaded.spec
    key = baseline_key(spec, seed, scenario_dir=loaded.path.parent)
    cached = cache_dir() / "fault_free" / f"{key}.json"
    distrust = untrusted(cached) if use_cache and os.path.lexists(cached) else None
    if use_cache and cached.exists() and distrust is None:
        with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
            return read_cached(cached, what), f"cached ({cached})"
    execution = run(twin_of(spec))
    found: dict[str, Any]
    if what == "outputs":
        found = {rid: out.to_json() for rid, out in _metrics.outputs(execution.events).items()}
        complete = _metrics.serving(execution.events)["lost_requests"] == 0
    else:
        found = {str(k): v for k, v in _metrics.final_digests(execution.events).items()}
        complete = True
    if execution.outcome.exit_code != 0 or not found or not complete:
        return None, (f"fault-free run failed (exit {execution.outcome.exit_code}"
                      f"{'' if complete else ', requests lost'}); see {run_dir}")
    if distrust is not None:
        return found, f"{UNTRUSTED}: {distrust}; the twin ran again ({run_dir})"
    _write_atomically(cached, json.dumps({what: found, "seed": seed, "scenario": spec.name}))
    return found, f"ran ({run_dir})"


#: How a note on a twin that the cache had but could not prove its own begins.
UNTRUSTED = "cached twin not trusted"


#: The largest cached twin read (one holds a digest per rank, or a few hundred requests).
CACHED_LIMIT = 16 << 20


def read_cached(path: Path, what: str) -> dict[str, Any]:
    """A cached twin's ``digests`` or ``outputs``, read as a regular file, capped (check
    :func:`untrusted` first). ValueError, OSError, KeyError or TypeError if it is no twin."""
    data = _files.loads(_files.read_capped(path, CACHED_LIMIT, what="a cached twin"),
                        depth=16)
    return dict(data[what])


def _write_atomically(path: Path, text: str) -> None:
    """``text`` as ``path``, whole or not at all. The temporary file is this writer's own:
    harnesses side by side (``pytest -n``) may cache the same twin at the same moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
