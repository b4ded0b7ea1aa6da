"""Durations as people write them in scenarios: ``500ms``, ``2s``, ``1.5m``, ``1h``.

One definition for the whole scenario format, fault kinds' parameters included: it lives in
the engine (faults/params.py; the engine cannot import the harness) and is named here too.
"""

from __future__ import annotations

from aftershock.faults.params import DURATION_HELP as DURATION_HELP
from aftershock.faults.params import MAX_DURATION as MAX_DURATION
from aftershock.faults.params import Duration as Duration
from aftershock.faults.params import format_duration as format_duration
from aftershock.faults.params import parse_duration as parse_duration
