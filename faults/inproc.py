"""In-process faults: the harness arms them, a probe inside the target applies them.

Some faults can only be caused from inside a process at an exact moment: fail
the 3rd all_reduce of step 40 on rank 1, put a NaN into one gradient after
backward. The engine sends such a fault as a command, one JSON line appended
to the run's command file (``AFTERSHOCK_COMMANDS`` in the target's
environment); the probe in each rank reads new lines at its fault points and
collective calls, and applies the ones meant for its rank when their condition
holds. It reports the moment it applied one as a ``fault_injected`` event.

Collective faults act on process-group objects, whoever calls them. A group the
target builds itself (the reference trainer's hot_spare and elastic strategies
build a ``ProcessGroupGloo`` per membership generation and call its methods) is
opted in with ``aftershock.harness.probe.wrap_group(group)``, which returns a
:class:`FaultyGroup`: a wrapper around that object, as torchft's
``FakeProcessGroupWrapper`` wraps any ProcessGroup, whose collective methods ask
the engine before calling the group's own. The groups torch.distributed creates
and keeps in its own tables (``init_process_group``, ``new_group``) cannot be
swapped for a wrapper once the target holds them, and torch.distributed's
functions are their only Python entry point, so :func:`install_collectives`
routes those functions through the same engine. One engine decides for both
entry points, with the same op names, counts and conditions; a call on a
wrapped group made through a torch.distributed function counts once. Both work
the same for Gloo and NCCL. Not reached: C++ callers (DDP's reducer, functional
collectives) and code that bound ``dist.all_reduce`` to another name before
:func:`install_collectives` ran.

The kinds applied this way are declared in faults/collective.py (collective.*,
process.hang), faults/memory.py (memory.* with ``tensor``) and faults/process.py
(process.kill with ``at.phase``); this module is what they share, and the engine that runs
in the target. It imports torch only inside the functions that run in the target, and
never pydantic.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from aftershock.faults import _jsonl
from aftershock.faults._proc import ProcessRef, environ
from aftershock.faults.contract import COMMANDS_ENV, FAULT_INJECTED
from aftershock.faults.journal import Journal, UndoContext, UndoRefused
from aftershock.faults.registry import Applied

#: torch.distributed functions the wrapper intercepts, by the name scenarios use.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "gather", "scatter",
)

#: Collective methods of process-group objects (``ProcessGroup`` and backends such as
#: ``ProcessGroupGloo``, torch 2.x), by the op name scenarios use for them.
GROUP_METHODS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "allgather_coalesced": "all_gather",
    "all_gather_single": "all_gather_into_tensor", "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor",
    "broadcast": "broadcast", "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier", "monitored_barrier": "barrier",
    "send": "send", "recv": "recv", "recv_anysource": "recv",
    "gather": "gather", "scatter": "scatter",
}


def send(path: str, command: Mapping[str, Any]) -> None:
    _jsonl.append(path, _jsonl.encode(dict(command)))


def commands_path(target: ProcessRef, params: Mapping[str, Any]) -> str:
    path = environ(target.pid).get(COMMANDS_ENV) or params.get("commands")
    if not path:
        raise ValueError(
            f"pid {target.pid} has no {COMMANDS_ENV} in its environment: in-process faults "
            "need a process launched by the harness that calls aftershock.harness.probe.install()"
        )
    return str(path)


def arm(kind: str, target: ProcessRef, params: Mapping[str, Any], journal: Journal,
        *, revertible: bool = False) -> Applied:
    """Send an in-process fault to the target's probe; journal it if it needs a release."""
    path = commands_path(target, params)
    command_id = uuid.uuid4().hex[:12]
    undo = {"commands": path, "id": command_id}
    entry = journal.intend(kind, undo) if revertible else None
    clean = {k: v for k, v in params.items() if k != "commands"}
    send(path, {"op": "arm", "id": command_id, "kind": kind, "params": clean})
    where = f"rank {clean.get('rank')}" if clean.get("rank") is not None else "every rank"
    when = []
    if clean.get("at_step") is not None:
        when.append(f"step {clean['at_step']}")
    if clean.get("phase"):
        when.append(str(clean["phase"]))
    detail = f"armed {kind} on {where}" + (f" at {' '.join(when)}" if when else "")
    return Applied(kind, entry, undo, detail)


def release(undo: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):
        send(str(undo["commands"]), {"op": "release", "id": undo["id"]})


