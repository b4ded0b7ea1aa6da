"""Test-only: broken variants of the reference server's durability path (issue 47, class 1).

Nothing in ``reference_impl`` knows these exist. A test puts this folder on the server's
``PYTHONPATH`` (``system.env``) and names the variants in
``AFTERSHOCK_INJECT_BROKEN_DURABILITY`` (comma-separated); Python imports this module at the
start of every process of the server, and it patches the named methods the moment their
module is imported. The fault-free twin runs without ``AFTERSHOCK_INJECT_*`` variables, so
it is the correct server. The same pattern as ``tests/serving/broken/sitecustomize.py``.

Variants:

- ``shown_before_durable`` (journal): the router acknowledges a request and streams its
  tokens once their record is written, before it is fsynced (the batched fsync runs every
  50 ms on its own thread): a crash of the router process loses nothing (the kernel holds
  the write), a power loss loses what clients already saw, but only where it lands within
  those 50 ms (here about two runs in three: `aftershock explore` finds it, one run may not);
- ``never_synced`` (journal): the same, but the journal is never fsynced while it serves (the
  page cache is trusted, the classic form): a power loss at any moment after a token was
  shown loses it, so one run of ``journal_power_loss`` always shows it;
- ``redo_after_crash`` (journal replay): a restarted router does not resume the requests the
  journal holds unfinished; it treats them as failed, so a client's re-POST starts each again
  from scratch (deterministic decoding gives the same tokens: invisible to output checks).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

VARIANTS_ENV = "AFTERSHOCK_INJECT_BROKEN_DURABILITY"


def _announce(variant: str) -> None:
    print(f"[test-only] DELIBERATELY BROKEN ({variant}) in pid {os.getpid()}",
          file=sys.stderr, flush=True)


def shown_before_durable(journal: ModuleType) -> None:
    original = journal.Journal.sync

    def sync(self: Any) -> None:
        if threading.current_thread().name == "journal-writer":
            return  # the writer tells the router at once; the fsync thread syncs later
        original(self)

    journal.Journal.sync = sync


def never_synced(journal: ModuleType) -> None:
    def sync(self: Any) -> None:
        return None  # neither the writer nor the fsync thread makes anything durable

    journal.Journal.sync = sync


def redo_after_crash(router: ModuleType) -> None:
    original = router.Router._restore

    def restore(self: Any, replayed: Any) -> None:
        original(self, replayed)
        for request in self._requests.values():
            if request.id in self._pending:
                self._pending.remove(request.id)
                request.finished = request.over = True
                request.error = "the router restarted"

    router.Router._restore = restore


PATCHES: dict[str, dict[str, Callable[[ModuleType], None]]] = {
    "aftershock.reference_impl.serving.journal": {"shown_before_durable": shown_before_durable,
                                                   "never_synced": never_synced},
    "aftershock.reference_impl.serving.router": {"redo_after_crash": redo_after_crash},
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a patched module as the other finders would, and patches it once it ran."""

    def __init__(self, wanted: dict[str, list[str]]) -> None:
        self.wanted = wanted

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        variants = self.wanted.get(name)
        if not variants:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for variant in variants:
                PATCHES[name][variant](module)
                _announce(variant)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    names = [v.strip() for v in os.environ.get(VARIANTS_ENV, "").split(",") if v.strip()]
    known = {v for patches in PATCHES.values() for v in patches}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"{VARIANTS_ENV}: unknown variants {unknown} (known: {sorted(known)})")
    wanted = {module: [v for v in names if v in patches] for module, patches in PATCHES.items()}
    if any(wanted.values()):
        sys.meta_path.insert(0, _PatchOnImport(wanted))


_install()
