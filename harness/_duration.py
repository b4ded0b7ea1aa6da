"""Durations as people write them in scenarios: ``500ms``, ``2s``, ``1.5m``, ``1h``."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|min|m|h)\s*$")
DURATION_HELP = "a duration like 500ms, 2s, 1.5m or 1h (a bare number means seconds)"


def parse_duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected {DURATION_HELP}, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return timedelta(seconds=float(value))
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    raise ValueError(f"expected {DURATION_HELP}, got {value!r}")


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
