"""The Docker SDK is the `nodes` extra: only harness/nodes/ and the node faults import it, when
used. Listing every fault kind (node.* included) and loading the CLI must not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_and_the_fault_catalogue_never_import_docker() -> None:
    code = ("import sys, harness, aftershock.harness.cli, aftershock.harness.run.runner, faults\n"
            "kinds = [k.info.kind for k in aftershock.faults.kinds()]\n"
            "assert 'node.partition' in kinds, kinds\n"
            "assert 'docker' not in sys.modules, 'docker was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_asking_an_absent_engine_leaves_no_socket_open(tmp_path: Path) -> None:
    """Every node test (and `validate` of a node scenario) asks the engine first; where none
    answers, the question must not leak the client's socket (a ResourceWarning that pytest
    reports as an error in whichever test's teardown the collector runs)."""
    code = ("import gc\nfrom aftershock.faults import _docker\n"
            "problem = _docker.engine_problem()\n"
            "assert problem and 'no Docker engine answers' in problem, problem\n"
            "gc.collect()\nprint('asked')\n")
    env = {"DOCKER_HOST": f"unix://{tmp_path}/absent.sock", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning",
                             "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stderr
    assert "asked" in result.stdout
    assert "unclosed" not in result.stderr, result.stderr
