"""Where this copy of Aftershock is imported from: the folder holding the ``aftershock``
package, which a child process needs first on its PYTHONPATH to import the same copy (the
repository in a checkout, ``site-packages`` in an install)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
