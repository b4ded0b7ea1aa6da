"""Thin wrapper over the `nft` command: load a ruleset, delete a table, list tables.

Each call acts on the harness's own network namespace, or on another one (a container's)
given as an open descriptor ``netns``: the `nft` child enters it before it runs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._netns import enter as enter_netns

TABLE_PREFIX = "aftershock_"


def nft_binary() -> str:
    # /usr/sbin is not on every PATH (sudo-less shells, some CI images).
    candidates = (shutil.which("nft"), "/usr/sbin/nft", "/sbin/nft")
    found = next((p for p in candidates if p and os.access(p, os.X_OK)), None)
    if found is None:
        raise FaultUnavailable("nft not installed: apt-get install nftables")
    return found


def _run(
    args: list[str], stdin: str | None = None, netns: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nft_binary(), *args], input=stdin, capture_output=True, text=True, timeout=30,
        check=False, pass_fds=() if netns is None else (netns,),
        preexec_fn=None if netns is None else functools.partial(enter_netns, netns),
    )


def load(ruleset: str, netns: int | None = None) -> None:
    """Apply ``ruleset`` atomically (`nft -f -`): all of it or none of it."""
    result = _run(["-f", "-"], stdin=ruleset, netns=netns)
    if result.returncode != 0:
        raise FaultUnavailable(f"nft refused the ruleset: {result.stderr.strip()}\n{ruleset}")


def tables(family: str = "inet", netns: int | None = None) -> list[str]:
    result = _run(["list", "tables", family], netns=netns)
    if result.returncode != 0:
        raise FaultUnavailable(f"nft list tables failed: {result.stderr.strip()}")
    return [line.split()[-1] for line in result.stdout.splitlines() if line.startswith("table")]


def delete_table(name: str, family: str = "inet", netns: int | None = None) -> None:
    """Delete table ``name``; a table that is already gone is not an error."""
    try:
        nft_binary()
    except FaultUnavailable:
        return  # without nft no table can have been made
    if name not in tables(family, netns):
        return
    result = _run(["delete", "table", family, name], netns=netns)
    if result.returncode != 0 and name in tables(family, netns):
        raise RuntimeError(f"nft delete table {family} {name}: {result.stderr.strip()}")
