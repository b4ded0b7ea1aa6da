"""In-process probe: how a system under test reports to Aftershock's timeline.

Standard library only, so any process can import it without pulling in torch,
pydantic or the rest of the harness. Every call is a no-op unless the harness
launched the process (``AFTERSHOCK_EVENTS`` is set), so a trainer can keep its
probe calls in production code.

Events are appended as JSON lines to one file shared by the harness and every
process of the run. Each line is written with a single ``write`` on an
``O_APPEND`` descriptor, which keeps lines whole with many writers. Times come
from ``time.monotonic()``: CLOCK_MONOTONIC is one clock for every process on a
Linux host, so the harness can order events from all ranks on one timeline.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

# The environment the harness gives every process it launches (faults/contract.py).
from aftershock.faults import jsonl
from aftershock.faults.contract import COMMANDS_ENV as COMMANDS_ENV
from aftershock.faults.contract import EVENTS_ENV as EVENTS_ENV
from aftershock.faults.contract import HELLO, NODE_ENV, STEP, TENSORS
from aftershock.faults.contract import OUTPUT_ENV as OUTPUT_ENV
from aftershock.faults.contract import RUN_ID_ENV as RUN_ID_ENV

__all__ = ["checkpoint_loaded", "checkpoint_saved", "checkpoint_skipped", "detected", "emit",
           "enabled", "fault_point", "hello", "install", "output_dir", "params", "recovered",
           "set_rank", "step", "wrap_group"]

_lock = threading.RLock()  # re-entrant: a signal handler may report while emit() holds it
_fd: int | None = None
_fd_path: str | None = None
_logical_rank: int | None = None
_generation: Any = None  # the world this process last named in a hello or step
_engine: Any = None  # faults.inproc.Engine once install() or wrap_group() ran
_engine_lock = threading.Lock()


def enabled() -> bool:
    """True when the process was launched by the harness and events are recorded."""
    return bool(os.environ.get(EVENTS_ENV))


def output_dir() -> str | None:
    """Folder where the system under test may leave artifacts (final params, ...)."""
    return os.environ.get(OUTPUT_ENV) or None


def _rank() -> int | None:
    if _logical_rank is not None:
        return _logical_rank
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def emit(event: str, **fields: Any) -> None:
    """Append one event to the run's timeline. Never raises: a probe must not
    break the system it observes."""
    global _fd, _fd_path, _generation
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    record: dict[str, Any] = {"t": time.monotonic(), "event": event, "pid": os.getpid()}
    rank = _rank()
    if rank is not None and "rank" not in fields:
        record["rank"] = rank
    record["source"] = f"rank{rank}" if rank is not None else "process"
    # Every event names the world this process is in: the generation of its last hello or
    # step (a survivor that stays in place may name a new generation only in its steps).
    # Recovery counts a step only when every rank committed it in one world.
    if event in (HELLO, STEP) and fields.get("generation") is not None:
        _generation = fields["generation"]
    if _generation is not None:
        record["generation"] = _generation
    record.update(fields)
    line = jsonl.encode(record, default=str)
    try:
        with _lock:
            if _fd is None or _fd_path != path:
                _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                _fd_path = path
            os.write(_fd, line)
    except OSError:
        pass


def hello(*, world: int, generation: int | str = 0, **fields: Any) -> None:
    """A rank is up: its pid, rank, world size and generation: the identity of the world
    it is in now (a restart count, a membership plan). Say hello again on joining another
    world, or name the new generation in ``step``; later events carry it."""
    node = os.environ.get(NODE_ENV, "")
    if node.isdigit() and "node" not in fields:
        # On a node of a multi-node run the pid is the node's own (its PID namespace): the
        # harness finds the host's process from the node and that pid.
        fields["node"] = int(node)
    emit(HELLO, world=world, generation=generation, **fields)


def step(n: int, *, world: int, **fields: Any) -> None:
    """Step ``n`` was committed by this rank (its parameters now include it). Call it
    after the commit: its time is the proof the step came after a fault. ``world`` is
    the world's size; ``generation=`` names the world, if it changed since hello."""
    emit(STEP, step=n, world=world, **fields)


