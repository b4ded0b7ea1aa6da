"""What the lazy filesystem's tests on a real mount share: the mount, or a skip saying why
there can be none (no /dev/fuse, no fusermount3, no mfusepy or libfuse3)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.faults import lazyfs


@pytest.fixture
def fuse() -> None:
    """Skips the test, saying why, where no FUSE filesystem can be mounted."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    if shutil.which("fusermount3") is None:
        pytest.skip("fusermount3 not installed: apt-get install fuse3")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(f"mfusepy or libfuse3 missing: {exc}")


@pytest.fixture
def mount(fuse: None, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with lazyfs.mounted(folder, tmp_path / "lazyfs.log") as name:
        yield folder, name
    assert lazyfs.mounted_source(folder) is None
