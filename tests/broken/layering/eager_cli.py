"""Deliberately broken: a command line that imports, at import, what only some of its
commands need (the scenario models and loader, JUnit's ElementTree, the serving client's
http.client, the Docker SDK's engine module), as harness/cli.py, harness/reporting/report.py and
harness/run/loadgen.py
did or could. tests/test_layering.py shows its import checks catch each of them."""

from __future__ import annotations

import http.client  # noqa: F401
from xml.etree import ElementTree  # noqa: F401

import aftershock.harness.cli
import aftershock.harness.scenario.load  # noqa: F401
