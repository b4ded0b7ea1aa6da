"""Golden results of fault-free twins (harness/twin/golden.py, `aftershock golden`).

A fault-free twin is computed by the current code, so a bug on the fault-free path (data
order, init, optimizer) is in the twin too and `params_match: fault_free` cannot see it. A
golden result, recorded on purpose and stored beside the scenarios, can.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT, cli

from aftershock.harness import oracle
from aftershock.harness.run import runner
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import load_scenario, parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario, TrainerSystem
from aftershock.harness.twin import golden

FAULTS = ROOT / "scenarios" / "faults"
DATA_ORDER = ROOT / "tests" / "fixtures" / "broken" / "data_order"


def fault_free_copy(source: Path, folder: Path, env: dict[str, str]) -> LoadedScenario:
    """A shipped scenario without its faults, in ``folder`` with its folder's goldens: the
    same system (``env`` added), so the same fault-free twin and the same golden."""
    text = source.read_text()
    text = re.sub(r"\nfaults:\n(?:[ -].*\n)+", "\n", text)
    text = text.split("\nexpect:\n")[0]
    text += "\nexpect:\n  completes: true\n  params_match: fault_free\n"
    if env:
        shown = ", ".join(f"{k}: '{v}'" for k, v in env.items())
        text = text.replace("\nsystem:\n", f"\nsystem:\n  env: {{{shown}}}\n", 1)
    folder.mkdir(parents=True, exist_ok=True)
    if (source.parent / "golden.json").exists():
        shutil.copy(source.parent / "golden.json", folder / "golden.json")
    path = folder / source.name
    path.write_text(text)
    return LoadedScenario(parse_scenario(text, str(path)), path, text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bug_on_the_fault_free_path_fails_against_the_golden(tmp_path: Path) -> None:
    loaded = fault_free_copy(FAULTS / "process_term_restart.yaml", tmp_path / "scenarios",
                             {"PYTHONPATH": f"{DATA_ORDER}{os.pathsep}{ROOT}"})
    assert not loaded.spec.faults
    result = run_scenario(loaded, run_dir=tmp_path / "run", use_cache=False)
    assert "[broken variant]" in (tmp_path / "run" / "logs" / "launcher.stderr.log").read_text()
    checks = {c.name: c for c in result.checks}
    assert checks["completes"].passed
    # The twin has the same bug: the run equals it, whatever the bug.
    assert checks["params_match"].passed
    golden = checks["fault_free_golden"]
    assert not golden.passed, golden.message
    assert "differ" in golden.message
    assert not result.passed


# --------------------------------------------------------------------- fast: the logic


TRAINER = """\
name: {name}
seed: {seed}
system:
  reference: trainer
  world: {{replicas: 2, shards: {shards}}}
  backend: {backend}
  steps: 20
  step_sleep: {sleep}
  env: {{X: '{env}'}}
expect: {{params_match: fault_free}}
"""
SERVER = "name: s\nsystem: {reference: server}\nexpect: {outputs_match: fault_free}\n"


def scenario(folder: Path, *, name: str = "t", seed: int = 0, shards: int = 1,
             backend: str = "gloo", sleep: str = "0s", env: str = "a",
             text: str | None = None) -> LoadedScenario:
    text = text or TRAINER.format(name=name, seed=seed, shards=shards, backend=backend,
                                  sleep=sleep, env=env)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return LoadedScenario(parse_scenario(text, str(path)), path, text)


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed calibration per device, without asking torch."""
    monkeypatch.setattr(golden, "_calibrate", lambda executable, device, threads, settings:
                        golden.Calibration(device.ljust(64, "0"), f"test-{device}"))
    monkeypatch.delenv(golden.FORCE_ENV, raising=False)


def record(loaded: LoadedScenario, digests: dict[int, str], seed: int = 0) -> None:
    key = golden.key_of(loaded.spec, seed)
    golden.write(golden.path_of(loaded.path),
                 [golden.entry_for(key, "digests", digests, ["t"], "by hand")])


def test_the_golden_key_leaves_out_pacing_and_env_but_not_the_math(tmp_path: Path) -> None:
    base = golden.twin_system(scenario(tmp_path, sleep="0s", env="a").spec)
    assert golden.twin_system(scenario(tmp_path, sleep="20ms", env="b").spec) == base
    assert golden.twin_system(scenario(tmp_path, shards=2).spec) != base
    assert "env" not in base


def test_a_folder_without_goldens_has_no_golden_check(tmp_path: Path, platform: None) -> None:
    loaded = scenario(tmp_path)
    assert golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"}) is None


