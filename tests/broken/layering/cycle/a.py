"""Half of the cycle: imports b at import."""

from __future__ import annotations

from cycle import b  # type: ignore[import-not-found]  # noqa: F401
