"""Leaving a membership generation on the controller's word, without Gloo's help.

A survivor blocked in a collective learns of a dead peer from that peer's closed socket, or
from Gloo's timeout (10 s in the bench, 30 s by default) when nothing it waits on says
anything. The second happens:

- it waits on a *live* member that is itself stuck (on the dead one, or wedged);
- Gloo in torch 2.13 can miss a connection that closes while collectives run on it: an op
  then waits out its timeout although its peer is gone. Two ranks running all_reduces in a
  loop, every connection shut down at a random moment: one side waited for the timeout in
  25 of 60 tries, 13 of 40 with one end of each shut down
  (gloo_close_race.py, bench/results/profiles-2026.md). One ``elastic`` job of run AJ recovered
  after 10 s that way (docs/benchmarks.md).

The controller knows of a death within milliseconds and publishes a plan without it. No step
of a generation that lost a member can commit (the vote needs every member), so a member
still inside it has nothing left to wait for. Here it stops waiting:

- Every wait on a generation's process groups is a loop of short waits (``SLICE_S``) that
  gives up once the generation is superseded (``Abandonable``). Nothing is closed under
  Gloo's feet: its op is abandoned, and the group is destroyed later, off the way.
- The vote's star runs over our own sockets, which close cleanly: they are shut down
  (``Star.interrupt``), so a rank blocked in the vote fails at once, and so do its peers.
- A generation's groups are built on a thread of their own (``build``): Gloo's group
  constructor waits for every member's address until its timeout, and nothing interrupts
  it, so a member killed after the start line held the others there for the whole
  collective timeout. The build is given up like a wait; the thread ends on its own.

``Leave`` is told of every plan that does not wait for a step boundary (a lost member, a
fenced one, collectives failing with every member alive) by the plan watcher thread. A
planned switch (a replica rejoining) is left to the vote: members finish their step and
switch together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

#: How often a wait on a collective looks whether its generation was superseded: the most
#: a member waits on after the plan came.
SLICE_S = 0.02


T = TypeVar("T")


class Left(RuntimeError):
    """A wait was given up: a newer plan superseded the generation."""


class Leave:
    """Which generations a member must leave, and the vote's connections of its current one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = -1
        self._star: Any = None
        self._below = -1  # generations below this one are superseded
        # Works whose wait was given up: Gloo may still write into their tensors until they
        # fail (at their timeout) or complete, so the member replaces any buffer it would
        # reuse (its gradient buffer) and keeps them referenced meanwhile.
        self.abandoned: list[Any] = []

    def superseded(self, gen: int) -> bool:
        return self._below > gen

    def enter(self, gen: int, star: Any) -> None:
        """This member's generation ``gen`` is built, with ``star`` (``interrupt()``: shut
        its connections down). Interrupts it at once if a plan superseded ``gen``
        meanwhile."""
        with self._lock:
            self._gen, self._star = gen, star
            if self._below > gen:
                star.interrupt()

    def forget(self) -> None:
        """The generation's star is about to be closed: never touch it again."""
        with self._lock:
            self._star = None

    def supersede(self, gen: int) -> None:
        """A plan for generation ``gen`` that does not wait for a step boundary was
        published: every older generation is left."""
        with self._lock:
            self._below = max(self._below, gen)
            if self._star is not None and self._gen < gen:
                self._star.interrupt()


_SLICE = timedelta(seconds=SLICE_S)


class _Waiting:
    """A collective's work whose ``wait()`` gives up once its generation is superseded."""

    __slots__ = ("_gen", "_leave", "_work")

    def __init__(self, work: Any, leave: Leave, gen: int) -> None:
        self._work, self._leave, self._gen = work, leave, gen

    def wait(self, timeout: timedelta | None = None) -> bool:
        work, leave, gen = self._work, self._leave, self._gen
        if timeout is not None:
            return bool(work.wait(timeout))
        while True:
            if leave._below > gen:  # leave.superseded(gen), on every collective's way
                # Gloo may still write into this op's tensors until it fails or completes:
                # the caller must never use them again (``Leave.abandoned``).
                leave.abandoned.append(work)
                raise Left(f"left generation {gen}: a newer plan superseded it")
            try:
                return bool(work.wait(_SLICE))
            except RuntimeError:
                # The slice ran out ("Operation timed out!"), or the collective failed. It
                # may also have completed right after the slice ran out: then the wait
                # without a limit returns at once, or raises the collective's own error.
                if work.is_completed():
                    return bool(work.wait())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Abandonable:
    """A process group of generation ``gen`` whose collectives' waits give up once
    ``leave`` says the generation was superseded; everything else is the group's. The
    collectives the trainer calls are methods here (called every step: no lookup on the
    way); any other call whose result is a work is wrapped the same way."""

    __slots__ = ("_gen", "_group", "_leave")

    def __init__(self, group: Any, leave: Leave, gen: int) -> None:
        self._group, self._leave, self._gen = group, leave, gen

    def allreduce(self, *args: Any, **kwargs: Any) -> _Waiting:
        return _Waiting(self._group.allreduce(*args, **kwargs), self._leave, self._gen)

    def allgather(self, *args: Any, **kwargs: Any) -> _Waiting:
        return _Waiting(self._group.allgather(*args, **kwargs), self._leave, self._gen)

    def broadcast(self, *args: Any, **kwargs: Any) -> _Waiting:
        return _Waiting(self._group.broadcast(*args, **kwargs), self._leave, self._gen)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            if hasattr(out, "is_completed"):
                return _Waiting(out, self._leave, self._gen)
            return out

        return call


def build(make: Callable[[], T], leave: Leave, gen: int) -> T:
    """``make()`` (generation ``gen``'s groups), on a thread of its own: what it returns, or
    the error it raises; ``Left`` once ``gen`` is superseded. An abandoned build runs on until
    it completes or fails at its timeout, and drops what it built there, off the way. It
    may hold the store connection it builds through until then (a TCPStore connection runs
    one call at a time): after a ``Left`` the caller leaves it that one and takes a new
    one."""
    if leave.superseded(gen):
        raise Left(f"left generation {gen}: a newer plan superseded it before its build")
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            out: Any = make()
            error = None
        except Exception as exc:  # returned to the caller, or dropped with the build
            out, error = None, exc
        with lock:
            if not box.get("abandoned"):
                box["out"], box["error"] = out, error
        del out  # abandoned: what it built is destroyed here, not in the caller's way
        done.set()

    threading.Thread(target=run, daemon=True, name=f"build_gen{gen}").start()
    while not done.wait(SLICE_S):
        if leave.superseded(gen):
            with lock:
                if "out" not in box:
                    box["abandoned"] = True
                    raise Left(f"left generation {gen}: a newer plan superseded it during "
                               "its build")
            break
    if box["error"] is not None:
        raise box["error"]
    return box["out"]
