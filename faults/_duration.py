"""Durations as people write them in scenarios: ``500ms``, ``2s``, ``1.5m``, ``1h``.

The one definition, for fault kinds' parameters (faults/params.py) and the whole scenario
format (harness/scenario/_duration.py names it too).
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|min|m|h)\s*$")
DURATION_HELP = "a duration like 500ms, 2s, 1.5m or 1h (a bare number means seconds)"
#: The longest duration a scenario may give, a whole run's timeout included. A week is far
#: beyond any test run; a longer value is a typo (and timedelta itself overflows at 10**9 days).
MAX_DURATION = timedelta(days=7)


def parse_duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"expected {DURATION_HELP}, got {_quote(value)}")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _PATTERN.match(value)):
        # A digit string too long for a float is inf here, and refused below.
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ValueError(f"expected {DURATION_HELP}, got {_quote(value)}")
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be finite, got {_quote(value)}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {_quote(value)}")
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError("a duration is at most 168h (a week), "
                         f"got {_quote(value)}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _quote(value: Any, limit: int = 60) -> str:
    """The bad value for a message: quoted, and shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-4:]}"


def format_duration(value: timedelta | float) -> str:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.3g}s"
    return f"{seconds / 60:.3g}m"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": _PATTERN.pattern},
                {"type": "number", "minimum": 0},
            ],
            "description": DURATION_HELP,
        }
    ),
]
