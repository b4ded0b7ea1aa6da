"""Aftershock's harness: scenarios, targets, timelines, checks, reports, CLI and pytest plugin.

Importing this package is cheap on purpose (no torch, no docker, no rich): the
probe in ``aftershock.harness.probe`` runs inside training processes.
"""

from __future__ import annotations

__version__ = "0.1.0"
