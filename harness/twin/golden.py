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
- ``key``: how the host rounds, the digest of a calibration battery
(aftershock.harness.twin._calibrate:
the
  kernels the reference systems use, in their shapes, on fixed inputs) run once per
  interpreter, device and rounding settings (MKL_*, OMP_*, ATEN_CPU_CAPABILITY, the thread
  count, ...: the system's environment as its processes get it) and cached. Any host or
  setting that rounds differently gets its own key, whatever its CPU name says; a GPU run is
  never compared with a CPU golden. ``platform`` (torch, CPU, ISA, MKL's code path, device)
  is kept beside it for humans.

A mismatch is a verdict only when an independent witness agrees. When the twin differs from a
golden of its key, or there is no golden for the key (a new host, another seed, a changed
system), the twin is judged by an independent oracle: the trainer's (aftershock.harness.oracle,
bitwise,
on the layouts it restates) or the server's (aftershock.harness.oracle.serving: greedy decoding
without
the serving stack). Only a twin that disagrees with its oracle fails; with no golden and an
oracle that agrees the check passes ("no golden for this platform; the oracle agrees"). With
no oracle the check fails as "not observed" and says how to record a golden. A scenario
folder without a golden.json has no golden check. Goldens are for the reference systems: a
command's platform is not known to the harness.
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
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aftershock._root import child_pythonpath
from aftershock.harness import systems
from aftershock.harness.errors import HarnessError, SpecError
from aftershock.harness.run import _files
from aftershock.harness.run.records import CheckResult
from aftershock.harness.scenario.load import load_scenario
from aftershock.harness.scenario.spec import LoadedScenario, Scenario, TrainerSystem
from aftershock.harness.twin._paths import cache_dir, untrusted

FILE = "golden.json"
CHECK = "fault_free_golden"
ABOUT = ("Golden results of the fault-free twins of the scenarios in this folder, recorded on "
         "purpose with `aftershock golden --update`; see docs/scenarios.md (Golden results).")
#: The largest golden file read (the shipped ones are a few KiB: one entry per twin and host).
MAX_BYTES = 4 << 20

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

#: Bumped when the calibration's cached form changes, so cached answers are asked again.
_FORMAT = "3"
#: Environment variables that can change how a kernel rounds: which BLAS code path runs (and
#: which library: LD_*), which ISA ATen dispatches to, how many threads split a reduction.
_ROUNDING_PREFIXES = ("MKL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_", "BLIS_", "ATEN_",
                      "DNNL_", "ONEDNN_", "CUBLAS_", "CUDA_", "NVIDIA_TF32", "TORCH_ALLOW_TF32",
                      "LD_PRELOAD", "LD_LIBRARY_PATH")
#: Set by the calibration itself (to read MKL's code path), not by a user.
_NOT_SETTINGS = ("MKL_VERBOSE",)
#: Forces the key (tests simulate a host whose rounding no golden was recorded for).
FORCE_ENV = "AFTERSHOCK_GOLDEN_KEY"
_FORCED = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MKL_HEADER = re.compile(r"^MKL_VERBOSE .*\bProduct build\b")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: The battery's source: a change there is a new battery, hence new keys.
_BATTERY = Path(__file__).with_name("_calibrate.py")


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


def settings_of(spec: Scenario) -> dict[str, str]:
    """The environment that decides how the system's kernels round, as its processes get it:
    the harness's own, with the scenario's ``system.env`` over it."""
    merged = {**os.environ, **dict(getattr(spec.system, "env", None) or {})}
    return {name: value for name, value in sorted(merged.items())
            if name.startswith(_ROUNDING_PREFIXES) and name not in _NOT_SETTINGS}


def threads_of(spec: Scenario) -> int:
    """Torch's intra-op threads in the system's processes: 1 (what the reference trainer's
    ranks and the server's workers set), or the server's ``--threads`` (0: torch's default)."""
    args = list(getattr(spec.system, "args", None) or ())
    for index, arg in enumerate(args):
        value = (arg.split("=", 1)[1] if arg.startswith("--threads=") else
                 args[index + 1] if arg == "--threads" and index + 1 < len(args) else None)
        if value is not None and value.isdigit():
            return int(value)
    return 1


