"""ci/system-packages: what `make demo` and `make test` run first on a fresh machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "system-packages"


def _bare_path(tmp_path: Path) -> str:
    """A PATH with bash and the coreutils the script uses, none of the packages' commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("bash", "id"):
        found = shutil.which(name)
        assert found is not None
        (bin_dir / name).symlink_to(found)
    return str(bin_dir)


def test_nothing_to_do_is_silent_and_fast() -> None:
    """Where every command is there (this machine), no apt-get runs: silent, well under 1 s."""
    commands = ("ss", "nft", "mount", "fusermount3", "ps", "chromium")
    missing = [c for c in commands if not shutil.which(c)]
    if missing:
        pytest.skip(f"this machine lacks {missing}")
    started = time.monotonic()
    done = subprocess.run(
        [str(SCRIPT), str(ROOT / ".venv" / "bin" / "python")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    assert done.stdout == ""
    assert done.stderr == ""
    assert time.monotonic() - started < 1.0


def test_without_apt_get_it_prints_the_install_line_and_goes_on(tmp_path: Path) -> None:
    """No apt-get on PATH (or not root): one line that installs what is missing, exit 0."""
    done = subprocess.run(
        [str(SCRIPT), "python3-none"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": _bare_path(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    install = [line for line in done.stderr.splitlines() if "install them with:" in line]
    assert len(install) == 1
    assert install[0].endswith(
        "sudo apt-get install -y --no-install-recommends "
        "iproute2 nftables mount fuse3 procps chromium python3-venv"
    )
    strict = subprocess.run(
        [str(SCRIPT), "--strict", "python3-none"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": _bare_path(tmp_path / "strict")},
    )
    assert strict.returncode == 1
