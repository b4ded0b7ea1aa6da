"""`aftershock --version` and `--help`: the version of the installed distribution, and each
command's description as written, every paragraph whole at any terminal width."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from _helpers import ROOT
from typer.models import CommandInfo
from typer.testing import CliRunner

from aftershock.harness.cli import app

pytestmark = pytest.mark.timeout(120)


def test_version_is_the_installed_distributions() -> None:
    shown = subprocess.run([sys.executable, "-m", "aftershock", "--version"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"aftershock {version('aftershock')}\n"


def _name(command: CommandInfo) -> str:
    assert command.callback is not None
    return command.name or command.callback.__name__


def _help(*args: str) -> str:
    shown = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "1000"})
    assert shown.exit_code == 0, shown.output
    return shown.output


@pytest.mark.parametrize("command", sorted(_name(c) for c in app.registered_commands))
def test_help_keeps_each_paragraph_of_a_commands_description_whole(command: str) -> None:
    # The source wraps docstrings at 100 columns; on a wide terminal each paragraph must be
    # one line, not the source's lines (which split sentences mid-way at other widths).
    (registered,) = [c for c in app.registered_commands if _name(c) == command]
    doc = inspect.cleandoc(registered.callback.__doc__ or "")
    lines = [line.strip() for line in _help(command).splitlines()]
    for paragraph in doc.split("\n\n"):
        assert " ".join(paragraph.split()) in lines
    first = " ".join(doc.split("\n\n")[0].split())
    assert any(first in line for line in _help().splitlines())
