"""The Docker SDK is the `nodes` extra: only harness/nodes/ and the node faults import it, when
used. Listing every fault kind (node.* included) and loading the CLI must not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_and_the_fault_catalogue_never_import_docker() -> None:
    code = ("import sys, harness, harness.cli, harness.runner, faults\n"
            "kinds = [k.info.kind for k in faults.kinds()]\n"
            "assert 'node.partition' in kinds, kinds\n"
            "assert 'docker' not in sys.modules, 'docker was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
