"""A fault-free twin is trusted from the cache only where no one else could have put it.

An ``AFTERSHOCK_CACHE_DIR`` that another user owns or anyone can write (mode 0777), holding
a planted digest, made a correct run fail ``params_match``; it could as well have made a
broken run pass. The cache gets the heal journal's rules: owned by the user and writable by
no one else, else not read (the twin runs again) and the report says why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _helpers import cli

JOB = "import os; print(f\"rank 0 params digest={os.environ.get('DIGEST', 'abc123')}\")\n"

SCENARIO = f"""\
name: planted
system:
  command: [{sys.executable}, job.py]
  probes: [{{pattern: 'rank (?P<rank>\\d+) params digest=(?P<digest>[0-9a-f]+)', event: params}}]
expect:
  params_match: fault_free
"""


def _run(folder: Path, cache: Path, name: str) -> dict:
    out = folder / f"{name}.json"
    proc = cli("run", str(folder / "s.yaml"), "--json", str(out), "--run-dir",
               str(folder / name), cache=cache, timeout=100)
    assert out.exists(), proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    return next(c for c in record["checks"] if c["name"] == "params_match")


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    """A cache whose twin, recorded by a first run, now holds a wrong digest."""
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "s.yaml").write_text(SCENARIO)
    cache = tmp_path / "cache"
    assert _run(tmp_path, cache, "first")["passed"]
    (cached,) = (cache / "fault_free").glob("*.json")
    data = json.loads(cached.read_text())
    data["digests"] = {"0": "0badc0de"}
    cached.write_text(json.dumps(data))
    return cache, cached


@pytest.mark.parametrize("plant", ["world_writable_folder", "file_of_another_user"])
def test_a_planted_twin_is_not_trusted(tmp_path: Path, plant: str) -> None:
    cache, cached = _planted(tmp_path)
    if plant == "world_writable_folder":
        os.chmod(cache / "fault_free", 0o777)
    else:
        os.chown(cached, 65534, 65534)
    check = _run(tmp_path, cache, "second")
    assert check["passed"], check
    assert "not trusted" in check["message"], check
    assert (tmp_path / "second" / "planted" / "fault_free").is_dir()  # the twin ran again


def test_an_owned_private_cache_is_used(tmp_path: Path) -> None:
    """The control: the same planted digest in a cache only we can write is believed (what
    the cache is for), so the first test fails for the reason it names."""
    cache, _ = _planted(tmp_path)
    assert not _run(tmp_path, cache, "second")["passed"]