def detected(cause: str, **fields: Any) -> None:
    """The system noticed a failure (a peer died, a collective timed out, ...)."""
    emit("failure_detected", cause=cause, **fields)


def recovered(**fields: Any) -> None:
    """The system believes it is whole again (it may still need steps to prove it)."""
    emit("recovery_done", **fields)


def checkpoint_saved(step: int, path: str, **fields: Any) -> None:
    emit("checkpoint_saved", step=step, path=path, **fields)


def checkpoint_loaded(step: int, path: str, **fields: Any) -> None:
    emit("checkpoint_loaded", step=step, path=path, **fields)


def checkpoint_skipped(path: str, reason: str, **fields: Any) -> None:
    emit("checkpoint_skipped", path=path, reason=reason, **fields)


def params(digest: str, **fields: Any) -> None:
    """The final parameters of this rank, as a hex digest of their exact bytes."""
    emit("params", digest=digest, **fields)


def set_rank(rank: int | None) -> None:
    """The training rank this process now plays (a warm spare taking over rank 1 says 1);
    every later event, and in-process faults aimed at a rank, use it."""
    global _logical_rank
    _logical_rank = rank


def install(*, model: Any = None, optimizer: Any = None,
            tensors: dict[str, Any] | None = None) -> bool:
    """Opt in to in-process faults: route torch.distributed's collective functions through
    the fault engine and name the tensors memory faults may hit (parameters, gradients,
    optimizer state, extras given as name -> zero-argument getter). A no-op, returning
    False, unless the harness launched this process. Call again to add tensors (e.g. after
    rebuilding a model). Groups the process builds itself, outside torch.distributed's
    tables, opt in through :func:`wrap_group`."""
    engine = _start_engine()
    if engine is None:
        return False
    engine.watch(model, optimizer, tensors)
    _publish_addresses(model)
    return True


def wrap_group(group: Any) -> Any:
    """Opt a process group in to in-process collective faults, whoever calls it.

    Returns a wrapper that behaves as ``group`` (any ``torch.distributed.ProcessGroup`` or
    backend, e.g. a ``ProcessGroupGloo`` built directly) and asks the fault engine before
    each of its collectives: use it instead of ``group``. Returns ``group`` itself unless
    the harness launched this process, so production code can keep the call. Needed for
    groups called directly (``group.allreduce(...)``) that torch.distributed did not create
    through ``init_process_group`` or ``new_group``; those are covered by :func:`install`.
    """
    engine = _start_engine()
    if engine is None:
        return group
    from aftershock.faults import inproc

    return inproc.wrap_group(group, engine)


def _start_engine() -> Any:
    """The in-process fault engine, started on first use (which also routes
    torch.distributed's collective functions through it); None outside the harness."""
    global _engine
    path = os.environ.get(COMMANDS_ENV)
    if not enabled() or not path:
        return None
    with _engine_lock:
        if _engine is None:
            from aftershock.faults import (
                inproc,  # torch and the engine only where faults are wanted
            )

            engine = inproc.Engine(inproc.Inbox(path), rank=_rank, emit=emit)
            inproc.install_collectives(engine)
            _engine = engine
    return _engine


def _publish_addresses(model: Any) -> None:
    """Where each CPU parameter lives, so a fault from outside the process
    (`memory.bitflip` with `address_of`, through /proc/PID/mem) can hit a named
    parameter later with no help from inside at fault time."""
    if model is None:
        return
    where = {}
    for name, param in model.named_parameters():
        data = param.data
        if data.device.type == "cpu" and data.is_contiguous():
            where[f"param:{name}"] = [data.data_ptr(), data.numel(), data.element_size()]
    if where:
        emit(TENSORS, tensors=where)


def fault_point(phase: str, step: int) -> None:
    """The process is at ``phase`` (forward, backward, optimizer, ...) of ``step``:
    in-process memory faults aimed at this moment are applied here."""
    if _engine is not None:
        _engine.at_point(step, phase)