def _cpu_key(executable: str) -> str | None:
    """Everything a CPU calibration depends on besides its settings, without importing torch:
    the interpreter, the torch installation it imports (its version file, by content and
    time), the CPU's feature flags and vendor. None when torch cannot be located this way:
    then nothing is cached."""
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
                 _BATTERY.read_text()]
    except (OSError, ImportError, ValueError):
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _settings_key(device: str, threads: int, settings: Mapping[str, str]) -> str:
    text = json.dumps([device, threads, sorted(settings.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Calibration:
    """How a host rounds: ``key``, the sha256 of the battery's bits
    (aftershock.harness.twin._calibrate), and
    ``platform``, what a human reads (torch, the CPU, MKL's code path, the device)."""

    key: str
    platform: str


def _cache_file(key: str) -> Path:
    return cache_dir() / "calibration" / f"{key}.json"


def _read_cached(path: Path, key: str) -> Calibration | None:
    """A cached calibration, only if it is one this harness wrote for this key: a regular
    file of this user's, writable by no one else, small, of this format and key, with a
    key of 64 hex digits and a one-line platform. Anything else is asked again."""

    if untrusted(path) is not None:
        return None
    try:
        data = _files.loads(_files.read_capped(path, 4096, what="a calibration"), depth=2)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != {"format", "cache_key", "key", "platform"}:
        return None
    found, line = data["key"], data["platform"]
    if (data["format"] != _FORMAT or data["cache_key"] != key or not isinstance(found, str)
            or not _HEX64.match(found) or not isinstance(line, str) or not line.isprintable()
            or not 0 < len(line) <= 300):
        return None
    return Calibration(found, line)


@functools.cache
def _calibrate(executable: str, device: str, threads: int,
               settings: tuple[tuple[str, str], ...]) -> Calibration:
    """Run the battery in a fresh process of ``executable``, with ``settings`` over the
    harness's environment (as the system's processes get them) and ``threads`` torch threads.

    On CPU the answer is kept on disk under a key of everything it depends on (_cpu_key and
    the settings): it costs a torch import (~3 s of CPU, twice that on a busy 2-core host)
    for an answer that changes only with the installation, the machine or the settings. A
    GPU's is asked every time."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(_ROUNDING_PREFIXES)}
    env.update(dict(settings))
    cpu = _cpu_key(executable) if device == "cpu" else None
    key = (f"{cpu}-{_settings_key(device, threads, dict(settings))}" if cpu else None)
    cached = _cache_file(key) if key else None
    if cached is not None and key is not None:
        found = _read_cached(cached, key)
        if found is not None:
            return found
    result = _run_battery(executable, device, threads, env)
    if cached is not None and key is not None:
        _write_cached(cached, key, result)
    return result


def _run_battery(executable: str, device: str, threads: int, env: dict[str, str]
                 ) -> Calibration:
    """The battery's answer from a fresh process of ``executable`` with ``env``."""
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH", ""), executable)
    env["MKL_VERBOSE"] = "1"  # MKL names the code path it dispatched to (mkl_path)
    proc = subprocess.run([executable, "-m", "aftershock.harness.twin._calibrate", device,
                           str(threads)],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    output = proc.stdout.strip().splitlines()
    lines = [line for line in output if not line.startswith("MKL_VERBOSE")]
    try:
        answer = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        result = Calibration(str(answer["key"]), str(answer["platform"])) if answer else None
    except (ValueError, KeyError, TypeError):
        result = None
    if result is None or not _HEX64.match(result.key):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot calibrate the platform ({tail})")
    header = next((line for line in output if _MKL_HEADER.match(line)), None)
    if header is not None:  # before the device: "torch V; x86_64 ISA; MKL path; device"
        head, _, device_part = result.platform.rpartition("; ")
        result = Calibration(result.key, f"{head}; MKL {mkl_path(header)}; {device_part}")
    return result


def _write_cached(cached: Path, key: str, result: Calibration) -> None:
    """Keep a CPU's calibration under ``key``, whole or not at all (a failure is no loss)."""
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": _FORMAT, "cache_key": key, "key": result.key,
                                   "platform": result.platform}) + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, cached)


def calibration_of(spec: Scenario) -> Calibration:
    """How the scenario's system rounds on this host: the battery, in the settings its
    processes get, with the interpreter the harness launches them with (its own).
    ``AFTERSHOCK_GOLDEN_KEY`` forces the key (the platform line says so)."""
    found = _calibrate(sys.executable, device_of(spec), threads_of(spec),
                       tuple(settings_of(spec).items()))
    forced = os.environ.get(FORCE_ENV)
    if forced:
        if not _FORCED.match(forced):
            raise RuntimeError(f"{FORCE_ENV}={forced!r}: letters, digits, '.', '_', '-' only")
        return Calibration(forced, f"{found.platform} (key forced by {FORCE_ENV})")
    return Calibration(found.key[:16], found.platform)


def platform_key(spec: Scenario) -> str:
    """What a run's bits depend on besides the scenario, without importing torch (the twin
    cache's key): the device, :func:`_cpu_key` ("unknown" when torch cannot be located) and
    the settings that change rounding (:func:`settings_of`, :func:`threads_of`)."""
    device = device_of(spec)
    settings = _settings_key(device, threads_of(spec), settings_of(spec))
    return f"{device}:{_cpu_key(sys.executable) or 'unknown'}:{settings}"


def platform_of(spec: Scenario) -> str:
    """Where a reference system runs, in words (beside the key, for humans)."""
    return calibration_of(spec).platform


# ------------------------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class Key:
    """What a golden is stored under: the twin's system, the seed and the host's rounding
    (``rounding``: the calibration digest); ``platform`` is beside it, for humans."""

    system: dict[str, Any]
    seed: int
    rounding: str
    platform: str
    settings: tuple[tuple[str, str], ...] = ()  # what the system's processes round with

    def matches(self, entry: Mapping[str, Any]) -> bool:
        return (entry.get("system") == self.system and entry.get("seed") == self.seed
                and entry.get("key") == self.rounding)


def key_of(spec: Scenario, seed: int) -> Key:
    found = calibration_of(spec)
    return Key(twin_system(spec), seed, found.key, found.platform,
               tuple(settings_of(spec).items()))


def distrust(path: Path) -> str | None:
    """Why the golden file ``path`` (or, where there is none yet, its folder) cannot be
    believed, or None: the twin cache's rules (_paths.untrusted, the heal journal's for
    the folder). Anyone who could write either could plant a golden that fails a correct
    run or passes a broken one."""
    from aftershock.faults.journal import unsafe_folder

    problem = untrusted(path) if os.path.lexists(path) else unsafe_folder(path.parent)
    if problem is None:
        return None
    me = os.geteuid()
    return (f"{path}:1:1: not trusted: {problem}. A golden is believed only from a regular "
            f"file and folder of this user's (uid {me}) that no one else can write: if you "
            f"trust what is in them, `chown {me} {path.parent} {path}` and `chmod go-w "
            f"{path.parent} {path}`; else record the goldens again")


def read(path: Path) -> list[dict[str, Any]]:
    """The entries of a golden file; ValueError, naming the file and what is wrong, if it
    is not one, is not trusted (:func:`distrust`), or is over :data:`MAX_BYTES`."""
    problem = distrust(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        raw = _files.read_capped(path, MAX_BYTES, what="a golden file")
    except _files.Refused as exc:
        raise ValueError(f"{path}:1:1: {str(exc).removeprefix(f'{path}: ')}") from None
    except OSError as exc:
        raise ValueError(f"{path}:1:1: cannot read ({exc.strerror})") from None
    try:
        data = _files.loads(raw, depth=16)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg})") from None
    except ValueError as exc:
        raise ValueError(f"{path}:1:1: not JSON ({exc})") from None
    entries = data.get("goldens") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}:1:1: no `goldens` list (an object with a list of entries)")
    for index, entry in enumerate(entries):
        wrong = _malformed(entry)
        if wrong is not None:
            raise ValueError(f"{path}:1:1: goldens.{index}{wrong}")
    return entries


