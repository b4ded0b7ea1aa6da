"""Where this copy of Aftershock is imported from: the folder holding the ``aftershock``
package (the repository in a checkout, ``site-packages`` in an install), and the
PYTHONPATH a child process needs to import the same copy."""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_pythonpath(existing: str | None = None, executable: str | None = None) -> str:
    """``existing`` (a PYTHONPATH, or the environment's) with ROOT first, so a child run
    from any folder imports this copy. Not where the child runs this interpreter from an
    install: its site-packages are on the child's path already, and put first they would
    come before the standard library."""
    if existing is None:
        existing = os.environ.get("PYTHONPATH", "")
    installed = {Path(p).resolve() for p in [*site.getsitepackages(),
                                             site.getusersitepackages()]}
    same = executable is None or os.path.realpath(executable) == os.path.realpath(
        sys.executable)
    first = [] if same and ROOT in installed else [str(ROOT)]
    return os.pathsep.join(p for p in (*first, existing) if p)
