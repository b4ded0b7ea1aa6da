"""Thin wrapper over the `nft` command: load a ruleset, delete a table, list tables."""

from __future__ import annotations

import os
import shutil
import subprocess

from faults._errors import FaultUnavailable

TABLE_PREFIX = "aftershock_"


def nft_binary() -> str:
    # /usr/sbin is not on every PATH (sudo-less shells, some CI images).
    candidates = (shutil.which("nft"), "/usr/sbin/nft", "/sbin/nft")
    found = next((p for p in candidates if p and os.access(p, os.X_OK)), None)
    if found is None:
        raise FaultUnavailable("nft not installed: apt-get install nftables")
    return found


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nft_binary(), *args], input=stdin, capture_output=True, text=True, timeout=30, check=False
    )


def load(ruleset: str) -> None:
    """Apply ``ruleset`` atomically (`nft -f -`): all of it or none of it."""
    result = _run(["-f", "-"], stdin=ruleset)
    if result.returncode != 0:
        raise FaultUnavailable(f"nft refused the ruleset: {result.stderr.strip()}\n{ruleset}")


def tables(family: str = "inet") -> list[str]:
    result = _run(["list", "tables", family])
    if result.returncode != 0:
        raise FaultUnavailable(f"nft list tables failed: {result.stderr.strip()}")
    return [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("table")]


def delete_table(name: str, family: str = "inet") -> None:
    """Delete table ``name``; a table that is already gone is not an error."""
    try:
        nft_binary()
    except FaultUnavailable:
        return  # without nft no table can have been made
    if name not in tables(family):
        return
    result = _run(["delete", "table", family, name])
    if result.returncode != 0 and name in tables(family):
        raise RuntimeError(f"nft delete table {family} {name}: {result.stderr.strip()}")
