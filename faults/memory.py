"""Memory faults: bit flips, NaN, Inf and zeros, from outside a process or inside it on a tensor.

From outside (``memory.bitflip``, ``memory.nan``, ``memory.inf``, ``memory.zero``)
the engine writes the target's memory through /proc/PID/mem: no cooperation,
no probe, CPU memory only. Give an ``address`` (a tensor's ``data_ptr()``
published by a probe) to hit a known value, or ``region: heap`` to flip seeded
random bits in the process's anonymous writable memory, the way a cosmic ray
or a bad DIMM would. Corruption is the point, so nothing is put back unless
``restore: true``.

Inside a process (the probe's fault points), :func:`poison_tensor` corrupts a
tensor in place on any device, CUDA included. torch is imported there only:
this module must stay importable without torch.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from aftershock.faults import _procmem
from aftershock.faults._errors import FaultUnavailable
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, UndoContext, UndoRefused
from aftershock.faults.params import MAX_INDEX, MAX_SEED, FaultParams
from aftershock.faults.registry import Acts, Applied, KindInfo, register

MemoryTensor = Annotated[str, Field(pattern=r"^(param|grad|optim|[a-z_]+):.+$")]


class _WhereParams(FaultParams):
    """Where in memory: a named tensor (in process) or an address (from outside)."""

    tensor: MemoryTensor | None = Field(
        None,
        description="in process: a named tensor, param:NAME, grad:NAME, "
        "optim:NAME.STATE (globs allowed), in a process that called "
        "aftershock.probe.install(); "
        "poisoned at `at: {step, phase}` (a grad:NAME with no phase: at step N's first point "
        "after `forward`, where its gradient is step N's own)",
    )
    address: int | None = Field(
        None,
        ge=0,
        le=2**64 - 1,
        description="from outside: a virtual address (e.g. a "
        "tensor's data_ptr()), written through /proc/PID/mem",
    )
    index: int | None = Field(
        None, ge=0, le=MAX_INDEX, description="with `tensor` or `address_of`: flat element index"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed for the elements or bits chosen")
    restore: bool = Field(False, description="write the old bytes back when healed")

    @model_validator(mode="after")
    def _where(self) -> _WhereParams:
        region = getattr(self, "region", None)
        address_of = getattr(self, "address_of", None)
        given = [x for x in (self.tensor, self.address, region, address_of) if x is not None]
        if len(given) != 1:
            allowed = (
                "`tensor`, `address`, `address_of` or `region: heap`"
                if "region" in type(self).model_fields
                else "`tensor` or `address`"
            )
            raise ValueError(f"give exactly one of {allowed}")
        return self


class BitflipParams(_WhereParams):
    region: Literal["heap"] | None = Field(
        None,
        description="from outside: seeded random bits in the process's anonymous "
        "writable memory (rw-p mappings, preferring ones of at least `min_region` bytes)",
    )
    address_of: str | None = Field(
        None,
        pattern=r"^param:.+$",
        description="from outside: the address of this CPU parameter (param:NAME, element "
        "`index`), as the probe published it at start-up; written through /proc/PID/mem",
    )
    bit: int | None = Field(
        None,
        ge=0,
        le=63,
        description="the bit, counted from the byte at "
        "the address, little-endian; default: the top exponent bit (30 "
        "for a float32)",
    )
    count: int = Field(1, ge=1, le=1_000_000, description="region: bits to flip")
    min_region: int = Field(
        1 << 20,
        ge=1,
        le=MAX_INDEX,
        description="region: mappings at least this large (bytes) are preferred",
    )


class FillParams(_WhereParams):
    nbytes: int | None = Field(
        None,
        ge=1,
        le=2**30,
        description="with address: bytes to "
        "overwrite, a multiple of the dtype's size; default one element",
    )
    dtype: Literal["float16", "bfloat16", "float32", "float64"] = Field(
        "float32", description="the element type written"
    )


class _Memory:
    """What the memory kinds share: where they act, what they need."""

    acts: Acts = "either"
    inside_when = "with `tensor`"
    needs = frozenset({"memory"})

    def inside(self, params: Any, phase: str | None) -> bool:
        return getattr(params, "tensor", None) is not None

    def needs_for(self, params: Any, phase: str | None) -> frozenset[str]:
        if self.inside(params, phase):
            return frozenset({"probe"})
        if getattr(params, "address_of", None) is not None:
            # The address is what the probe published at start-up.
            return frozenset({"memory", "probe"})
        return frozenset({"memory"})

    def resolve(self, params: Mapping[str, Any], published: Mapping[str, Any]) -> dict[str, Any]:
        """``address_of: param:NAME`` (element ``index``): the address the rank published."""
        if "address_of" not in params:
            return dict(params)
        name = str(params["address_of"])
        if name not in published:
            choices = ", ".join(sorted(published)[:8]) or "none published"
            raise ValueError(
                f"published no address for {name!r} ({choices}); the system "
                "must call aftershock.probe.install(model=...)"
            )
        pointer, numel, size = published[name]
        index = int(params.get("index") or 0)
        if not 0 <= index < numel:
            raise ValueError(f"index {index} is outside {name} ({numel} elements)")
        resolved = {k: v for k, v in params.items() if k not in ("address_of", "index")}
        resolved["address"] = int(pointer) + index * int(size)
        return resolved


# Bit patterns of the special values, little-endian as on every Linux target we run on.
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000, "float64": 0x7FF8 << 48}
_INF = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0 << 48}


def _pattern(dtype: str, value: str) -> bytes:
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_ITEMSIZE)}")
    size = _ITEMSIZE[dtype]
    if value == "zero":
        return bytes(size)
    word = (_NAN if value == "nan" else _INF)[dtype]
    return word.to_bytes(size, "little")


def _write_all(pid: int, writes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Apply ``{"address", "new"}`` writes; returns those that landed."""
    done: list[dict[str, Any]] = []
    for item in writes:
        try:
            _procmem.write(pid, int(item["address"]), bytes.fromhex(item["new"]))
        except OSError:
            continue  # unmapped since we read the maps: nothing was changed there
        done.append(item)
    return done


