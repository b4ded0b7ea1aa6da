"""Imports b only inside a function (and b imports c only for types): no cycle."""

from __future__ import annotations


def later() -> None:
    from cycle import b  # type: ignore[import-not-found]  # noqa: F401