def validate_release(undo: Mapping[str, Any], context: UndoContext) -> None:
    """A release is a line appended to the run's own command file, nowhere else."""
    context.path(undo.get("commands"))
    if not isinstance(undo.get("id"), str):
        raise UndoRefused("a release without the command's id")


class InjectedCollectiveError(RuntimeError):
    """What a `collective.error` raises inside the target, like a backend error would."""


# ---------------------------------------------------------------- inside the target


class Inbox:
    """New command lines of the run's command file, read cheaply (a stat when idle)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tail = _jsonl.Tail()

    def poll(self) -> list[dict[str, Any]]:
        try:
            if os.stat(self.path).st_size <= self._tail.offset:
                return []
            with open(self.path, "rb") as handle:
                lines = self._tail.read(handle)
        except OSError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


def _getter(param: Any, attribute: str) -> Callable[[], Any]:
    return lambda: getattr(param, attribute)


def _state(optimizer: Any, param: Any, key: str) -> Callable[[], Any]:
    return lambda: optimizer.state.get(param, {}).get(key)


class Engine:
    """Applies armed commands inside one rank. Thread-safe; never raises on its own
    account (a broken command is reported and dropped), only the faults it injects."""

    def __init__(self, inbox: Inbox, *, rank: Callable[[], int | None],
                 emit: Callable[..., None]) -> None:
        self.inbox = inbox
        self.rank = rank
        self.emit = emit
        self.step: int | None = None
        self.phase: str | None = None
        self.armed: dict[str, dict[str, Any]] = {}
        self.released: set[str] = set()
        self.fired: set[tuple[str, Any]] = set()  # (command id, rank) fired in this run
        self.calls: Counter[str] = Counter()
        self.tensors: dict[str, Callable[[], Any]] = {}
        self._lock = threading.RLock()

    # -- commands
    def refresh(self) -> None:
        with self._lock:
            for command in self.inbox.poll():
                if command.get("op") == "arm" and command.get("id"):
                    self.armed[command["id"]] = command
                elif command.get("op") == "release":
                    self.released.add(str(command.get("id")))
                    self.armed.pop(str(command.get("id")), None)
                elif command.get("op") == "fired":
                    # Fired once per rank per run: a restarted process re-reads the file,
                    # and a spare read it before it took over the rank (kept until then).
                    self.fired.add((str(command.get("id")), command.get("rank")))
            rank = self.rank()
            for key in [k for k in self.armed if (k, rank) in self.fired]:
                del self.armed[key]

    def _mine(self, command: dict[str, Any]) -> bool:
        want = command["params"].get("rank")
        return want is None or want == self.rank()

    def _step_ok(self, params: Mapping[str, Any]) -> bool:
        at = params.get("at_step")
        return at is None or (self.step is not None and self.step >= int(at))

    def _fired(self, command: dict[str, Any], **fields: Any) -> None:
        self.armed.pop(command["id"], None)
        with contextlib.suppress(OSError):
            send(self.inbox.path, {"op": "fired", "id": command["id"], "rank": self.rank()})
        params = command["params"]
        self.emit(FAULT_INJECTED, kind=command["kind"], fault=params.get("fault"),
                  step=self.step, phase=self.phase, **fields)

    # -- named tensors
    def watch(self, model: Any = None, optimizer: Any = None,
              tensors: Mapping[str, Callable[[], Any]] | None = None) -> None:
        """Name the tensors memory faults may hit: ``param:NAME``, ``grad:NAME``,
        ``optim:NAME.STATE`` (e.g. ``optim:fc1.weight.exp_avg``) and any extra."""
        if model is not None:
            for name, param in model.named_parameters():
                self.tensors[f"param:{name}"] = _getter(param, "data")
                self.tensors[f"grad:{name}"] = _getter(param, "grad")
            if optimizer is not None:
                names = {id(p): n for n, p in model.named_parameters()}
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        pname = names.get(id(param))
                        if pname is None:
                            continue
                        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                            self.tensors[f"optim:{pname}.{key}"] = _state(optimizer, param, key)
        for name, getter in (tensors or {}).items():
            self.tensors[name] = getter

    def at_point(self, step: int, phase: str) -> None:
        """A fault point: the target is at ``phase`` of ``step``; memory faults, hangs and
        kills fire here."""
        hang = None
        kill = None
        with self._lock:
            self.step, self.phase = step, phase
            self.refresh()
            for command in list(self.armed.values()):
                if not self._due_at_point(command, phase):
                    continue
                kind, params = command["kind"], command["params"]
                if kind == "process.kill":
                    kill = signal.Signals[str(params.get("signal", "SIGKILL"))]
                    # Reported (and marked fired, so a restarted process does not repeat it)
                    # before the signal: after SIGKILL nothing more is written.
                    self._fired(command, detail=f"{kill.name} -> own pid {os.getpid()} at "
                                f"step {step} {phase}")
                    break
                if kind == "process.hang":
                    self._fired(command, detail=f"{threading.current_thread().name} thread "
                                f"blocked at step {step} {phase}")
                    hang = command
                    break
                self._poison(command)
        if kill is not None:
            os.kill(os.getpid(), kill)
        if hang is not None:
            # Only this thread stops, outside the lock: the process's other threads
            # (heartbeats, I/O) run on, as they do around a deadlocked loop.
            while hang["id"] not in self.released:
                time.sleep(0.01)
                with self._lock:
                    self.refresh()

    def _due_at_point(self, command: dict[str, Any], phase: str) -> bool:
        """Whether an armed memory fault, hang or kill fires at this point of this rank."""
        kind, params = command["kind"], command["params"]
        if not (kind.startswith("memory.") or kind in ("process.hang", "process.kill")):
            return False
        if not self._mine(command) or not self._step_ok(params):
            return False
        if params.get("phase"):
            return bool(params["phase"] == phase)
        # Before step N's backward the gradients here are step N-1's, which the loop drops
        # before computing its own: a NaN there hits nothing. Step N's gradient is the one
        # at its next point.
        return not (phase == "forward" and str(params.get("tensor", "")).startswith("grad:"))

    def _poison(self, command: dict[str, Any]) -> None:
        from aftershock.faults.memory import poison_tensor

        params = command["params"]
        pattern = str(params["tensor"])
        names = sorted(n for n in self.tensors if fnmatch.fnmatchcase(n, pattern))
        live = [(n, self.tensors[n]()) for n in names]
        live = [(n, t) for n, t in live if t is not None]
        if not live:
            return  # e.g. gradients before the first backward: stay armed
        rng = random.Random(int(params.get("seed", 0)))
        name, tensor = live[0] if len(live) == 1 else rng.choice(live)
        mode = {"memory.bitflip": "bitflip", "memory.nan": "nan", "memory.inf": "inf",
                "memory.zero": "zero"}[command["kind"]]
        result = poison_tensor(tensor, mode, index=params.get("index"), bit=params.get("bit"),
                               seed=int(params.get("seed", 0)), count=int(params.get("count", 1)))
        self._fired(command, tensor=name, detail=str(result))

    # -- collectives
    def around(self, op: str, call: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], *, returns_work: bool = False) -> Any:
        """Run ``call(*args, **kwargs)``, the collective ``op``, unless an armed fault takes
        this call. ``returns_work``: ``call`` is a process-group method, which returns a
        ``Work`` to wait for even when the caller did not ask for ``async_op``."""
        with self._lock:
            self.refresh()
            self.calls[op] += 1
            chosen = next((c for c in list(self.armed.values()) if self._takes_call(c, op)),
                          None)
        if chosen is None:
            return call(*args, **kwargs)
        return self._collective_fault(chosen, op, call, args, kwargs, returns_work=returns_work)

    def _takes_call(self, command: dict[str, Any], op: str) -> bool:
        """Whether an armed collective fault takes this call of ``op`` (counted if it is of
        the fault's op, rank, step and phase: the ``call``-th such call is taken)."""
        params = command["params"]
        if not command["kind"].startswith("collective.") or not self._mine(command):
            return False
        if params.get("op", "all_reduce") not in (op, "any"):
            return False
        if not self._step_ok(params):
            return False
        # With a phase, only calls made after that fault point of the step count:
        # `phase: backward` names the gradient all_reduce, not the forward pass's.
        if params.get("phase") and params["phase"] != self.phase:
            return False
        seen = int(params.setdefault("_seen", 0)) + 1
        params["_seen"] = seen
        return seen >= int(params.get("call", 1))

    def _collective_fault(self, chosen: dict[str, Any], op: str, call: Callable[..., Any],
                          args: tuple[Any, ...], kwargs: dict[str, Any], *,
                          returns_work: bool) -> Any:
        """The call of ``op`` that the armed fault ``chosen`` takes."""
        kind, params = chosen["kind"], chosen["params"]
        self._fired(chosen, op=op, call=self.calls[op])
        if kind == "collective.error":
            raise InjectedCollectiveError(
                f"aftershock: injected failure of {op} call {self.calls[op]} on rank {self.rank()}"
            )
        if kind == "collective.hang":
            # Hang as a wedged collective does: never return until released (healed).
            while chosen["id"] not in self.released:
                time.sleep(0.01)
                self.refresh()
            return call(*args, **kwargs)
        if kind == "collective.delay":
            time.sleep(float(params.get("delay", 1.0)))
            return call(*args, **kwargs)
        # collective.corrupt: the op completes, then its result is poisoned on this rank.
        result = call(*args, **kwargs)
        if (returns_work or kwargs.get("async_op")) and result is not None:
            result.wait()
        from aftershock.faults.memory import poison_tensor

        tensor = _first_tensor(args[0] if args else kwargs.get("tensor"))
        if tensor is not None:
            poison_tensor(tensor, str(params.get("mode", "nan")), index=params.get("index"),
                          bit=params.get("bit"), seed=int(params.get("seed", 0)))
        return result


def _first_tensor(value: Any) -> Any:
    """The tensor a collective leaves its result in: its first argument, or the first tensor
    of its (nested) lists of outputs (``allgather([[out0, out1]], [in])``); None for a call
    that has none here (a barrier, a gather's non-root rank)."""
    import torch

    while isinstance(value, list | tuple):
        value = next((v for v in value if not isinstance(v, list | tuple) or v), None)
    return value if torch.is_tensor(value) else None


class FaultyGroup:
    """A process group whose collectives ask an :class:`Engine` first.

    Wraps any process-group object (a ``torch.distributed.ProcessGroup``, or a backend such
    as ``ProcessGroupGloo``) as torchft's ``FakeProcessGroupWrapper`` wraps any
    ProcessGroup: each collective method (:data:`GROUP_METHODS`) goes through
    :meth:`Engine.around` and then to the wrapped group's own method; every other attribute
    is the wrapped group's. It holds the only reference the wrapper adds, so dropping the
    wrapper drops the group (and, for Gloo, closes its sockets) as dropping the group did.
    Built by ``aftershock.harness.probe.wrap_group``.
    """

    __slots__ = ("__weakref__", "_engine", "_group")

    def __init__(self, group: Any, engine: Engine) -> None:
        self._group = group
        self._engine = engine

    @property
    def wrapped(self) -> Any:
        """The process group itself."""
        return self._group

    def __getattr__(self, name: str) -> Any:
        # Only for what the class does not define: the group's own non-collective methods.
        if name in FaultyGroup.__slots__:  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._group, name)

    def __repr__(self) -> str:
        return f"FaultyGroup({self._group!r})"