def _bitflip_writes(pid: int, targets: list[tuple[int, int]]) -> list[dict[str, Any]]:
    writes: list[dict[str, Any]] = []
    for address, bit in targets:
        try:
            old = _procmem.read(pid, address, 1)[0]
        except PermissionError as exc:
            raise _refused(pid, exc) from exc
        except OSError:
            continue  # not mapped (any more): nothing to flip there
        new = old ^ (1 << bit)
        writes.append({"address": address, "bit": bit, "old": f"{old:02x}", "new": f"{new:02x}"})
    return writes


def _refused(pid: int, exc: OSError) -> FaultUnavailable:
    return FaultUnavailable(
        f"cannot access /proc/{pid}/mem ({exc.strerror}): run as root, or with ptrace rights "
        "over the target (same user and kernel.yama.ptrace_scope=0)"
    )


def flip_heap_bits(
    target: ProcessRef, *, count: int, seed: int, min_region: int = 1 << 20
) -> list[dict[str, Any]]:
    """Flip ``count`` seeded random bits in the target's anonymous writable memory.

    Returns what was written (address, bit, old and new byte, in hex).
    """
    chosen = _procmem.choose_bits(_procmem.maps(target.pid), count, seed, min_region=min_region)
    return _write_all(target.pid, _bitflip_writes(target.pid, chosen))


def _restore(undo: Mapping[str, Any]) -> None:
    if not undo.get("restore") or "target" not in undo:
        return
    target = ProcessRef.from_json(dict(undo["target"]))
    if not target.alive():
        return
    for item in reversed(list(undo.get("writes", []))):
        try:
            _procmem.write(target.pid, int(item["address"]), bytes.fromhex(item["old"]))
        except OSError:
            continue


def _validate(undo: Mapping[str, Any], context: UndoContext) -> None:
    """Old bytes go back only into a process of the run."""
    if not undo.get("restore") or "target" not in undo:
        return  # nothing is written on revert
    context.process(undo["target"])
    writes = undo.get("writes", [])
    if not isinstance(writes, list):
        raise UndoRefused("writes is not a list")
    for item in writes:
        address = item["address"]
        if not isinstance(address, int) or isinstance(address, bool) or address < 0:
            raise UndoRefused(f"address {address!r} is not an address")
        bytes.fromhex(item["old"])


def _describe(writes: list[dict[str, Any]], limit: int = 4) -> str:
    shown = ", ".join(f"{w['address']:#x}: {w['old']}->{w['new']}" for w in writes[:limit])
    more = f" (+{len(writes) - limit} more)" if len(writes) > limit else ""
    return shown + more


