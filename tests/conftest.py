"""Shared fixtures: every test gets its own heal-journal and cache folders."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]

# Saved run folders (tests/fixtures/recorded/*/scenario.yaml) are data for the report tests,
# not scenarios to run: the plugin would collect any YAML with a `system:` key.
collect_ignore_glob = ["fixtures/*"]


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
