"""Durations as people write them in scenarios: ``500ms``, ``2s``, ``1.5m``, ``1h``.

One definition for the whole scenario format, fault kinds' parameters included: it lives in
faults/_duration.py (the engine cannot import the harness) and is named here too.
"""

from __future__ import annotations

from faults._duration import DURATION_HELP as DURATION_HELP
from faults._duration import MAX_DURATION as MAX_DURATION
from faults._duration import Duration as Duration
from faults._duration import format_duration as format_duration
from faults._duration import parse_duration as parse_duration