class BitFlip(_Memory):
    params = BitflipParams
    info = KindInfo(
        kind="memory.bitflip",
        summary="Flip bits in the target's memory through /proc/PID/mem: at an address, or "
        "seeded random bits in its anonymous writable memory (heap, tensor storage).",
        caused_by="DRAM bit flips from radiation, weak cells or row hammer that ECC does not "
        "catch (or that land in non-ECC memory); silent data corruption. Made here with "
        "pwrite(2) on /proc/PID/mem (root, or ptrace rights over the target).",
        reverted_by="nothing by default (corruption is the point); with restore: true the old "
        "bytes are written back if the process still lives.",
    )

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        if params.get("tensor"):
            return _in_process(self.info.kind, target, params, journal)
        p = BitflipParams.bind(params)
        if p.address is not None:
            bit = 30 if p.bit is None else p.bit  # the top exponent bit of a float32
            chosen = [(p.address + bit // 8, bit % 8)]
        else:  # region: heap
            chosen = _procmem.choose_bits(
                _procmem.maps(target.pid), p.count, p.seed, min_region=p.min_region
            )
        writes = _bitflip_writes(target.pid, chosen)
        return _apply(self.info.kind, target, writes, p.restore, journal)

    def revert(self, undo: Mapping[str, Any]) -> None:
        _restore(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate(undo, context)


def _in_process(
    kind: str, target: ProcessRef, params: Mapping[str, Any], journal: Journal
) -> Applied:
    """A named tensor (``param:NAME``, ``grad:NAME``, ``optim:NAME.STATE``, globs allowed)
    is poisoned by the probe inside the target, at the scenario's step and phase."""
    from aftershock.faults import inproc

    return inproc.arm(kind, target, params, journal)


def _apply(
    kind: str, target: ProcessRef, writes: list[dict[str, Any]], restore: bool, journal: Journal
) -> Applied:
    if not target.alive():
        return Applied(kind, None, {}, f"pid {target.pid} is gone: nothing written")
    undo: dict[str, Any] = {"target": target.to_json(), "restore": restore, "writes": writes}
    # Only a restorable write needs healing; the journal gets it before the bytes change.
    entry = journal.intend(kind, undo) if restore and writes else None
    done = _write_all(target.pid, writes)
    undo["writes"] = done
    detail = f"pid {target.pid}: {len(done)} write(s) {_describe(done)}"
    return Applied(kind, entry, undo, detail)


class _Fill(_Memory):
    value = "zero"
    params = FillParams
    info: KindInfo

    def inject(self, target: ProcessRef, params: Mapping[str, Any], journal: Journal) -> Applied:
        if params.get("tensor"):
            return _in_process(self.info.kind, target, params, journal)
        p = FillParams.bind(params)
        assert p.address is not None  # exactly one of tensor and address (FillParams)
        dtype = p.dtype
        pattern = _pattern(dtype, self.value)
        nbytes = len(pattern) if p.nbytes is None else p.nbytes
        if nbytes % len(pattern):
            raise ValueError(f"nbytes must be a positive multiple of {len(pattern)} for {dtype}")
        address = p.address
        try:
            old = _procmem.read(target.pid, address, nbytes)
        except PermissionError as exc:
            raise _refused(target.pid, exc) from exc
        except OSError as exc:
            raise ValueError(f"cannot read {nbytes} bytes at {address:#x}: {exc}") from exc
        new = pattern * (nbytes // len(pattern))
        writes = [{"address": address, "old": old.hex(), "new": new.hex()}]
        return _apply(self.info.kind, target, writes, p.restore, journal)

    def revert(self, undo: Mapping[str, Any]) -> None:
        _restore(undo)

    def validate(self, undo: Mapping[str, Any], context: UndoContext) -> None:
        _validate(undo, context)


def _fill_info(kind: str, what: str, cause: str) -> KindInfo:
    return KindInfo(
        kind=kind,
        summary=f"Write {what} over `nbytes` at `address` in the target through /proc/PID/mem.",
        caused_by=cause,
        reverted_by="nothing by default; with restore: true the old bytes are written back.",
    )


class Nan(_Fill):
    value = "nan"
    info = _fill_info(
        "memory.nan",
        "quiet NaNs",
        "A NaN in weights, gradients or activations: an overflow, a bad kernel, or corruption; "
        "it spreads through every reduction it enters.",
    )


class Inf(_Fill):
    value = "inf"
    info = _fill_info(
        "memory.inf",
        "+Inf",
        "An overflow (fp16 without loss scaling) or an exponent-bit flip; Inf becomes NaN at "
        "the next Inf - Inf or 0 * Inf.",
    )


class Zero(_Fill):
    value = "zero"
    info = _fill_info(
        "memory.zero",
        "zeros",
        "A lost write, a page the kernel or a buggy allocator handed back zeroed, or a "
        "truncated transfer: plausible-looking values that are simply not there.",
    )


# --- in-process: poison a tensor in place --------------------------------------------------

MODES = ("bitflip", "nan", "inf", "zero")


@dataclass(frozen=True, slots=True)
class Poisoned:
    """What :func:`poison_tensor` changed (values as Python numbers, read back after)."""

    mode: str
    indices: tuple[tuple[int, ...], ...]
    before: tuple[Any, ...]
    after: tuple[Any, ...]
    bit: int | None = None


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    position: list[int] = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        position.append(rest)
    return tuple(reversed(position))


def poison_tensor(
    tensor: Any,
    mode: str,
    *,
    index: int | Sequence[int] | None = None,
    bit: int | None = None,
    seed: int = 0,
    count: int = 1,
) -> Poisoned:
    """Corrupt ``tensor`` in place (CPU or CUDA) and say what changed.

    ``index``: a flat index, or one index per dimension; None picks ``count``
    distinct elements with ``seed``. ``bit`` (bitflip only) counts from the least
    significant bit of the element; the default is the element's second-highest
    bit, which for every IEEE format is the top exponent bit (30 for float32,
    14 for float16/bfloat16, 62 for float64): 1.0 becomes Inf.
    """
    import torch

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if tensor.dtype == torch.bool:
        raise ValueError("cannot poison a bool tensor")
    numel = int(tensor.numel())
    if numel == 0:
        raise ValueError("cannot poison an empty tensor")
    positions = _positions(tuple(int(s) for s in tensor.shape), numel, index, seed, count)

    floating = tensor.dtype.is_floating_point or tensor.dtype.is_complex
    if mode in ("nan", "inf") and not floating:
        raise ValueError(f"{mode} needs a floating-point tensor, got {tensor.dtype}")
    used_bit: int | None = None
    ints = None
    mask = 0
    if mode == "bitflip":
        used_bit, ints, mask = _bit_view(tensor, bit)

    before: list[Any] = []
    after: list[Any] = []
    for position in positions:
        element = tensor[position]
        before.append(element.item())
        if mode == "bitflip":
            assert ints is not None
            ints[position].bitwise_xor_(mask)
        elif mode == "nan":
            element.fill_(float("nan"))
        elif mode == "inf":
            element.fill_(float("inf"))
        else:
            element.zero_()
        after.append(tensor[position].item())
    return Poisoned(mode, tuple(positions), tuple(before), tuple(after), used_bit)


def _positions(shape: tuple[int, ...], numel: int, index: int | Sequence[int] | None,
               seed: int, count: int) -> list[tuple[int, ...]]:
    """The elements to poison: ``count`` drawn with ``seed``, or the one ``index`` names."""
    if index is None:
        flats = sorted(random.Random(seed).sample(range(numel), min(max(count, 1), numel)))
        return [_unravel(f, shape) for f in flats]
    if isinstance(index, int):
        if not -numel <= index < numel:
            raise IndexError(f"index {index} is out of range for {numel} elements")
        return [_unravel(index % numel, shape)]
    return [tuple(int(i) for i in index)]


def _bit_view(tensor: Any, bit: int | None) -> tuple[int, Any, int]:
    """The bit a bitflip flips, the tensor viewed as same-size integers, and the xor mask."""
    import torch

    nbits = tensor.element_size() * 8
    used_bit = nbits - 2 if bit is None else int(bit)
    if not 0 <= used_bit < nbits:
        raise ValueError(f"bit {used_bit} is outside a {nbits}-bit {tensor.dtype} element")
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        tensor.element_size()
    ]
    # A same-size dtype view works for any strides: the xor lands in the tensor's storage.
    ints = tensor.view(int_dtype)
    mask = 1 << used_bit
    if used_bit == nbits - 1:
        mask -= 1 << nbits  # the sign bit, as a signed value of the int dtype
    return used_bit, ints, mask


def float32_bits(value: float) -> int:
    """The IEEE-754 bits of a float32, for checks and reports."""
    return int.from_bytes(struct.pack("<f", value), "little")


BITFLIP = register(BitFlip())
NAN = register(Nan())
INF = register(Inf())
ZERO = register(Zero())
