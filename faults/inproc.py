"""In-process faults: the harness arms them, a probe inside the target applies them.

Some faults can only be caused from inside a process at an exact moment: fail
the 3rd all_reduce of step 40 on rank 1, put a NaN into one gradient after
backward. The engine sends such a fault as a command, one JSON line appended
to the run's command file (``AFTERSHOCK_COMMANDS`` in the target's
environment); the probe in each rank reads new lines at its fault points and
collective calls, and applies the ones meant for its rank when their condition
holds. It reports the moment it applied one as a ``fault_injected`` event.

The collective wrapper patches the ``torch.distributed`` functions, so it works
the same for Gloo and NCCL; code that bound ``dist.all_reduce`` to another
name before :func:`install_collectives` ran is not affected.

This module imports torch only inside the functions that run in the target.
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

from faults._proc import ProcessRef, environ
from faults.journal import Journal, UndoContext, UndoRefused
from faults.registry import Applied, KindInfo, register

COMMANDS_ENV = "AFTERSHOCK_COMMANDS"

#: torch.distributed functions the wrapper intercepts, by the name scenarios use.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "gather", "scatter",
)


def send(path: str, command: Mapping[str, Any]) -> None:
    line = (json.dumps(dict(command), separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def commands_path(target: ProcessRef, params: Mapping[str, Any]) -> str:
    path = environ(target.pid).get(COMMANDS_ENV) or params.get("commands")
    if not path:
        raise ValueError(
            f"pid {target.pid} has no {COMMANDS_ENV} in its environment: in-process faults "
            "need a process launched by the harness that calls harness.probe.install()"
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
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            if os.stat(self.path).st_size <= self._offset:
                return []
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except OSError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
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
                elif command.get("op") == "fired" and command.get("rank") == self.rank():
                    # Fired once per rank per run: a restarted process re-reads the file.
                    self.armed.pop(str(command.get("id")), None)

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
        self.emit("fault_injected", kind=command["kind"], fault=params.get("fault"),
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
                kind = command["kind"]
                if not (kind.startswith("memory.") or kind in ("process.hang", "process.kill")):
                    continue
                if not self._mine(command):
                    continue
                params = command["params"]
                if not self._step_ok(params):
                    continue
                if params.get("phase") and params["phase"] != phase:
                    continue
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

    def _poison(self, command: dict[str, Any]) -> None:
        from faults.memory import poison_tensor

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
               kwargs: dict[str, Any]) -> Any:
        with self._lock:
            self.refresh()
            self.calls[op] += 1
            chosen = None
            for command in list(self.armed.values()):
                params = command["params"]
                if not command["kind"].startswith("collective.") or not self._mine(command):
                    continue
                if params.get("op", "all_reduce") not in (op, "any"):
                    continue
                if not self._step_ok(params):
                    continue
                # With a phase, only calls made after that fault point of the step count:
                # `phase: backward` names the gradient all_reduce, not the forward pass's.
                if params.get("phase") and params["phase"] != self.phase:
                    continue
                seen = params.setdefault("_seen", 0) + 1
                params["_seen"] = seen
                if seen >= int(params.get("call", 1)):
                    chosen = command
                    break
        if chosen is None:
            return call(*args, **kwargs)
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
        if kwargs.get("async_op") and result is not None:
            result.wait()
        from faults.memory import poison_tensor

        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, list):
            tensor = tensor[0] if tensor else None
        if tensor is not None:
            poison_tensor(tensor, str(params.get("mode", "nan")), index=params.get("index"),
                          bit=params.get("bit"), seed=int(params.get("seed", 0)))
        return result


def install_collectives(engine: Engine) -> None:
    """Route the torch.distributed collectives through ``engine``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "__aftershock__", False):
            continue

        def wrapper(*args: Any, __op: str = name, __call: Any = original, **kwargs: Any) -> Any:
            return engine.around(__op, __call, args, kwargs)

        wrapper.__aftershock__ = True  # type: ignore[attr-defined]
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = name
        setattr(dist, name, wrapper)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapper)


# ---------------------------------------------------------------- the fault kinds


_OP_HELP = f"which op: {', '.join(COLLECTIVES[:6])}, ... or any; default all_reduce"


class _Collective:
    info: KindInfo
    revertible = False

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        op = params.get("op", "all_reduce")
        if op not in (*COLLECTIVES, "any"):
            raise ValueError(f"unknown collective {op!r} ({_OP_HELP})")
        return arm(self.info.kind, target, params, journal, revertible=self.revertible)

    def revert(self, undo: Mapping[str, Any]) -> None:
        release(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        validate_release(undo, context)


def _collective_info(kind: str, summary: str, extra: dict[str, str]) -> KindInfo:
    return KindInfo(
        kind=kind,
        summary=summary,
        caused_by="the probe's wrapper around torch.distributed's collectives (Gloo and NCCL "
        "alike) acts on the `call`-th matching call of `op` on the target rank, at or after "
        "`at: {step}`; with `at.phase`, only calls made after that fault point of the step "
        "count (`phase: backward`: the gradient all_reduce, not the forward pass's); the "
        "target must call harness.probe.install().",
        params={"op": _OP_HELP, "call": "the k-th matching call after arming, default 1",
                **extra},
        reverted_by="the hang is released" if kind == "collective.hang" else "nothing to undo",
    )


class CollectiveError(_Collective):
    info = _collective_info("collective.error", "The chosen collective call raises, as a "
                            "backend error would (RuntimeError).", {})


class CollectiveHang(_Collective):
    info = _collective_info("collective.hang", "The chosen collective call never returns "
                            "until healed: a wedged communicator.",
                            {"duration": "release after this long; default: at the end"})
    revertible = True


class CollectiveDelay(_Collective):
    info = _collective_info("collective.delay", "The chosen collective call starts late: a "
                            "slow link or a straggling peer, where tc netem is unavailable.",
                            {"delay": "how long, default 1s"})


class CollectiveCorrupt(_Collective):
    info = _collective_info("collective.corrupt", "The chosen collective completes, then its "
                            "result is poisoned on the target rank (silent data corruption).",
                            {"mode": "nan | inf | zero | bitflip, default nan",
                             "index": "element (flat), default seeded", "bit": "for bitflip"})


class ProcessHang:
    """The target's own loop stops at a fault point while the rest of it runs on."""

    info = KindInfo(
        kind="process.hang",
        summary="The target's loop blocks at a fault point (a step and phase) until healed, "
        "while its other threads (heartbeats, sockets) run on: a wedged decode step, a "
        "deadlocked loop, a device call that never returns. Unlike process.freeze, a "
        "heartbeat alone does not see it; progress checks must.",
        caused_by="the probe blocks the thread that calls harness.probe.fault_point() at the "
        "first point matching `at` (`step`, `phase`) after arming; the target must call "
        "harness.probe.install().",
        params={"duration": "release after this long; default: at the end of the run"},
        reverted_by="the blocked thread is released",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        return arm(self.info.kind, target, params, journal, revertible=True)

    def revert(self, undo: Mapping[str, Any]) -> None:
        release(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        validate_release(undo, context)


PROCESS_HANG = register(ProcessHang())
COLLECTIVE_ERROR = register(CollectiveError())
COLLECTIVE_HANG = register(CollectiveHang())
COLLECTIVE_DELAY = register(CollectiveDelay())
COLLECTIVE_CORRUPT = register(CollectiveCorrupt())
