"""Helpers the test modules share: the CLI as a user runs it, timelines, quick scenarios."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANKS_JOB = ROOT / "tests" / "fixtures" / "ranks_job.py"


def cli(
    *args: str, cache: Path | None = None, cwd: Path | None = None, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGS`` in a subprocess; ``cache`` is its fault-free baseline cache."""
    env = dict(os.environ)
    if cache is not None:
        env["AFTERSHOCK_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """A run's timeline (events.jsonl), optionally only the events named ``kind``."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return [e for e in events if kind is None or e.get("event") == kind]


def quick_scenario(name: str, rest: str, *, ranks: int = 2, duration: float = 1.0) -> str:
    """A scenario on ``ranks_job.py``: torch-free rank processes printing ``rank R step N
    gen 0 t=T`` every 50 ms for ``duration`` seconds. ``rest`` is the YAML after ``system``
    (faults, expect)."""
    return f"""\
name: {name}
system:
  command: [{sys.executable}, {RANKS_JOB}]
  env: {{JOB_RANKS: "{ranks}", JOB_DURATION: "{duration}"}}
  probes:
    - event: step
      pattern: 'rank (?P<rank>\\d+) step (?P<step>\\d+) gen (?P<generation>\\d+) t=(?P<time>\\S+)'
{rest}"""


def on_two_ranks(text: str) -> str:
    """A shipped 2 replicas x 2 shards scenario's text, on a 2-rank data-parallel world: for
    deliberately broken variants whose bug does not depend on the layout (half the start-up)."""
    two = text.replace("world: {replicas: 2, shards: 2}", "world: {replicas: 2, shards: 1}")
    assert two != text, "the scenario has no 2 x 2 world to shrink"
    return two