def problems(scenarios: Sequence[LoadedScenario], *, writing: bool) -> list[str]:
    """What is wrong with the golden files of these scenarios' folders (malformed, not a
    regular file, too large, not trusted), one line each; with ``writing``, a folder that
    holds none yet must be trusted too (what is recorded there is believed later)."""
    found: list[str] = []
    paths = [path_of(s.path) for s in scenarios if what_of(s.spec) is not None]
    for path in dict.fromkeys(paths):
        if os.path.lexists(path):
            try:
                read(path)
            except ValueError as exc:
                found.append(str(exc))
        elif writing and (problem := distrust(path)) is not None:
            found.append(problem)
    return found


def _malformed(entry: Any) -> str | None:
    """What is wrong with one entry of a golden file (``.field: ...``), or None."""
    if not isinstance(entry, dict):
        return f": {_shown(entry)} is not an object"
    fields: list[tuple[str, Any, str]] = [
        ("system", dict, "an object"), ("seed", int, "an integer"), ("key", str, "a string"),
        ("platform", str, "a string"), ("scenarios", list, "a list"),
        ("digests", dict, "an object"), ("outputs_sha256", str, "a string"),
        ("requests", int, "an integer"), ("checked_by", str, "a string")]
    for name, kind, what in fields:
        value = entry.get(name)
        required = name in ("system", "seed")
        if (value is None and not required) or (isinstance(value, kind)
                                                and not isinstance(value, bool)):
            continue
        return f".{name}: {_shown(value)} is not {what}"
    for rank, digest in dict(entry.get("digests") or {}).items():
        if not rank.isdigit() or not isinstance(digest, str):
            return f".digests.{_shown(rank)}: not a rank number with a digest string"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write(path: Path, entries: list[dict[str, Any]]) -> None:
    ordered = sorted(entries, key=lambda e: (str(e.get("platform")), str(e.get("key")),
                                             int(e.get("seed", 0)),
                                             json.dumps(e.get("system"), sort_keys=True)))
    text = json.dumps({"about": ABOUT, "goldens": ordered}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # what a checked-in file has; mkstemp's 0600 is not shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entry_for(key: Key, what: str, found: Mapping[Any, Any], scenarios: Sequence[str],
              checked_by: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"system": key.system, "seed": key.seed, "key": key.rounding,
                             "platform": key.platform, "scenarios": sorted(set(scenarios))}
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
    request) against the golden of its folder for this host's rounding key, and, where that
    golden is missing or differs, against the independent oracle: a mismatch is a verdict only
    when an independent witness agrees. None when the folder keeps no goldens."""
    path = path_of(loaded.path)
    if what_of(loaded.spec) != what or not os.path.lexists(path):
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
    expected = f"equal to its golden (key {key.rounding}) or, without one, to the oracle"
    record = f"aftershock golden --update {loaded.path}"
    entry = next((e for e in entries if key.matches(e)), None)
    if entry is not None:
        observed, differ = _against_golden(entry, what, found)
        if not differ:
            return CheckResult(CHECK, True, observed, expected,
                               f"the fault-free run equals the golden in {path} "
                               f"(key {key.rounding}, {key.platform})")
        golden_says = (f"the fault-free run differs from the golden of this host's key "
                       f"{key.rounding} in {path} ({differ})")
        witness = oracle_of(loaded, key, what, found)
        if witness is None or witness.agrees is None:
            why = (f"; {witness.note}" if witness is not None else
                   "; no independent oracle restates this system")
            return CheckResult(CHECK, False, observed, expected,
                               f"{golden_says}{why}. The fault-free path changed; if on "
                               f"purpose, record it: {record}")
        if witness.agrees:
            return CheckResult(CHECK, True, witness.observed, expected,
                               f"{golden_says}, but {witness.name} agrees with it "
                               f"({witness.note}): the golden is stale or the key misses a "
                               f"setting; record it again: {record}")
        return CheckResult(CHECK, False, witness.observed, expected,
                           f"{golden_says}, and {witness.name} disagrees too: "
                           f"{witness.note}. The fault-free path changed; if on purpose, "
                           f"record it: {record}")
    return _without_golden(loaded, key, path, entries, what, found)


def _against_golden(entry: Mapping[str, Any], what: str,
                    found: Mapping[Any, Any]) -> tuple[str, str]:
    """What the check observed, and how the twin differs from ``entry`` ("": equal)."""
    if what == "digests":
        want = {int(k): str(v) for k, v in dict(entry.get("digests") or {}).items()}
        got = {int(k): str(v) for k, v in found.items()}
        ranks = sorted(set(want) | set(got))
        differ = [r for r in ranks if want.get(r) != got.get(r)]
        detail = ", ".join(f"rank {r}: {str(got.get(r))[:12]} != {str(want.get(r))[:12]}"
                           for r in differ)
        return f"{len(ranks) - len(differ)}/{len(ranks)} ranks equal", detail
    digest = outputs_digest(found)
    want_digest = str(entry.get("outputs_sha256"))
    detail = ("" if digest == want_digest else
              f"outputs of {len(found)} requests, sha256 {digest[:12]} != {want_digest[:12]}")
    return f"outputs {digest[:12]}", detail


@dataclass(frozen=True, slots=True)
class Witness:
    """An independent oracle's word on a twin: ``agrees`` None when it could not judge."""

    name: str
    agrees: bool | None
    observed: str
    note: str


