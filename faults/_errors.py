"""Errors the fault kinds raise when a facility they need is missing or refused."""

from __future__ import annotations


class FaultUnavailable(RuntimeError):
    """This machine cannot cause the fault for real (missing tool, kernel feature, privilege).

    The message says what is missing and how to get it; a kind never falls back
    to a weaker mechanism without saying so in its parameters.
    """
