"""The other half: imports a at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cycle.a  # type: ignore[import-not-found]  # noqa: F401

if TYPE_CHECKING:
    from cycle import c  # type: ignore[import-not-found]  # noqa: F401
