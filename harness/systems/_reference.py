"""What the reference systems (trainer.py, server.py) share: the code their twins run."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path


def fingerprint(patterns: tuple[str, ...]) -> str:
    """A digest of reference_impl's source files matching ``patterns`` (found without
    importing it), so that editing the reference code invalidates cached twins."""
    digest = hashlib.sha256()
    found = importlib.util.find_spec("aftershock.reference_impl")
    for folder in found.submodule_search_locations or [] if found else []:
        for pattern in patterns:
            for path in sorted(Path(folder).glob(pattern)):
                digest.update(str(path.relative_to(folder)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()