def oracle_of(loaded: LoadedScenario, key: Key, what: str,
              found: Mapping[Any, Any]) -> Witness | None:
    """The independent oracle's judgement of the twin, run in the settings the system's
    processes round with; None where no oracle restates the system."""
    from aftershock.harness import oracle
    from aftershock.harness.oracle import serving
    from aftershock.harness.systems.server import ServerSystem

    env = dict(key.settings)
    system = trainer_of(loaded.spec.system)
    if what == "digests" and system is not None:
        name = "the independent oracle (aftershock.harness.oracle)"
        expected = oracle.trainer_digests(system, seed=key.seed,
                                          schedule=oracle.full_membership(system), env=env)
        if expected.digests is None:
            return Witness(name, None, "", expected.note.removeprefix("not observed: "))
        got = {int(k): str(v) for k, v in found.items()}
        ranks = sorted(set(expected.digests) | set(got))
        differ = [r for r in ranks if expected.digests.get(r) != got.get(r)]
        observed = f"{len(ranks) - len(differ)}/{len(ranks)} ranks equal the oracle"
        if differ:
            return Witness(name, False, observed,
                           f"ranks {', '.join(map(str, differ))} differ from its digests")
        return Witness(name, True, observed, "every rank equals its digests")
    if what == "outputs" and isinstance(loaded.spec.system, ServerSystem):
        judged = serving.judge_outputs(loaded.spec.system, seed=key.seed, outputs=found,
                                       env=env)
        return Witness(serving.NAME, judged.agrees, judged.observed, judged.note)
    return None