def test_the_twin_must_equal_its_golden(
    tmp_path: Path, platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = scenario(tmp_path)
    record(loaded, {0: "a" * 64, 1: "a" * 64})
    same = golden.check(loaded, seed=0, what="digests", found={0: "a" * 64, 1: "a" * 64})
    assert same is not None
    assert same.passed
    # A mismatch is a verdict when the independent oracle disagrees too.
    monkeypatch.setattr(oracle, "trainer_digests", lambda system, **kw: oracle.Expected(
        {0: "a" * 64, 1: "a" * 64}, "recomputed"))
    other = golden.check(loaded, seed=0, what="digests", found={0: "a" * 64, 1: "b" * 64})
    assert other is not None
    assert not other.passed
    assert other.observed == "1/2 ranks equal the oracle"
    assert "differs from the golden of this host's key" in other.message
    assert "the independent oracle (aftershock.harness.oracle) disagrees too" in other.message
    assert f"aftershock golden --update {loaded.path}" in other.message
    missing = golden.check(loaded, seed=0, what="digests", found=None)
    assert missing is not None
    assert not missing.passed


def test_a_gpu_run_is_never_compared_with_a_cpu_golden(tmp_path: Path, platform: None) -> None:
    cpu = scenario(tmp_path / "cpu", backend="gloo")
    record(cpu, {0: "a", 1: "a"})
    gpu = scenario(tmp_path / "gpu", backend="nccl")
    (tmp_path / "gpu" / "golden.json").write_text((tmp_path / "cpu" / "golden.json").read_text())
    # Same system but the backend, so also the same entry were it not for the platform.
    assert golden.platform_of(gpu.spec) == "test-cuda"
    result = golden.check(gpu, seed=0, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert result.message.startswith("not observed")


def test_without_a_golden_for_the_platform_the_oracle_judges_or_it_is_not_observed(
    tmp_path: Path, platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = scenario(tmp_path / "s", name="s", text=SERVER)
    golden.write(golden.path_of(server.path), [])
    result = golden.check(server, seed=0, what="outputs", found={"r1": [1, 2]})
    assert result is not None
    assert not result.passed
    assert "disagrees with the serving oracle" in result.message
    assert "not the load's" in result.message
    # Another seed of a recorded trainer: nothing to compare, and no oracle for nccl.
    trainer = scenario(tmp_path / "t", backend="nccl")
    record(trainer, {0: "a", 1: "a"}, seed=0)
    result = golden.check(trainer, seed=3, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert "no golden for seed 3" in result.message
    assert "backend nccl" in result.message


def test_without_a_golden_a_trainer_twin_is_checked_by_the_oracle(
    tmp_path: Path, platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = scenario(tmp_path)
    golden.write(golden.path_of(loaded.path), [])
    seen: list[int] = []

    def oracle_digests(system: object, *, seed: int, schedule: object,
                       env: object = None) -> oracle.Expected:
        seen.append(seed)
        return oracle.Expected({0: "a", 1: "a"}, "recomputed")

    monkeypatch.setattr(oracle, "trainer_digests", oracle_digests)
    good = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    bad = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "b"})
    assert good is not None
    assert bad is not None
    assert (good.passed, bad.passed) == (True, False)
    assert "independent oracle" in good.message
    assert "no golden" in good.message
    assert seen == [0, 0]


def test_update_records_once_per_twin_and_says_what_changed(
    tmp_path: Path, platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    digests = {"0": "a", "1": "a"}

    def twin(loaded: LoadedScenario, **kwargs: object) -> tuple[dict[str, str], str]:
        runs.append(loaded.spec.name)
        return dict(digests), "ran"

    monkeypatch.setattr(runner, "fault_free_result", twin)
    monkeypatch.setattr(oracle, "trainer_digests", lambda system, **kw: oracle.Expected(
        {int(k): v for k, v in digests.items()}, "recomputed"))
    folder = tmp_path / "scenarios"
    paced = scenario(folder, name="a", sleep="10ms")
    other = scenario(folder, name="b", sleep="50ms")  # the same twin
    results = golden.update([paced, other], seed=None, use_cache=False, run_root=tmp_path)
    assert [r.status for r in results] == ["recorded", "unchanged"]
    assert runs == ["a"]
    (entry,) = golden.read(folder / "golden.json")
    assert entry["scenarios"] == ["a", "b"]
    assert entry["checked_by"] == "equal to the independent oracle (aftershock.harness.oracle)"
    digests["1"] = "c"
    assert [r.status for r in golden.update([paced], seed=None, use_cache=False,
                                            run_root=tmp_path)] == ["changed"]
    # The oracle disagrees: nothing is recorded.
    monkeypatch.setattr(oracle, "trainer_digests", lambda system, **kw: oracle.Expected(
        {0: "x", 1: "x"}, "recomputed"))
    digests["1"] = "d"
    (refused,) = golden.update([paced], seed=None, use_cache=False, run_root=tmp_path)
    assert refused.status == "refused"
    assert not refused.ok
    (entry,) = golden.read(folder / "golden.json")
    assert entry["digests"] == {"0": "a", "1": "c"}


def test_updating_a_whole_folder_drops_goldens_no_scenario_uses(
    tmp_path: Path, platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "fault_free_result",
                        lambda loaded, **kw: ({"0": "a", "1": "a"}, "ran"))
    monkeypatch.setattr(oracle, "trainer_digests",
                        lambda system, **kw: oracle.Expected(None, "not observed: no"))
    folder = tmp_path / "scenarios"
    old = scenario(folder, name="a", shards=2)
    golden.update([old], seed=None, use_cache=False, run_root=tmp_path)
    new = scenario(folder, name="a", shards=1)  # the same file, edited
    kept = scenario(folder, name="b", shards=1)
    golden.update([new], seed=None, use_cache=False, run_root=tmp_path)
    assert len(golden.read(folder / "golden.json")) == 2  # "b" was not updated: keep all
    golden.update([new, kept], seed=None, use_cache=False, run_root=tmp_path)
    (entry,) = golden.read(folder / "golden.json")
    assert entry["system"]["world"] == {"replicas": 2, "shards": 1}
    assert entry["checked_by"] == "not cross-checked: no"


def test_goldens_are_only_for_the_reference_systems(tmp_path: Path, platform: None) -> None:
    text = ("name: c\nsystem:\n  command: [python, x.py]\n  probes: [{pattern: 'p=(?P<digest>.+)',"
            " event: params}]\nexpect: {params_match: fault_free}\n")
    loaded = scenario(tmp_path, name="c", text=text)
    (result,) = golden.update([loaded], seed=None, use_cache=False, run_root=tmp_path)
    assert result.status == "skipped"
    assert result.ok


def test_the_shipped_goldens_cover_every_shipped_twin() -> None:
    """Every shipped scenario compared with a fault-free twin has a golden for its twin (on
    some platform), and every golden file is readable."""
    for scenario_file in sorted((ROOT / "scenarios").rglob("*.yaml")):
        loaded = load_scenario(scenario_file)
        if golden.what_of(loaded.spec) is None:
            continue
        entries = golden.read(golden.path_of(scenario_file))
        system = golden.twin_system(loaded.spec)
        assert [e for e in entries if e["system"] == system and e["seed"] == 0], scenario_file


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_oracle_reproduces_the_golden_fault_free_runs() -> None:
    """The independent oracle equals the reference trainer on every shipped fault-free twin
    recorded on this platform (restart and hot_spare, 2x2 and 2x1 worlds)."""
    here = None
    computed: dict[str, dict[int, str] | None] = {}  # the recovery strategy never changes it
    for path in sorted((ROOT / "scenarios").glob("*/golden.json")):
        for entry in golden.read(path):
            if entry["system"].get("reference") != "trainer":
                continue
            spec = parse_scenario(f"name: g\nsystem: {json.dumps(entry['system'])}\n")
            assert isinstance(spec.system, TrainerSystem)
            here = here or golden.calibration_of(spec).key
            if entry["key"] != here:
                continue
            math = json.dumps([spec.system.world.model_dump(), spec.system.steps, entry["seed"]])
            if math not in computed:
                computed[math] = oracle.trainer_digests(
                    spec.system, seed=entry["seed"],
                    schedule=oracle.full_membership(spec.system)).digests
            recorded = {int(k): v for k, v in entry["digests"].items()}
            assert computed[math] == recorded, (path, entry["system"])
    if not computed:
        pytest.skip(f"no golden recorded on this platform ({here})")


def test_cli_golden_lists_each_scenarios_golden(tmp_path: Path) -> None:
    proc = cli("golden", str(ROOT / "scenarios" / "training"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("-") and "kill_rank_elastic" in line for line in lines)
    assert all(line.split()[0] in ("-", "golden", "missing") for line in lines), lines
    assert cli("golden", str(tmp_path / "nothing.yaml")).returncode == 2


def test_an_outputs_golden_sees_every_token_and_every_logits_digest() -> None:
    """The golden of a server's twin hashes what outputs_match compares: each request's tokens
    and each token's logits digest, whatever form the outputs come in (the run's Output
    records, or the twin cache's JSON)."""
    from aftershock.harness.twin.golden import outputs_digest
    from aftershock.harness.verdict.metrics import Output

    outputs = {"r1": Output((5, 6), ("aa", "bb")), "r0": Output((7,), ("cc",))}
    as_json = {k: v.to_json() for k, v in outputs.items()}
    assert outputs_digest(outputs) == outputs_digest(as_json)
    changed_token = {**outputs, "r1": Output((5, 9), ("aa", "bb"))}
    changed_logits = {**outputs, "r1": Output((5, 6), ("aa", "zz"))}
    missing_request = {"r1": outputs["r1"]}
    digests = {outputs_digest(o) for o in
               (outputs, changed_token, changed_logits, missing_request)}
    assert len(digests) == 4


def test_the_cpu_calibration_is_asked_once_per_installation_and_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibrating costs an `import torch` in every run; the CPU answer is kept on disk under
    what it depends on, so another setting (ATEN_CPU_CAPABILITY here) asks again, in a child
    that gets the setting."""
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    asked: list[str] = []
    real = subprocess.run

    def counting(argv: list[str], **kwargs: Any) -> Any:
        asked.append(kwargs["env"].get("ATEN_CPU_CAPABILITY", ""))
        line = json.dumps({"key": f"{len(asked):064x}", "platform": f"torch X; isa{len(asked)}"})
        return real([sys.executable, "-c", f"print({line!r})"], **kwargs)

    monkeypatch.setattr(golden.subprocess, "run", counting)
    ask = golden._calibrate.__wrapped__  # past the in-process cache: a new `aftershock run`
    first = ask(sys.executable, "cpu", 1, ())
    assert ask(sys.executable, "cpu", 1, ()) == first
    assert first.platform == "torch X; isa1"
    assert len(asked) == 1
    avx2 = (("ATEN_CPU_CAPABILITY", "avx2"),)
    assert ask(sys.executable, "cpu", 1, avx2).platform == "torch X; isa2"
    assert ask(sys.executable, "cpu", 1, avx2).platform == "torch X; isa2"
    assert ask(sys.executable, "cuda", 1, avx2).platform == "torch X; isa3"
    assert ask(sys.executable, "cuda", 1, avx2).platform == "torch X; isa4"  # a GPU: each time
    assert asked == ["", "avx2", "avx2", "avx2"]


# MKL's first verbose line, as oneMKL 2024 prints it: its CPU dispatch is the BLAS code path
# every matmul of the reference systems takes, and it picks by vendor, not only by ISA.
MKL_AMD = ("MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 "
           "architecture Intel(R) Architecture processors, Lnx 2.60GHz lp64 gnu_thread")
MKL_AVX512 = ("MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 "
              "architecture Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512) with "
              "support of Intel(R) Deep Learning Boost (Intel(R) DL Boost), EVEX-encoded AES "
              "and Carry-Less Multiplication Quadword instructions, Lnx 2.40GHz lp64 gnu_thread")
MKL_AVX2 = ("MKL_VERBOSE oneMKL 2024.0 Product build 20231011 for Intel(R) 64 architecture "
            "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx "
            "3.00GHz lp64 gnu_thread")


@pytest.mark.parametrize(("header", "path"), [
    (MKL_AMD, "generic"), (MKL_AVX512, "avx512"), (MKL_AVX2, "avx2"),
])
def test_mkl_names_the_blas_code_path(header: str, path: str) -> None:
    assert golden.mkl_path(header) == path


def test_the_platform_names_the_blas_code_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two AVX-512 machines gave other bits for the same twin: MKL runs its generic code on
    an AMD CPU and its AVX-512 kernels on an Intel one. The platform line says which."""
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    real = subprocess.run

    def probe(argv: list[str], **kwargs: Any) -> Any:
        assert kwargs["env"]["MKL_VERBOSE"] == "1"
        line = json.dumps({"key": "a" * 64, "platform": "torch X; x86_64 AVX512; cpu"})
        # MKL writes through C stdio, so its line may come before or after Python's.
        return real([sys.executable, "-c", f"print({MKL_AMD!r}); print({line!r})"], **kwargs)

    monkeypatch.setattr(golden.subprocess, "run", probe)
    found = golden._calibrate.__wrapped__(sys.executable, "cpu", 1, ())
    assert found.platform == "torch X; x86_64 AVX512; MKL generic; cpu"


@pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="needs torch")
def test_this_machine_s_platform_line_names_mkl_when_torch_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    line = golden._calibrate.__wrapped__(sys.executable, "cpu", 1, ()).platform
    assert ("; MKL " in line) == torch.backends.mkl.is_available(), line
