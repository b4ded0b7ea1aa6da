"""Memory faults through /proc/PID/mem on real processes, and poison_tensor in process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aftershock.faults import _procmem
from aftershock.faults._proc import ProcessRef
from aftershock.faults.journal import Journal, pending
from aftershock.faults.memory import BITFLIP, INF, NAN, ZERO, flip_heap_bits, poison_tensor
from aftershock.faults.registry import get

torch = pytest.importorskip("torch")

# A child that allocates a float32 tensor of ones, publishes its address, then prints
# the tensor every time it reads a line: a probe's view of its own memory.
CHILD = textwrap.dedent(
    """
    import json, sys, torch
    t = torch.ones(1024, dtype=torch.float32)
    print(json.dumps({"ptr": t.data_ptr()}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"head": [repr(v) for v in t[:4].tolist()],
                          "sum_rest": t[4:].sum().item()}), flush=True)
    """
)


def _need_proc_mem() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (or ptrace rights) to write /proc/PID/mem")


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], ProcessRef, int]]:
    _need_proc_mem()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ptr = int(json.loads(proc.stdout.readline())["ptr"])
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        yield proc, ref, ptr
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes both pipes


def _look(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    return dict(json.loads(proc.stdout.readline()))


@pytest.mark.timeout(60)
def test_kinds_are_registered() -> None:
    for kind, obj in (
        ("memory.bitflip", BITFLIP),
        ("memory.nan", NAN),
        ("memory.inf", INF),
        ("memory.zero", ZERO),
    ):
        assert get(kind) is obj


@pytest.mark.timeout(60)
def test_bitflip_at_a_tensor_address_turns_one_into_inf(
    child: tuple[subprocess.Popen[str], ProcessRef, int], tmp_path: Path
) -> None:
    proc, ref, ptr = child
    assert _look(proc)["head"] == ["1.0", "1.0", "1.0", "1.0"]
    journal = Journal.create("flip", tmp_path / "journal")
    applied = BITFLIP.inject(ref, {"address": ptr, "bit": 30}, journal)
    # 1.0f is 0x3f800000; bit 30 is in byte 3 (little-endian): 0x3f ^ 0x40 = 0x7f -> 0x7f800000.
    assert applied.undo["writes"] == [{"address": ptr + 3, "bit": 6, "old": "3f", "new": "7f"}]
    assert applied.journal_id is None  # not restorable: nothing to heal
    seen = _look(proc)
    assert seen["head"] == ["inf", "1.0", "1.0", "1.0"]
    assert seen["sum_rest"] == 1020.0
    BITFLIP.revert(applied.undo)  # by design not reverted
    assert _look(proc)["head"][0] == "inf"  # type: ignore[index]


@pytest.mark.timeout(60)
def test_restorable_flip_is_journaled_and_put_back(
    child: tuple[subprocess.Popen[str], ProcessRef, int], tmp_path: Path
) -> None:
    proc, ref, ptr = child
    journal = Journal.create("restore", tmp_path / "journal")
    applied = BITFLIP.inject(ref, {"address": ptr + 4, "bit": 31, "restore": True}, journal)
    assert _look(proc)["head"] == ["1.0", "-1.0", "1.0", "1.0"]
    assert [p.kind for p in pending(journal.path)] == ["memory.bitflip"]
    BITFLIP.revert(applied.undo)
    BITFLIP.revert(applied.undo)
    assert _look(proc)["head"] == ["1.0", "1.0", "1.0", "1.0"]


@pytest.mark.timeout(60)
def test_nan_and_zero_fill_elements(
    child: tuple[subprocess.Popen[str], ProcessRef, int], tmp_path: Path
) -> None:
    proc, ref, ptr = child
    journal = Journal.create("fill", tmp_path / "journal")
    NAN.inject(ref, {"address": ptr, "nbytes": 8}, journal)
    ZERO.inject(ref, {"address": ptr + 8, "dtype": "float32"}, journal)
    applied = INF.inject(ref, {"address": ptr + 12, "restore": True}, journal)
    assert _look(proc)["head"] == ["nan", "nan", "0.0", "inf"]
    INF.revert(applied.undo)
    assert _look(proc)["head"] == ["nan", "nan", "0.0", "1.0"]
    with pytest.raises(ValueError, match="multiple of 4"):
        NAN.inject(ref, {"address": ptr, "nbytes": 6}, journal)


@pytest.mark.timeout(60)
def test_heap_flips_are_seeded_and_survivable(tmp_path: Path) -> None:
    _need_proc_mem()
    # A plain torch process with a big tensor: the kind of memory region: heap aims at.
    code = "import torch, time; t = torch.ones(1 << 20); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "up"
        ref = ProcessRef.of(proc.pid)
        assert ref is not None
        regions = _procmem.maps(proc.pid)
        first = _procmem.choose_bits(regions, 8, seed=7)
        assert first == _procmem.choose_bits(regions, 8, seed=7)
        assert first != _procmem.choose_bits(regions, 8, seed=8)
        assert len({address for address, _ in first}) == 8
        large = [r for r in _procmem.writable_anonymous(regions) if r.size >= 1 << 20]
        assert large, "a 4 MiB tensor lives in a large anonymous mapping"
        assert all(any(r.start <= a < r.end for r in large) for a, _ in first)

        journal = Journal.create("heap", tmp_path / "journal")
        applied = BITFLIP.inject(ref, {"region": "heap", "count": 8, "seed": 7}, journal)
        writes = applied.undo["writes"]
        assert 0 < len(writes) <= 8
        for item in writes:
            assert int(item["old"], 16) ^ int(item["new"], 16) == 1 << item["bit"]
        # The same maps and seed pick the same offsets as the pure function did.
        assert [(w["address"], w["bit"]) for w in writes] == [
            (a, b) for a, b in first if any(w["address"] == a for w in writes)
        ]
        more = flip_heap_bits(ref, count=4, seed=1)
        assert all(set(item) == {"address", "bit", "old", "new"} for item in more)
        time.sleep(0.1)  # the child may crash from this; the test must not
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.timeout(60)
def test_parse_maps_keeps_anonymous_rw_regions_only() -> None:
    text = textwrap.dedent(
        """\
        55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
        7f0000000000-7f0000400000 rw-p 00000000 00:00 0
        7f0000400000-7f0000401000 ---p 00000000 00:00 0
        7f1000000000-7f1000002000 rw-p 0001c000 08:01 131      /usr/lib/libc.so.6
        7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
        7f2000000000-7f2000001000 rw-p 00000000 00:00 0          [anon:some name]
        """
    )
    picked = _procmem.writable_anonymous(_procmem.parse_maps(text))
    assert [r.path for r in picked] == ["[heap]", "", "[anon:some name]"]
    chosen = _procmem.choose_bits(_procmem.parse_maps(text), 3, seed=0)
    assert all(0x7F0000000000 <= a < 0x7F0000400000 for a, _ in chosen)  # the large one


# --- poison_tensor ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_poison_tensor_bitflip_float32_one_becomes_inf() -> None:
    t = torch.ones(8)
    result = poison_tensor(t, "bitflip", index=3)
    assert result.bit == 30
    assert result.indices == ((3,),)
    assert result.before == (1.0,)
    assert math.isinf(t[3].item())
    assert t[3].item() > 0
    assert torch.equal(t[torch.arange(8) != 3], torch.ones(7))
    poison_tensor(t, "bitflip", index=3)  # the same flip again undoes it
    assert torch.equal(t, torch.ones(8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_poison_tensor_bitflip_top_exponent_bit_per_dtype(dtype: object) -> None:
    t = torch.ones(4, dtype=dtype)  # type: ignore[call-overload]
    poison_tensor(t, "bitflip", index=0)
    assert math.isinf(t[0].item())


@pytest.mark.timeout(60)
def test_poison_tensor_sign_bit_and_integers() -> None:
    t = torch.ones(2, 3)
    poison_tensor(t, "bitflip", index=(1, 2), bit=31)
    assert t[1, 2].item() == -1.0
    ints = torch.zeros(4, dtype=torch.int32)
    poison_tensor(ints, "bitflip", index=1, bit=31)
    assert ints[1].item() == -(2**31)
    with pytest.raises(ValueError, match="floating-point"):
        poison_tensor(ints, "nan")
    with pytest.raises(ValueError, match="outside"):
        poison_tensor(torch.ones(2, dtype=torch.float16), "bitflip", bit=30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "check"), [("nan", math.isnan), ("inf", math.isinf)])
def test_poison_tensor_nan_inf(mode: str, check: object) -> None:
    t = torch.ones(100)
    result = poison_tensor(t, mode, seed=5, count=3)
    assert len(result.indices) == 3
    assert all(check(v) for v in result.after)  # type: ignore[operator]
    assert int((~torch.isfinite(t)).sum()) == 3
    again = torch.ones(100)
    assert poison_tensor(again, mode, seed=5, count=3).indices == result.indices


@pytest.mark.timeout(60)
def test_poison_tensor_zero_on_a_non_contiguous_view() -> None:
    base = torch.ones(4, 4)
    view = base.t()[1:]  # non-contiguous: writes must land in base's storage
    poison_tensor(view, "zero", index=(0, 2))
    assert base[2, 1].item() == 0.0
    assert int((base == 0).sum()) == 1
    poison_tensor(view, "bitflip", index=(1, 0))
    assert math.isinf(base[0, 2].item())
    with pytest.raises(ValueError, match="mode"):
        poison_tensor(base, "melt")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_poison_tensor_on_cuda() -> None:
    t = torch.ones(16, device="cuda")
    poison_tensor(t, "bitflip", index=0)
    poison_tensor(t, "nan", index=1)
    poison_tensor(t, "zero", index=2)
    host = t.cpu()
    assert math.isinf(host[0].item())
    assert math.isnan(host[1].item())
    assert host[2].item() == 0.0
