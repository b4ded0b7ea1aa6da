"""Aftershock's chaos engine: faults applied to real processes, sockets, tensors and files.

A fault kind is one object that declares its parameters (a pydantic model, faults/params.py),
where it acts (from outside the target's processes or inside them), what it needs from
the target, and its steps: ``prepare`` (optional), ``inject`` and ``revert`` (and
``validate`` when it journals an undo record). It is registered under its dotted name
(``process.kill``). Built-in kinds live in this package; third parties add kinds through
the ``aftershock.faults`` entry-point group, loaded on first lookup (docs/extending.md).

The names below are the engine's public API, for the harness and for other packages;
modules whose names start with ``_`` are not. This package imports nothing from
``harness`` or ``reference_impl``, and nothing outside the standard library at import
(the in-process probe imports it in every rank).
"""

from __future__ import annotations

from aftershock.faults import (
    _cgroup as cgroup,  # the run's cgroup v2 group: make, join, kill, remove
)

# The Docker engine, for nodes (docs/nodes.md); the SDK itself is imported only when used.
from aftershock.faults import _docker as docker_engine

# JSON-lines files: one encoding, one append, one tail for every writer and follower.
from aftershock.faults import _jsonl as jsonl
from aftershock.faults._errors import FaultUnavailable

# File triggers: inotify's reports, and fanotify's held opens (harness/run/triggers.py).
from aftershock.faults._fanotify import Gate as FileGate
from aftershock.faults._inotify import FileWatch
from aftershock.faults._inotify import matches as file_matches
from aftershock.faults._proc import ProcessRef, all_pids, kill_all, processes_with_env
from aftershock.faults._proc import command_line as process_command_line
from aftershock.faults._proc import environ as process_environ
from aftershock.faults._proc import parent as parent_pid
from aftershock.faults._proc import start_time as process_start_time
from aftershock.faults._proc import state as process_state
from aftershock.faults._proc import writers as file_writers
from aftershock.faults.journal import UndoContext, UndoRefused
from aftershock.faults.registry import (
    CAPABILITIES,
    Applied,
    FaultKind,
    GroupKind,
    Hooks,
    KindInfo,
    PreparedKind,
    Setting,
    Validates,
    get,
    hooks,
    kinds,
    register,
)

__all__ = [
    "CAPABILITIES", "Applied", "FaultKind", "FaultUnavailable", "FileGate", "FileWatch",
    "GroupKind", "Hooks", "KindInfo", "PreparedKind", "ProcessRef", "Setting", "UndoContext",
    "UndoRefused", "Validates", "all_pids", "cgroup", "docker_engine", "file_matches",
    "file_writers", "get", "hooks", "jsonl", "kill_all", "kinds", "parent_pid",
    "process_command_line", "process_environ", "process_start_time", "process_state",
    "processes_with_env", "register",
]
