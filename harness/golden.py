"""Golden results of fault-free twins: recorded on purpose, stored beside the scenarios.

`params_match: fault_free` and `outputs_match: fault_free` compare a run with its fault-free
twin, which the *current* code computes; a bug on the fault-free path (data order, init, the
optimizer) is in the twin too, and the comparison cannot see it. A golden result is the twin's
result recorded once, on purpose (``aftershock golden --update PATHS``, as pytest-regressions
and syrupy record snapshots), and checked in: every later run whose twin disagrees fails the
``fault_free_golden`` check.

Storage: one ``golden.json`` per scenario folder (data beside the scenarios; scenarios/ holds
no Python). Scenarios of a folder whose systems differ only in what never changes a fault-free
run's math share one twin, hence one entry. An entry is keyed by

- ``system``: the twin's system, without what never changes its result (``twin_system``) and
  without ``env`` (the reference systems' math must not depend on the environment: a change
  there is exactly what a golden must catch);
- ``seed``;
- ``platform``: torch's version and build, the CPU (architecture and the vector ISA torch
  dispatches to), the BLAS code path MKL dispatches its matmuls to where torch uses MKL
  (it picks by vendor, not only by ISA: its generic code on an AMD CPU, its AVX-512
  kernels on an Intel one, with other bits) and the device (CPU, or the GPU and CUDA
  version). Kernels round differently on other platforms, so a GPU run is never compared
  with a CPU golden.

No entry for this key (a new platform, another seed, a changed system): for the reference
trainer on a layout the independent oracle reproduces (harness.oracle), the twin is checked
against the oracle instead; otherwise the check fails as "not observed" and says how to record
one. A scenario folder without a golden.json has no golden check. Goldens are for the
reference systems: a command's platform is not known to the harness.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import systems
from harness._paths import cache_dir
from harness.errors import SpecError
from harness.records import CheckResult
from harness.spec import LoadedScenario, Scenario, TrainerSystem, load_scenario

FILE = "golden.json"
CHECK = "fault_free_golden"
ABOUT = ("Golden results of the fault-free twins of the scenarios in this folder, recorded on "
         "purpose with `aftershock golden --update`; see docs/scenarios.md (Golden results).")

def twin_system(spec: Scenario) -> dict[str, Any]:
    """The part of ``spec.system`` that decides its fault-free twin's result, ``env`` aside
    (its system kind says which fields only pace, detect or serve recovery)."""
    return systems.of(spec.system).twin_key(spec.system)


def trainer_of(system: Any) -> TrainerSystem | None:
    """The reference trainer a system runs, as one host would run it (what the independent
    oracle restates): itself, or the trainer on every node of a `nodes: N` system."""
    if isinstance(system, TrainerSystem):
        return system
    as_trainer = getattr(system, "as_trainer", None)
    if callable(as_trainer) and getattr(system, "trainer", None) is not None:
        found = as_trainer()
        return found if isinstance(found, TrainerSystem) else None
    return None


def what_of(spec: Scenario) -> str | None:
    """What a golden of this scenario holds: ``digests`` or ``outputs``; None: no golden."""
    kind = systems.of(spec.system).golden
    if kind == "digests" and spec.expect.params_match == "fault_free":
        return "digests"
    if kind == "outputs" and spec.expect.outputs_match == "fault_free":
        return "outputs"
    return None


def path_of(scenario: Path) -> Path:
    return scenario.parent / FILE


def outputs_digest(outputs: Mapping[Any, Any]) -> str:
    """sha256 of every request's tokens and per-token logits digests, in request order.

    An output is a ``metrics.Output``, its JSON form (``{"tokens", "digests"}``, as the twin
    cache keeps it) or a bare token list (digests unknown): all three canonicalize alike."""
    def canonical(value: Any) -> dict[str, Any]:
        data = value.to_json() if hasattr(value, "to_json") else value
        if isinstance(data, Mapping):
            tokens, digests = list(data.get("tokens") or ()), list(data.get("digests") or ())
        else:
            tokens, digests = list(data), []
        return {"tokens": [int(t) for t in tokens],
                "digests": (digests + [None] * len(tokens))[: len(tokens)]}

    text = json.dumps({str(k): canonical(v) for k, v in sorted(outputs.items())},
                      separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------ platform

_PLATFORM = r"""
import platform, sys
import torch
# Two dispatchers decide the bits: ATen's, by the vector ISA (ATEN_CPU_CAPABILITY=avx2 selects
# its AVX2 kernels on a newer CPU), and MKL's for matmuls, by vendor and ISA (its generic code
# on an AMD CPU, AVX-512 kernels on an Intel one: other bits on two "AVX512" machines). The
# harness reads MKL's choice from its verbose line (mkl_path); ATEN_CPU_CAPABILITY leaves it.
isa = torch.backends.cpu.get_cpu_capability()
cpu = " ".join(p for p in (platform.machine(), isa) if p)
if sys.argv[1] == "cuda":
    device = (f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
              if torch.cuda.is_available() else "cuda (unavailable)")
