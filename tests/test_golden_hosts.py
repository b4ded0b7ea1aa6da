"""Goldens on other hosts: the rounding key, the serving oracle, and no false FAIL.

A golden is stored under a calibration digest (how the host rounds the reference systems'
kernels), so a host or a setting that rounds differently (MKL_CBWR, an ISA cap, a forced
key) finds no golden of its key, and an independent oracle judges the twin: a correct twin
passes there, a deliberately broken fault-free path still fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from _helpers import ROOT

from aftershock.harness import oracle
from aftershock.harness.oracle import serving
from aftershock.harness.run import runner
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario
from aftershock.harness.twin import golden

HAS_TORCH = importlib.util.find_spec("torch") is not None
DATA_ORDER = ROOT / "tests" / "fixtures" / "broken" / "data_order"
SERVING_MASK = ROOT / "tests" / "fixtures" / "broken" / "serving_mask"

TRAINER = """\
name: t
system:
  reference: trainer
  world: {{replicas: 2, shards: 1}}
  steps: {steps}
  env: {env}
expect: {{completes: true, params_match: fault_free}}
"""
SERVER = """\
name: s
system:
  reference: server
  workers: 1
  load: {{requests: {requests}, rate: 50, max_tokens: 8, prompt_tokens: {{min: 8, max: 40}}}}
  env: {env}
expect: {{completes: true, outputs_match: fault_free}}
"""


def scenario(folder: Path, text: str, goldens: list[dict[str, Any]] | None = None,
             ) -> LoadedScenario:
    """``text`` as a scenario in ``folder``, whose golden.json holds ``goldens``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "t.yaml"
    path.write_text(text)
    golden.write(folder / golden.FILE, goldens or [])
    return LoadedScenario(parse_scenario(text, str(path)), path, text)


def trainer(folder: Path, *, env: Mapping[str, str] | None = None, steps: int = 20,
            goldens: list[dict[str, Any]] | None = None) -> LoadedScenario:
    return scenario(folder, TRAINER.format(steps=steps, env=json.dumps(dict(env or {}))),
                    goldens)


def server(folder: Path, *, env: Mapping[str, str] | None = None, requests: int = 6
           ) -> LoadedScenario:
    return scenario(folder, SERVER.format(requests=requests, env=json.dumps(dict(env or {}))))


