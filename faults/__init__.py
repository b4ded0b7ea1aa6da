"""Aftershock's chaos engine: faults applied to real processes, sockets, tensors and files.

A fault kind is a small object with ``inject`` and ``revert`` (and ``validate``
when it journals an undo record), registered under its dotted name
(``process.kill``). Built-in kinds live in this package; third
parties add kinds through the ``aftershock.faults`` entry-point group, loaded on
first lookup. This package imports nothing from ``harness`` or ``reference_impl``.
"""

from __future__ import annotations

from faults.journal import UndoContext, UndoRefused
from faults.registry import (
    Applied,
    FaultKind,
    GroupKind,
    KindInfo,
    PreparedKind,
    Validates,
    get,
    kinds,
    register,
)

__all__ = [
    "Applied", "FaultKind", "GroupKind", "KindInfo", "PreparedKind", "UndoContext",
    "UndoRefused", "Validates", "get", "kinds", "register",
]
