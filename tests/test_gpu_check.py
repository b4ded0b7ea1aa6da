"""ci/gpu-check (aftershock.harness.gpu_check): what can be checked without a GPU.

Its trainer row runs on CUDA with NCCL only where a GPU is lent (docs/gpu.md); here the
same scenario runs with Gloo on the CPU, so a scenario that could not pass anywhere (a
fault at a step the run never reaches, a check it cannot satisfy) is caught before a GPU's
time is spent on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aftershock.harness import gpu_check
from aftershock.harness.run.runner import run_scenario
from aftershock.harness.scenario.load import parse_scenario
from aftershock.harness.scenario.spec import LoadedScenario


@pytest.mark.slow
def test_the_gpu_scenario_passes_with_gloo_on_the_cpu(tmp_path: Path) -> None:
    text = gpu_check.SCENARIO.replace("backend: nccl", "backend: gloo")
    assert text != gpu_check.SCENARIO
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    result = run_scenario(LoadedScenario(parse_scenario(text, str(path)), path, text),
                          run_dir=tmp_path / "run")
    checks = {c.name: c for c in result.checks}
    assert result.passed, [(c.name, c.message) for c in result.failed_checks()]
    assert checks["params_match"].passed
    assert result.metrics["time_to_detect_s"] is not None


def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ci/gpu-check runs for real")
    assert gpu_check.main() == 0
    assert "no CUDA device" in capsys.readouterr().out