def _without_golden(loaded: LoadedScenario, key: Key, path: Path,
                    entries: list[dict[str, Any]], what: str,
                    found: Mapping[Any, Any]) -> CheckResult:
    """No golden for this system, seed and rounding key: the oracle judges, where one can."""
    same_system = [e for e in entries if e.get("system") == key.system]
    if not same_system:
        missing = "for this system (the scenario's system changed since, or is new)"
    elif not [e for e in same_system if e.get("seed") == key.seed]:
        missing = f"for seed {key.seed}"
    else:
        same_line = [e for e in same_system if e.get("platform") == key.platform]
        missing = (f"for this platform (key {key.rounding}, {key.platform}; recorded: "
                   + "; ".join(sorted({f"key {e.get('key')} [{e.get('platform')}]"
                                       for e in same_system})) + ")")
        if same_line:
            missing += (": the same platform line rounds differently here, so a setting "
                        "(MKL_CBWR, threads, an ISA cap, another BLAS) changes its kernels")
    record = f"aftershock golden --update {loaded.path}"
    hint = f"{path} has no golden {missing}"
    expected = "equal to the independent oracle (no golden for this key)"
    witness = oracle_of(loaded, key, what, found)
    if witness is None:
        return CheckResult(CHECK, False, None, f"a golden for key {key.rounding}",
                           f"not observed: {hint}, and no independent oracle restates this "
                           f"system. Record a golden on a host you trust, with the settings "
                           f"you run: {record}")
    if witness.agrees is None:
        return CheckResult(CHECK, False, None, f"a golden for key {key.rounding}",
                           f"not observed: {hint}, and {witness.name} could not judge "
                           f"({witness.note}); record one: {record}")
    if witness.agrees:
        return CheckResult(CHECK, True, witness.observed, expected,
                           f"no golden for this platform; the oracle agrees: {witness.name}: "
                           f"{witness.note} ({hint}; to record one: {record})")
    return CheckResult(CHECK, False, witness.observed, expected,
                       f"the fault-free run disagrees with {witness.name}: {witness.note} "
                       f"({hint})")


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

    A twin an independent oracle can judge (the trainer's, the server's) must agree with
    it, or nothing is recorded: a golden is only worth what it was checked against. Entries
    of systems that no scenario of a folder uses any more, and entries without a rounding key
    (an older format), are dropped when the whole folder was updated."""
    # Running twins is the one step of this module above the runner (runner -> baseline ->
    # golden at import), so the runner is imported only here.
    from aftershock.harness.run import runner

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
            try:
                found, note = runner.fault_free_result(
                    loaded, seed=this_seed, run_dir=run_root / f"{loaded.spec.name}-{twin[:8]}",
                    observer=observer, use_cache=use_cache, what=what)
            except HarnessError as exc:  # this twin cannot run here (no Docker engine, ...)
                found, note = None, f"the fault-free run could not start: {exc}"
            twins[twin] = _cross_checked(loaded, this_seed, what, found, note)
        result, note, checked_by = twins[twin]
        if result is None:
            status = "refused" if checked_by == "refused" else "failed"
            results.append(Update(loaded.path, status, note))
            continue
        results.append(_record(loaded, seed=this_seed, what=what, found=result,
                               checked_by=checked_by))
    _prune([s for s in scenarios if what_of(s.spec) is not None])
    return results


def _cross_checked(loaded: LoadedScenario, seed: int, what: str,
                   found: Mapping[str, Any] | None, note: str
                   ) -> tuple[Mapping[str, Any] | None, str, str]:
    """A twin's result as an independent oracle judges it: kept with what checked it, or
    refused (None) where the oracle disagrees."""
    checked_by = "not cross-checked: no independent oracle restates this system"
    if found is None:
        return found, note, checked_by
    witness = oracle_of(loaded, key_of(loaded.spec, seed), what, found)
    if witness is None:
        return found, note, checked_by
    if witness.agrees is None:
        return found, note, f"not cross-checked: {witness.note}"
    if not witness.agrees:
        return None, (f"the fault-free run disagrees with {witness.name} "
                      f"({witness.note}): fix the system or the oracle first"), "refused"
    return found, note, f"equal to {witness.name}"


def _record(loaded: LoadedScenario, *, seed: int, what: str, found: Mapping[str, Any],
            checked_by: str) -> Update:
    path = path_of(loaded.path)
    problem = distrust(path)  # its folder too: what is written there must be believed later
    if problem is not None:
        return Update(loaded.path, "refused", problem)
    try:
        entries = read(path) if os.path.lexists(path) else []
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
    return Update(loaded.path, status,
                  f"{path} key {key.rounding} [{key.platform}], seed {seed}: {checked_by}")


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
        try:
            entries = read(folder / FILE)
        except ValueError:  # refused or malformed: its scenarios' updates said so
            continue
        kept = [e for e in entries if e.get("system") in used and e.get("key")]
        if len(kept) != len(entries):
            write(folder / FILE, kept)


def _compares(path: Path) -> bool:
    """Whether the scenario at ``path`` has a golden (an unreadable one may have)."""
    try:
        return what_of(load_scenario(path).spec) is not None
    except SpecError:
        return True
