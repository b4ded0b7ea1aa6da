"""Another process's memory through /proc/PID/maps and /proc/PID/mem.

As root (or with ptrace access to the target) the kernel lets us read and write
any mapped page of a running process, even read-only ones (FOLL_FORCE), without
stopping it. That is how a bit flip in a tensor is made "from outside", with no
cooperation from the process.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Region:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str  # e.g. "rw-p"
    offset: int
    inode: int
    path: str  # "" for anonymous, "[heap]", "[stack]", a file, "[anon:name]"

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def anonymous(self) -> bool:
        return self.inode == 0 and (self.path in ("", "[heap]") or self.path.startswith("[anon"))


def parse_maps(text: str) -> list[Region]:
    regions: list[Region] = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        regions.append(
            Region(
                start=start,
                end=end,
                perms=parts[1],
                offset=int(parts[2], 16),
                inode=int(parts[4]),
                path=parts[5].strip() if len(parts) > 5 else "",
            )
        )
    return regions


def maps(pid: int) -> list[Region]:
    with open(f"/proc/{pid}/maps") as handle:
        return parse_maps(handle.read())


def writable_anonymous(regions: list[Region]) -> list[Region]:
    """Private writable anonymous regions: the heap and mmap'd arenas, where data lives.

    Stacks, vdso/vvar and file mappings (code, libraries, .data of .so files) are left
    out: flipping bits there tests the loader, not the system under test.
    """
    return [r for r in regions if r.perms == "rw-p" and r.anonymous and r.size > 0]


def choose_bits(
    regions: list[Region], count: int, seed: int, *, min_region: int = 1 << 20
) -> list[tuple[int, int]]:
    """``count`` distinct (address, bit) pairs, uniform over the bytes of the candidate regions.

    Regions of at least ``min_region`` bytes are preferred when there are any:
    large tensors (and the caching allocators' pools) live in big anonymous
    mappings, while the small ones hold interpreter state. The choice depends on
    the regions and the seed only, so a replay with the same seed hits the same
    offsets.
    """
    candidates = writable_anonymous(regions)
    large = [r for r in candidates if r.size >= min_region]
    pool = sorted(large or candidates, key=lambda r: r.start)
    total = sum(r.size for r in pool)
    if total == 0 or count <= 0:
        return []
    rng = random.Random(seed)
    chosen: list[tuple[int, int]] = []
    seen: set[int] = set()
    while len(chosen) < min(count, total):
        flat = rng.randrange(total)
        if flat in seen:
            continue
        seen.add(flat)
        for region in pool:
            if flat < region.size:
                chosen.append((region.start + flat, rng.randrange(8)))
                break
            flat -= region.size
    return chosen


def read(pid: int, address: int, size: int) -> bytes:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        data = os.pread(fd, size, address)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(f"short read of {size} bytes at {address:#x} in pid {pid}")
    return data


def write(pid: int, address: int, data: bytes) -> None:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        written = os.pwrite(fd, data, address)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"short write of {len(data)} bytes at {address:#x} in pid {pid}")