@pytest.fixture
def calibrated(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """A calibration without torch: the key is a digest of the settings it was run with."""
    seen: list[dict[str, str]] = []

    def fake(executable: str, device: str, threads: int,
             settings: tuple[tuple[str, str], ...]) -> golden.Calibration:
        seen.append(dict(settings))
        digest = golden._settings_key(device, threads, dict(settings)) * 4
        return golden.Calibration(digest, f"test {device}")

    monkeypatch.setattr(golden, "_calibrate", fake)
    for name in [n for n in os.environ if n.startswith(("MKL_", "OMP_", "ATEN_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv(golden.FORCE_ENV, raising=False)
    return seen


def fake_oracle(monkeypatch: pytest.MonkeyPatch, digests: dict[int, str] | None) -> list[Any]:
    calls: list[Any] = []

    def trainer_digests(system: object, *, seed: int, schedule: object,
                        env: Mapping[str, str] | None = None) -> oracle.Expected:
        calls.append(dict(env or {}))
        return oracle.Expected(digests, "recomputed" if digests else "not observed: cannot")

    monkeypatch.setattr(oracle, "trainer_digests", trainer_digests)
    return calls


# ------------------------------------------------------------------ fast: the key, the verdict


def test_the_key_follows_the_settings_the_system_runs_with(
    tmp_path: Path, calibrated: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = golden.key_of(trainer(tmp_path / "a").spec, 0)
    cbwr = golden.key_of(trainer(tmp_path / "b", env={"MKL_CBWR": "COMPATIBLE"}).spec, 0)
    assert calibrated[-1] == {"MKL_CBWR": "COMPATIBLE"}
    assert cbwr.rounding != plain.rounding
    assert cbwr.platform == plain.platform  # the same words, other bits
    # The harness's environment reaches the system too; what never rounds does not count.
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert golden.key_of(trainer(tmp_path / "c").spec, 0).rounding == cbwr.rounding
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert golden.key_of(trainer(tmp_path / "d").spec, 0).rounding != cbwr.rounding
    # The twin cache (harness.twin.baseline) keys its twins by the same settings.
    assert golden.platform_key(trainer(tmp_path / "e").spec) != golden.platform_key(
        trainer(tmp_path / "f", env={"MKL_CBWR": "AVX2"}).spec)


def test_a_forced_key_simulates_another_host(
    tmp_path: Path, calibrated: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(golden.FORCE_ENV, "laptop-avx2")
    key = golden.key_of(trainer(tmp_path).spec, 0)
    assert key.rounding == "laptop-avx2"
    assert golden.FORCE_ENV in key.platform
    monkeypatch.setenv(golden.FORCE_ENV, "../../etc")
    result = golden.check(trainer(tmp_path), seed=0, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert result.message.startswith("not observed")


def test_no_golden_for_the_key_and_the_oracle_agrees_passes(
    tmp_path: Path, calibrated: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_oracle(monkeypatch, {0: "a", 1: "a"})
    loaded = trainer(tmp_path, env={"MKL_CBWR": "COMPATIBLE", "PYTHONPATH": "/bug"})
    good = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert good is not None
    assert good.passed, good.message
    assert good.message.startswith("no golden for this platform; the oracle agrees")
    assert f"aftershock golden --update {loaded.path}" in good.message
    # The oracle rounds as the system does; the system's code path stays out of it.
    assert calls == [{"MKL_CBWR": "COMPATIBLE"}]
    bad = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "b"})
    assert bad is not None
    assert not bad.passed
    assert "disagrees with the independent oracle (aftershock.harness.oracle)" in bad.message
    assert bad.observed == "1/2 ranks equal the oracle"


def test_a_golden_of_the_same_key_that_differs_is_judged_by_the_oracle(
    tmp_path: Path, calibrated: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = trainer(tmp_path)
    key = golden.key_of(loaded.spec, 0)
    golden.write(golden.path_of(loaded.path),
                 [golden.entry_for(key, "digests", {0: "g", 1: "g"}, ["t"], "by hand")])
    fake_oracle(monkeypatch, {0: "a", 1: "a"})
    equal = golden.check(loaded, seed=0, what="digests", found={0: "g", 1: "g"})
    assert equal is not None
    assert equal.passed
    assert "equals the golden" in equal.message
    stale = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert stale is not None
    assert stale.passed, stale.message
    assert "the golden is stale" in stale.message
    broken = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "b"})
    assert broken is not None
    assert not broken.passed
    assert "differs from the golden of this host's key" in broken.message
    assert "the independent oracle (aftershock.harness.oracle) disagrees too" in broken.message
    fake_oracle(monkeypatch, None)  # no oracle to confirm: the golden alone is the witness
    alone = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert alone is not None
    assert not alone.passed
    assert "cannot" in alone.message


def test_no_golden_and_no_oracle_says_what_to_do(
    tmp_path: Path, calibrated: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_oracle(monkeypatch, None)
    loaded = trainer(tmp_path)
    result = golden.check(loaded, seed=0, what="digests", found={0: "a", 1: "a"})
    assert result is not None
    assert not result.passed
    assert result.message.startswith("not observed")
    assert f"record one: aftershock golden --update {loaded.path}" in result.message


def test_the_shipped_goldens_are_keyed_by_rounding() -> None:
    for path in sorted((ROOT / "scenarios").glob("*/golden.json")):
        for entry in golden.read(path):
            assert isinstance(entry.get("key"), str), (path, entry.get("platform"))
            assert entry.get("platform"), path
            assert entry["checked_by"].startswith("equal to"), (path, entry["checked_by"])


def test_a_cached_calibration_is_trusted_only_if_this_harness_wrote_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    asked: list[list[str]] = []
    real = subprocess.run

    def battery(argv: list[str], **kwargs: Any) -> Any:
        asked.append(argv)
        line = json.dumps({"key": f"{len(asked):064x}", "platform": "torch X; cpu"})
        return real([sys.executable, "-c", f"print({line!r})"], **kwargs)

    monkeypatch.setattr(golden.subprocess, "run", battery)
    ask = golden._calibrate.__wrapped__  # past the in-process cache: a new `aftershock run`
    first = ask(sys.executable, "cpu", 1, ())
    assert ask(sys.executable, "cpu", 1, ()) == first
    assert len(asked) == 1
    (cached,) = (tmp_path / "cache" / "calibration").glob("*.json")
    good = json.loads(cached.read_text())
    for bad in ({**good, "key": "not hex"}, {**good, "cache_key": "another"},
                {**good, "platform": "two\nlines"}, {**good, "extra": 1}):
        cached.write_text(json.dumps(bad))
        assert ask(sys.executable, "cpu", 1, ()).key != bad["key"]
    count = len(asked)
    cached.chmod(0o666)  # anyone could have written it
    ask(sys.executable, "cpu", 1, ())
    assert len(asked) == count + 1
    assert ask(sys.executable, "cpu", 2, ()) != first  # other threads: asked again
    assert ask(sys.executable, "cpu", 1, (("MKL_CBWR", "AVX2"),)) != first


# ----------------------------------------------------------- the battery and the serving oracle


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_the_battery_sees_a_setting_that_changes_rounding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MKL_CBWR=COMPATIBLE changes the bits of the reference trainer's twin on this host
    (issue 52) but not its platform line: the battery's key sees it."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("torch does not use MKL here")
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    for name in [n for n in os.environ if n.startswith(("MKL_", "ATEN_"))]:
        monkeypatch.delenv(name)
    ask = golden._calibrate.__wrapped__
    plain = ask(sys.executable, "cpu", 1, ())
    cbwr = ask(sys.executable, "cpu", 1, (("MKL_CBWR", "COMPATIBLE"),))
    assert plain.key != cbwr.key
    assert plain.platform == cbwr.platform
    assert "; MKL " in plain.platform


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_the_serving_oracle_restates_the_model_and_judges_the_engine() -> None:
    """The oracle's weights are the server's, bit for bit; greedy decoding by the engine
    (paged KV cache, tiles, a batch of three) equals the oracle's plain forward, and a
    changed token does not."""
    import torch

    from aftershock.harness.oracle import serving_math
    from aftershock.reference_impl.serving.engine import Engine, EngineConfig
    from aftershock.reference_impl.serving.model import GPT, ModelConfig, encode

    config = ModelConfig(seed=3)
    assert (config.vocab, config.n_layer, config.n_head, config.d_model, config.max_seq) == (
        serving_math.VOCAB, serving_math.N_LAYER, serving_math.N_HEAD, serving_math.D_MODEL,
        serving_math.MAX_SEQ)
    ours, theirs = serving_math.state_dict(3), GPT(config).state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    torch.set_num_threads(1)
    engine = Engine(config, EngineConfig())
    prompts = {"a": "The quick brown fox", "b": "jumps over the lazy dog again and", "c": "x"}
    for rid, prompt in prompts.items():
        engine.add(rid, encode(prompt), 12)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while any(len(t) < 12 for t in tokens.values()):
        for out in engine.step():
            tokens[out.request_id].append(out.token)

    def judged(answer: dict[str, list[int]]) -> dict[str, Any]:
        return serving_math.judge({"model_seed": 3, "requests": [
            {"id": rid, "prompt": encode(p), "max_tokens": 12, "tokens": answer[rid]}
            for rid, p in prompts.items()]})

    assert judged(tokens)["disagree"] == []
    wrong = {**tokens, "b": [*tokens["b"][:4], (tokens["b"][4] + 1) % 256, *tokens["b"][5:]]}
    (first,) = judged(wrong)["disagree"]
    assert (first["id"], first["index"]) == ("b", 4)


# ------------------------------------------------- slow: real twins on simulated other hosts


def run_twin(loaded: LoadedScenario, tmp_path: Path, what: str) -> Mapping[str, Any]:
    found, note = runner.fault_free_result(loaded, seed=0, run_dir=tmp_path / "twin",
                                           observer=runner.NullObserver(), use_cache=False,
                                           what=what)
    assert found is not None, note
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_a_host_without_goldens_a_correct_server_passes_by_the_serving_oracle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(golden.FORCE_ENV, "a-host-with-no-golden")
    loaded = server(tmp_path / "s")
    result = golden.check(loaded, seed=0, what="outputs",
                          found=run_twin(loaded, tmp_path, "outputs"))
    assert result is not None
    assert result.passed, result.message
    assert result.message.startswith("no golden for this platform; the oracle agrees")
    assert serving.NAME in result.message
    assert result.observed == "6/6 requests equal the oracle"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_broken_serving_fault_free_path_fails_on_a_host_without_goldens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(golden.FORCE_ENV, "a-host-with-no-golden")
    path = os.pathsep.join([str(SERVING_MASK), str(ROOT)])
    loaded = server(tmp_path / "s", env={"PYTHONPATH": path})
    result = golden.check(loaded, seed=0, what="outputs",
                          found=run_twin(loaded, tmp_path, "outputs"))
    logs = "".join(p.read_text() for p in (tmp_path / "twin").rglob("*.log"))
    assert "[broken variant]" in logs
    assert result is not None
    assert not result.passed
    assert f"disagrees with {serving.NAME}" in result.message


#: Settings that change how this host rounds, or that simulate a host with no golden.
HOSTS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    # name: (the system's env, the harness's env)
    "mkl-cbwr-compatible": ({"MKL_CBWR": "COMPATIBLE"}, {}),
    "mkl-cbwr-avx2": ({"MKL_CBWR": "AVX2"}, {}),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, {}),
    "threads": ({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}, {}),
    "forced-key": ({}, {golden.FORCE_ENV: "a-host-with-no-golden"}),
}


def broken_trainer_on(host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[Any, Any]:
    """The data-order bug's twin, and its golden check on ``host``'s settings (no golden of
    that key: the oracle judges)."""
    system_env, harness_env = HOSTS[host]
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    for name, value in harness_env.items():
        monkeypatch.setenv(name, value)
    path = os.pathsep.join([str(DATA_ORDER), str(ROOT)])
    loaded = trainer(tmp_path / "t", env={**system_env, "PYTHONPATH": path}, steps=12)
    found = run_twin(loaded, tmp_path, "digests")
    return golden.check(loaded, seed=0, what="digests", found=found), loaded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_broken_fault_free_path_fails_on_a_forced_host_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _ = broken_trainer_on("forced-key", tmp_path, monkeypatch)
    assert result is not None
    assert not result.passed
    assert "disagrees with the independent oracle (aftershock.harness.oracle)" in result.message


@pytest.mark.scenarios
@pytest.mark.timeout(600)
@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_broken_fault_free_path_fails_on_every_simulated_host(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _ = broken_trainer_on(host, tmp_path, monkeypatch)
    assert result is not None
    assert not result.passed, result.message
    assert "disagrees with the independent oracle (aftershock.harness.oracle)" in result.message


@pytest.mark.scenarios
@pytest.mark.timeout(600)
@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_correct_fault_free_path_passes_on_every_simulated_host(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system_env, harness_env = HOSTS[host]
    monkeypatch.setenv("AFTERSHOCK_CACHE_DIR", str(tmp_path / "cache"))
    for name, value in harness_env.items():
        monkeypatch.setenv(name, value)
    loaded = trainer(tmp_path / "t", env=system_env, steps=12)
    result = golden.check(loaded, seed=0, what="digests",
                          found=run_twin(loaded, tmp_path, "digests"))
    assert result is not None
    assert result.passed, result.message
    served = server(tmp_path / "s", env=system_env)
    result = golden.check(served, seed=0, what="outputs",
                          found=run_twin(served, tmp_path / "s", "outputs"))
    assert result is not None
    assert result.passed, result.message
