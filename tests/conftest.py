"""Shared fixtures: every test gets its own heal-journal and cache folders."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]

# Saved run folders (tests/fixtures/recorded/*/scenario.yaml) are data for the report tests,
# not scenarios to run: the plugin would collect any YAML with a `system:` key.
collect_ignore_glob = ["fixtures/*"]

# A suite started in the background by a non-interactive shell (`make test &`, a CI step run
# that way) inherits SIGINT ignored, and so would every harness a test starts and then
# interrupts: Python installs no Ctrl-C handler in a process that begins with SIGINT ignored,
# and the Ctrl-C tests would wait out their budgets. The tests are about Ctrl-C, so their
# processes get it: a handled signal is back to its default in an exec'd child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _isolated_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("AFTERSHOCK_STATE_DIR", str(state))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fault-free baseline cache for the whole session (baselines cost seconds)."""
    return tmp_path_factory.mktemp("cache")