def _collective_method(method: str, op: str) -> Callable[..., Any]:
    def collective(self: FaultyGroup, *args: Any, **kwargs: Any) -> Any:
        return self._engine.around(op, getattr(self._group, method), args, kwargs,
                                   returns_work=True)

    collective.__name__ = collective.__qualname__ = method
    collective.__doc__ = f"The wrapped group's ``{method}`` (``{op}`` in scenarios)."
    return collective


for _method, _op in GROUP_METHODS.items():
    setattr(FaultyGroup, _method, _collective_method(_method, _op))


def wrap_group(group: Any, engine: Engine) -> Any:
    """``group`` with its collectives routed through ``engine`` (once: a wrapped group is
    returned as it is)."""
    return group if isinstance(group, FaultyGroup) else FaultyGroup(group, engine)


def install_collectives(engine: Engine) -> None:
    """Route the torch.distributed collectives through ``engine``: the entry point of the
    groups torch.distributed keeps in its own tables."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "__aftershock__", False):
            continue

        def wrapper(*args: Any, __op: str = name, __call: Any = original, **kwargs: Any) -> Any:
            if any(isinstance(a, FaultyGroup) for a in (*args, *kwargs.values())):
                # torch.distributed calls the wrapped group's method, which asks the engine:
                # one call, counted once.
                return __call(*args, **kwargs)
            return engine.around(__op, __call, args, kwargs)

        wrapper.__aftershock__ = True  # type: ignore[attr-defined]
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = name
        setattr(dist, name, wrapper)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapper)