else:
    device = "cpu"
if torch.backends.mkl.is_available():
    # One matmul under MKL_VERBOSE=1: MKL names the code path it dispatched to (mkl_path).
    torch.ones(64, 64) @ torch.ones(64, 64)
print(f"torch {torch.__version__}; {cpu}; {device}", flush=True)
"""

#: Bumped when the platform line's format changes, so cached lines are asked again.
_FORMAT = "2"
#: What MKL reads to pick (or pin) its code path: part of the platform's key.
_MKL_ENV = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "MKL_NUM_THREADS")
_MKL_HEADER = re.compile(r"^MKL_VERBOSE .*\bProduct build\b")


def mkl_path(header: str) -> str:
    """The code path MKL names in its first verbose line (``... for Intel(R) 64 architecture
    <path>, Lnx ...``), in a word: avx512, avx2, avx, sse4.2, or generic (what it runs on a
    CPU it does not tune for, an AMD one among them)."""
    found = re.search(r"architecture (.*?), (?:Lnx|Win|OSX|Mac)", header)
    path = found.group(1) if found else header
    for needle, name in (("AVX-512", "avx512"), ("AVX512", "avx512"), ("AVX2", "avx2"),
                         ("(Intel(R) AVX)", "avx"), ("SSE4.2", "sse4.2"), ("SSE4_2", "sse4.2"),
                         ("Intel(R) Architecture processors", "generic")):
        if needle in path:
            return name
    return re.sub(r"[^a-z0-9.]+", "-", path.lower()).strip("-")[:60] or "unknown"


def device_of(spec: Scenario) -> str:
    return systems.of(spec.system).device(spec.system)


def _cpu_key(executable: str) -> str | None:
    """Everything the CPU platform line depends on, without importing torch: the interpreter,
    the torch installation it imports (its version file, by content and time), the CPU's
    feature flags (the ISA torch's dispatcher picks from) and ATEN_CPU_CAPABILITY (which can
    lower it). None when torch cannot be located this way: then nothing is cached."""
    try:
        spec = importlib.util.find_spec("torch")
        origin = spec.origin if spec is not None else None
        if origin is None:
            return None
        version = Path(origin).with_name("version.py")
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
        vendor = next((line for line in cpuinfo if line.startswith(("vendor_id", "model name",
                                                                    "CPU implementer"))), "")
        parts = [_FORMAT, os.path.realpath(executable), str(version), version.read_text(),
                 str(version.stat().st_mtime_ns), flags, vendor, platform.machine(),
                 os.environ.get("ATEN_CPU_CAPABILITY", ""),
                 *(os.environ.get(name, "") for name in _MKL_ENV)]
    except (OSError, ImportError, ValueError):
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _cache_file(key: str) -> Path:
    return cache_dir() / "platform" / f"{key}.txt"


@functools.cache
def _platform(executable: str, device: str) -> str:
    """The platform line, from torch in a fresh process of ``executable``.

    On CPU the answer is kept on disk under a key of everything it depends on (_cpu_key):
    asking torch costs a torch import (~4 s of CPU, twice that on a busy 2-core host) in
    every ``aftershock run``, for an answer that changes only with the installation or the
    machine. A GPU's line (its name, CUDA) is asked every time."""
    key = _cpu_key(executable) if device == "cpu" else None
    cached = _cache_file(key) if key else None
    if cached is not None:
        with contextlib.suppress(OSError):
            line = cached.read_text().strip()
            if line:
                return line
    proc = subprocess.run([executable, "-c", _PLATFORM, device], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "MKL_VERBOSE": "1"})
    output = proc.stdout.strip().splitlines()
    lines = [line for line in output if not line.startswith("MKL_VERBOSE")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot tell the platform ({tail})")
    header = next((line for line in output if _MKL_HEADER.match(line)), None)
    if header is not None:  # before the device: "torch V; x86_64 ISA; MKL path; device"
        head, _, device_part = lines[-1].rpartition("; ")
        lines[-1] = f"{head}; MKL {mkl_path(header)}; {device_part}"
    if cached is not None:
        with contextlib.suppress(OSError):
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
            tmp.write_text(lines[-1] + "\n")
            os.replace(tmp, cached)
    return lines[-1]


def platform_key(spec: Scenario) -> str:
    """What a run's bits depend on besides the scenario, without importing torch: the
    device it runs on and, for the CPU's kernels, :func:`_cpu_key` ("unknown" when torch
    cannot be located: then only the device)."""
    return f"{device_of(spec)}:{_cpu_key(sys.executable) or 'unknown'}"


def platform_of(spec: Scenario) -> str:
    """Where a reference system runs, as far as its bits go (the interpreter the harness
    launches it with: the harness's own)."""
    return _platform(sys.executable, device_of(spec))


# ------------------------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class Key:
    system: dict[str, Any]
    seed: int
    platform: str

    def matches(self, entry: Mapping[str, Any]) -> bool:
        return (entry.get("system") == self.system and entry.get("seed") == self.seed
                and entry.get("platform") == self.platform)


def key_of(spec: Scenario, seed: int) -> Key:
    return Key(twin_system(spec), seed, platform_of(spec))


def read(path: Path) -> list[dict[str, Any]]:
    """The entries of a golden file; ValueError if it is not one."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    entries = data.get("goldens") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: no `goldens` list")
    return entries


def write(path: Path, entries: list[dict[str, Any]]) -> None:
    ordered = sorted(entries, key=lambda e: (str(e.get("platform")), int(e.get("seed", 0)),
                                             json.dumps(e.get("system"), sort_keys=True)))
    text = json.dumps({"about": ABOUT, "goldens": ordered}, indent=2) + "\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def entry_for(key: Key, what: str, found: Mapping[Any, Any], scenarios: Sequence[str],
              checked_by: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"system": key.system, "seed": key.seed, "platform": key.platform,
                             "scenarios": sorted(set(scenarios))}
    if what == "digests":
        entry["digests"] = {str(k): str(v) for k, v in sorted(found.items(), key=_rank_order)}
    else:
        entry["outputs_sha256"] = outputs_digest(found)
        entry["requests"] = len(found)
    entry["checked_by"] = checked_by
    return entry


def _rank_order(item: tuple[Any, Any]) -> int:
    return int(item[0])


# --------------------------------------------------------------------------------- check


def check(loaded: LoadedScenario, *, seed: int, what: str,
          found: Mapping[Any, Any] | None) -> CheckResult | None:
    """``fault_free_golden``: the twin's result (``found``: digests by rank, or outputs by
    request) against the golden of its folder. None when the folder keeps no goldens."""
    path = path_of(loaded.path)
    if what_of(loaded.spec) != what or not path.exists():
        return None
    expected = "equal to its golden result"
    if found is None:
        return CheckResult(CHECK, False, None, expected,
                           "not observed: the fault-free run produced nothing to compare")
    try:
        entries = read(path)
        key = key_of(loaded.spec, seed)
    except (ValueError, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return CheckResult(CHECK, False, None, expected, f"not observed: {exc}")
    expected = f"equal to its golden ({key.platform})"
    entry = next((e for e in entries if key.matches(e)), None)
    if entry is None:
        return _without_golden(loaded, key, path, entries, what, found)
    if what == "digests":
        want = {int(k): str(v) for k, v in dict(entry.get("digests") or {}).items()}
        got = {int(k): str(v) for k, v in found.items()}
        ranks = sorted(set(want) | set(got))
        differ = [r for r in ranks if want.get(r) != got.get(r)]
        observed = f"{len(ranks) - len(differ)}/{len(ranks)} ranks equal"
        if differ:
            detail = ", ".join(f"rank {r}: {str(got.get(r))[:12]} != {str(want.get(r))[:12]}"
                               for r in differ)
            return CheckResult(CHECK, False, observed, expected,
                               f"the fault-free run's parameters differ from the golden in "
                               f"{path}: {detail}. The fault-free path changed; if on "
                               f"purpose, record it: aftershock golden --update {loaded.path}")
        return CheckResult(CHECK, True, observed, expected,
                           f"the fault-free run equals the golden in {path}")
    digest = outputs_digest(found)
    want_digest = str(entry.get("outputs_sha256"))
    if digest != want_digest:
        return CheckResult(CHECK, False, f"outputs {digest[:12]}", expected,
                           f"the fault-free run's outputs differ from the golden in {path} "
                           f"({len(found)} requests, sha256 {digest[:12]} != "
                           f"{want_digest[:12]}). The fault-free path changed; if on purpose, "
                           f"record it: aftershock golden --update {loaded.path}")
    return CheckResult(CHECK, True, f"outputs {digest[:12]}", expected,
                       f"the fault-free run's {len(found)} outputs equal the golden in {path}")


def _without_golden(loaded: LoadedScenario, key: Key, path: Path,
                    entries: list[dict[str, Any]], what: str,
                    found: Mapping[Any, Any]) -> CheckResult:
    """No golden for this system, seed and platform: the oracle, where it can judge."""
    from harness import oracle

    same_system = [e for e in entries if e.get("system") == key.system]
    if not same_system:
        missing = "for this system (the scenario's system changed since, or is new)"
    elif not [e for e in same_system if e.get("seed") == key.seed]:
        missing = f"for seed {key.seed}"
    else:
        missing = "for this platform (recorded on: " + "; ".join(
            sorted({f"[{e.get('platform')}]" for e in same_system})) + ")"
    hint = (f"{path} has no golden {missing}; record one on purpose: "
            f"aftershock golden --update {loaded.path}")
    system = trainer_of(loaded.spec.system)
    if what == "digests" and system is not None:
        expected = oracle.trainer_digests(system, seed=key.seed,
                                          schedule=oracle.full_membership(system))
        if expected.digests is not None:
            got = {int(k): str(v) for k, v in found.items()}
            ranks = sorted(set(expected.digests) | set(got))
            differ = [r for r in ranks if expected.digests.get(r) != got.get(r)]
            observed = f"{len(ranks) - len(differ)}/{len(ranks)} ranks equal"
            verdict = ("equals" if not differ else
                       f"differs in ranks {', '.join(map(str, differ))} from")
            return CheckResult(CHECK, not differ, observed, "equal to the independent oracle",
                               f"the fault-free run {verdict} the independent oracle ({hint})")
        why = expected.note.removeprefix("not observed: ")
        return CheckResult(CHECK, False, None, f"a golden for [{key.platform}]",
                           f"not observed: {hint}; and {why}")
    return CheckResult(CHECK, False, None, f"a golden for [{key.platform}]",
                       f"not observed: {hint}")


# -------------------------------------------------------------------------------- update


@dataclass(frozen=True, slots=True)
class Update:
    """What ``aftershock golden --update`` did for one scenario."""

    scenario: Path
    status: str  # recorded | changed | unchanged | skipped | refused | failed
    message: str

    @property
    def ok(self) -> bool:
        return self.status not in ("refused", "failed")


def update(scenarios: Sequence[LoadedScenario], *, seed: int | None, use_cache: bool,
           run_root: Path, observer: Any = None) -> list[Update]:
    """Run each scenario's fault-free twin (once per twin) and record its result as the golden
    of the scenario's folder, for this platform and seed.

    A trainer twin the independent oracle can reproduce must agree with it, or nothing is
    recorded: a golden is only worth what it was checked against. Entries of systems that no
    scenario of a folder uses any more are dropped when the whole folder was updated."""
    from harness import oracle, runner

    observer = observer or runner.NullObserver()
    results: list[Update] = []
    twins: dict[str, tuple[Mapping[str, Any] | None, str, str]] = {}
    for loaded in scenarios:
        what = what_of(loaded.spec)
        if what is None:
            why = ("goldens are for the reference trainer and server"
                   if systems.of(loaded.spec.system).golden is None else
                   "it compares with no fault-free twin (params_match/outputs_match: "
                   "fault_free)")
            results.append(Update(loaded.path, "skipped", why))
            continue
        this_seed = loaded.spec.seed if seed is None else seed
        twin = runner.baseline_key(loaded.spec, this_seed, scenario_dir=loaded.path.parent)
        if twin not in twins:
            found, note = runner.fault_free_result(
                loaded, seed=this_seed, run_dir=run_root / f"{loaded.spec.name}-{twin[:8]}",
                observer=observer, use_cache=use_cache, what=what)
            checked_by = "not cross-checked: no oracle for the reference server"
            if found is not None and what == "digests":
                system = trainer_of(loaded.spec.system)
                assert system is not None, "a golden of digests is of the reference trainer"
                expected = oracle.trainer_digests(system, seed=this_seed,
                                                  schedule=oracle.full_membership(system))
                got = {int(k): str(v) for k, v in found.items()}
                if expected.digests is None:
                    checked_by = "not cross-checked: " + expected.note.removeprefix(
                        "not observed: ")
                elif expected.digests != got:
                    note = ("the fault-free run disagrees with the independent oracle "
                            "(harness.oracle): fix the trainer or the oracle first")
                    found, checked_by = None, "refused"
                else:
                    checked_by = "equal to the independent oracle (harness.oracle)"
            twins[twin] = (found, note, checked_by)
        result, note, checked_by = twins[twin]
        if result is None:
            status = "refused" if checked_by == "refused" else "failed"
            results.append(Update(loaded.path, status, note))
            continue
        results.append(_record(loaded, seed=this_seed, what=what, found=result,
                               checked_by=checked_by))
    _prune([s for s in scenarios if what_of(s.spec) is not None])
    return results


def _record(loaded: LoadedScenario, *, seed: int, what: str, found: Mapping[str, Any],
            checked_by: str) -> Update:
    path = path_of(loaded.path)
    try:
        entries = read(path) if path.exists() else []
    except ValueError as exc:
        return Update(loaded.path, "failed", f"{exc}; fix or delete it")
    key = key_of(loaded.spec, seed)
    new = entry_for(key, what, found, [loaded.spec.name], checked_by)
    old = next((e for e in entries if key.matches(e)), None)
    result = ("digests", "outputs_sha256", "requests")
    if old is not None:
        new["scenarios"] = sorted({*old.get("scenarios", []), *new["scenarios"]})
        entries.remove(old)
    status = ("recorded" if old is None else
              "unchanged" if all(old.get(k) == new.get(k) for k in result) else "changed")
    entries.append(new)
    write(path, entries)
    return Update(loaded.path, status, f"{path} [{key.platform}], seed {seed}: {checked_by}")


def _prune(updated: Sequence[LoadedScenario]) -> None:
    """Drop the entries of systems no scenario of a folder uses, where every scenario of the
    folder was just updated (one given alone says nothing about the others)."""
    done = {s.path.resolve() for s in updated}
    by_folder: dict[Path, list[LoadedScenario]] = {}
    for loaded in updated:
        by_folder.setdefault(loaded.path.resolve().parent, []).append(loaded)
    for folder, members in by_folder.items():
        present = {p.resolve() for p in folder.iterdir() if p.suffix in (".yaml", ".yml")}
        if not (folder / FILE).exists() or any(_compares(p) for p in present - done):
            continue
        used = [twin_system(m.spec) for m in members]
        entries = read(folder / FILE)
        kept = [e for e in entries if e.get("system") in used]
        if len(kept) != len(entries):
            write(folder / FILE, kept)


def _compares(path: Path) -> bool:
    """Whether the scenario at ``path`` has a golden (an unreadable one may have)."""
    try:
        return what_of(load_scenario(path).spec) is not None
    except SpecError:
        return True
