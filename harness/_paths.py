"""Where the harness keeps what it may reuse between runs (one definition for every module)."""

from __future__ import annotations

import os
from pathlib import Path

from aftershock.faults import contract


def cache_dir() -> Path:
    """$AFTERSHOCK_CACHE_DIR, else $XDG_CACHE_HOME/aftershock (fault-free twins, the platform
    line of aftershock.harness.golden)."""
    explicit = os.environ.get(contract.CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aftershock"
