"""Test-only: deliberately broken variants of the reference server, to show checks failing.

Nothing in ``reference_impl`` knows these exist. A test (or a scenario written by a test)
puts this folder on the server's ``PYTHONPATH`` and names the variants in
``AFTERSHOCK_INJECT_BROKEN_SERVING`` (comma-separated); Python imports this module at the
start of every process of the server (the launcher, the router, each worker), and it
patches the named methods the moment their module is first imported, in whichever process
imports it. The harness's fault-free twin runs without ``AFTERSHOCK_INJECT_*`` variables
(``Scenario.without_faults``), so the twin is the correct server.

Variants, by the path each breaks:

- ``drop_inflight`` (router, migration): a failed worker's in-flight requests are ended
  silently: their streams finish early with ``[DONE]``, tokens are lost;
- ``replay_from_zero`` (router, migration): a moved request starts again at token 0 and is
  streamed again, so clients see every index up to the failure twice;
- ``no_fencing`` (router, fencing): every token of an unfinished request counts, from any
  link and any assignment, in arrival order;
- ``resume_from_zero`` (router, journal replay): a restarted router resumes each unfinished
  request from token 0 and streams it again after the tokens the journal holds;
- ``ignore_offset`` (router, idempotent re-POST): a resuming client's ``offset`` is ignored,
  its request is streamed from the first token again;
- ``reprefill_not_invariant`` (engine, migration): a migrated request's re-prefill of its
  emitted tokens runs through the batched split-K kernel instead of the batch-invariant
  one: same tokens almost always, different logits;
- ``unverified_hits`` (engine, prefix cache): prefix-cache hits are used without verifying
  their checksums (``verify: read`` still checks blocks running sequences hold).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

VARIANTS_ENV = "AFTERSHOCK_INJECT_BROKEN_SERVING"


def _announce(variant: str) -> None:
    print(f"[test-only] DELIBERATELY BROKEN ({variant}) in pid {os.getpid()}",
          file=sys.stderr, flush=True)


# --- router -----------------------------------------------------------------------------------


def drop_inflight(router: ModuleType) -> None:
    def move(self: Any, request: Any, failed: int, now: float) -> None:
        request.worker, request.link, request.epoch = None, None, 0
        self._finish_locked(request)  # a silent, short answer

    router.Router._move_locked = move


def replay_from_zero(router: ModuleType) -> None:
    original = router.Router._move_locked

    def move(self: Any, request: Any, failed: int, now: float) -> None:
        request.expected = 0  # the stream starts over: the new worker gets no emitted tokens
        original(self, request, failed, now)

    router.Router._move_locked = move


def no_fencing(router: ModuleType) -> None:
    def refusal(self: Any, link: Any, request: Any, epoch: int, index: int) -> str | None:
        return "dropped_tokens" if request.finished else None  # trusts whoever sends

    router.Router._refusal_locked = refusal


def resume_from_zero(router: ModuleType) -> None:
    original = router.Router._restore

    def restore(self: Any, replayed: Any) -> None:
        original(self, replayed)
        for request in self._requests.values():
            if not request.finished:
                request.expected = 0  # recomputed from token 0 and appended to the log again

    router.Router._restore = restore


def ignore_offset(router: ModuleType) -> None:
    original = router.Router.stream

    def stream(self: Any, request: Any, offset: int = 0) -> Any:
        return original(self, request, 0)

    router.Router.stream = stream
    subscribe = router.Router.subscribe  # what the HTTP API streams through

    def subscribe_from_zero(self: Any, request: Any, offset: int, *args: Any) -> Any:
        return subscribe(self, request, 0, *args)

    router.Router.subscribe = subscribe_from_zero


# --- engine -----------------------------------------------------------------------------------


def reprefill_not_invariant(engine: ModuleType) -> None:
    from aftershock.reference_impl.serving.model import Segment

    original = engine.Engine._forward_invariant

    def forward(self: Any, plan: Sequence[tuple[Any, int]]) -> Any:
        logits = original(self, plan)  # every planned position, batch-invariant
        # Sequences re-prefilling tokens emitted on another worker (a migration): their
        # positions again through the batched kernel, which overwrites their KV.
        moved = [(i, seq, end) for i, (seq, end) in enumerate(plan)
                 if seq.elsewhere[0] < seq.elsewhere[1] and seq.computed < seq.elsewhere[1]]
        if not moved:
            return logits
        segments = [Segment(self.cache.table(seq.id), seq.computed, seq.tokens[seq.computed:end])
                    for _, seq, end in moved]
        rows = self.model.forward_batched(self.kv, segments)
        sampling = [i for i, (seq, end) in enumerate(plan) if end == len(seq.tokens)]
        for row, (i, seq, end) in zip(rows, moved, strict=True):
            if end == len(seq.tokens):
                logits[sampling.index(i)] = row
        return logits

    engine.Engine._forward_invariant = forward


def unverified_hits(engine: ModuleType) -> None:
    def verified_hits(self: Any, seq: Any, hits: list[int]) -> list[int]:
        return hits  # used as found

    engine.Engine._verified_hits = verified_hits


PATCHES: dict[str, dict[str, Callable[[ModuleType], None]]] = {
    "aftershock.reference_impl.serving.router": {
        "drop_inflight": drop_inflight, "replay_from_zero": replay_from_zero,
        "no_fencing": no_fencing, "resume_from_zero": resume_from_zero,
        "ignore_offset": ignore_offset,
    },
    "aftershock.reference_impl.serving.engine": {
        "reprefill_not_invariant": reprefill_not_invariant, "unverified_hits": unverified_hits,
    },
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
