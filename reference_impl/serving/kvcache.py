"""Paged KV cache: a block pool, per-sequence block tables, a checksummed prefix cache.

The pool is one tensor ``kv[num_blocks, n_layer, 2, n_head, block_size, head_dim]``; a
sequence's KV lives in the blocks its table lists, position ``p`` in block ``table[p // B]``
at slot ``p % B``. Blocks are reference counted: a block of a shared prompt prefix is held
by every sequence that reads it.

Prefix cache. A *full* block is named by a chained hash, ``h_0 = H(model_id, tokens of
block 0)`` and ``h_i = H(h_{i-1}, tokens of block i)``: a block's name covers every token
before it (its KV depends on all of them) and the weights, so the same 16 tokens after a
different prefix, or under another model, are a different block. When its last sequence
releases it, a cached block stays in the pool, evictable, until the pool runs out of free
blocks; then the least recently used one is reused. Sequences release their blocks last to
first, so a chain's tail is evicted before its head (the head is what more prompts share).

Checksums. When a block fills ("sealed") the cache stores a checksum of its bytes: the
wrapping int64 sum of the block viewed as 64-bit words. A flipped bit ``k`` of a word changes
that sum by ``±2**k``, never ``0 mod 2**64``, so every single-bit flip (indeed any change
confined to one word) is caught, at the cost of one read of the block. It is not a CRC:
two compensating changes in different words could cancel. A mismatch means the block cannot
be trusted, nor can any block whose chain passes through it (its KV may have been computed
from the bad one), so :meth:`PagedKVCache.discard` removes all of them from the cache.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from aftershock.reference_impl.serving.model import ModelConfig, model_id

_GAP = 8  # blocks between two checksum runs that are summed through rather than skipped
_MAX_SPANS = 32  # more runs than this: gather the blocks instead


def chain_hashes(model: str, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Prefix-cache names of the full blocks of ``tokens`` under the model named ``model``."""
    hashes: list[bytes] = []
    parent = model.encode()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _chain(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class PagedKVCache:
    """The block pool of one engine. Single-threaded, like the engine that owns it."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        checksums: bool = True,
    ) -> None:
        self.model_id = model_id(model)
        self.checksums = checksums  # False: seal without computing (nothing will verify)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(
            num_blocks, model.n_layer, 2, model.n_head, block_size, model.head_dim,
            dtype=torch.float32, device=device,
        )  # fmt: skip
        # The same memory as 64-bit words, one row per block: what checksums read.
        self._words = self.kv.view(num_blocks, -1).view(torch.int64)
        self._checksum = [0] * num_blocks  # each sealed block's sum, as a Python integer
        self._sealed = [False] * num_blocks
        self._ref = [0] * num_blocks
        self._hits = [0] * num_blocks  # prefix-cache hits on a block since it was last handed out
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        # Cached blocks that nobody holds, least recently released first: the evictable ones.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # chain hash -> block
        self._name: list[bytes | None] = [None] * num_blocks  # block -> its hash, while cached
        # The chain links, for every cached name and every name that leads to one: what
        # `discard` walks to find the descendants of a bad block.
        self._parent: dict[bytes, bytes | None] = {}  # name -> the name before it
        self._children: dict[bytes, set[bytes]] = {}  # name -> names right after it
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # a sequence's chain, as far as it is sealed
        self.lru_evictions = 0  # cached blocks reused for something else (pool pressure)
        # CPU of the calling thread in checksums (sealing, verifying), in ns: what they cost.
        self.checksum_ns = 0

    # -- block tables --------------------------------------------------------------------

    def table(self, seq: str) -> list[int]:
        """The sequence's block ids (a live list: do not modify it)."""
        return self._tables.setdefault(seq, [])

    def available(self) -> int:
        """Blocks that can be handed out now: free ones and evictable cached ones."""
        return len(self._free) + len(self._lru)

    def idle(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` nobody holds (adopting them takes them out of ``available``)."""
        return sum(1 for block in blocks if self._ref[block] == 0)

    def extend(self, seq: str) -> bool:
        """Append a zeroed block to ``seq``'s table; False if the pool is exhausted."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self._uncache(block)
            self._sealed[block] = False
            self.lru_evictions += 1
        else:
            return False
        # Zeroed so that the unwritten slots of a partly filled block, which attention reads
        # and masks, hold finite values (0 * NaN would leak through the mask).
        self.kv[block].zero_()
        self._ref[block] = 1
        self._hits[block] = 0
        self.table(seq).append(block)
        return True

    def adopt(self, seq: str, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Start ``seq``'s (empty) table with cached ``blocks`` named ``hashes`` (prefix hits)."""
        table = self.table(seq)
        assert not table, f"{seq} already holds blocks"
        for block in blocks:
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1
            self._hits[block] += 1
        table.extend(blocks)
        self._hashes[seq] = list(hashes[: len(blocks)])

    def truncate(self, seq: str, keep: int) -> None:
        """Release ``seq``'s blocks from index ``keep`` on (its KV from ``keep * B`` on)."""
        table = self.table(seq)
        self._release(table[keep:])
        del table[keep:]
        hashes = self._hashes.get(seq)
        if hashes is not None:
            del hashes[keep:]

    def free(self, seq: str) -> None:
        """Release every block of ``seq`` and forget its table."""
        self.truncate(seq, 0)
        del self._tables[seq]
        self._hashes.pop(seq, None)

    def _release(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):  # the tail first: evicted before the head it extends
            self._ref[block] -= 1
            if self._ref[block]:
                continue
            if self._name[block] is not None:
                self._lru[block] = None
            else:
                self._sealed[block] = False
                self._free.append(block)

    def holders(self, block: int) -> list[str]:
        """Sequences whose table holds ``block``."""
        return [seq for seq, table in self._tables.items() if block in table]

    # -- prefix cache ----------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of the chain ``hashes``."""
        blocks = []
        for name in hashes:
            block = self._cached.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def seal(self, items: Iterable[tuple[str, Sequence[int], int]]) -> list[int]:
        """Seal the blocks that ``(seq, tokens, computed)`` filled; return them.

        ``computed`` is how many leading positions of ``tokens`` have their KV in the pool.
        Each newly full block gets a checksum and, unless an identical chain is cached
        already, a prefix-cache entry.
        """
        fresh: list[int] = []
        size = self.block_size
        for seq, tokens, computed in items:
            table = self._tables[seq]
            hashes = self._hashes.setdefault(seq, [])
            parent = hashes[-1] if hashes else self.model_id.encode()
            for i in range(len(hashes), computed // size):
                name = _chain(parent, tokens[i * size : (i + 1) * size])
                hashes.append(name)
                block = table[i]
                if not self._sealed[block]:
                    fresh.append(block)
                if name not in self._cached:
                    self._cached[name] = block
                    self._name[block] = name
                    self._parent[name] = parent if i else None
                    if i:
                        self._children.setdefault(parent, set()).add(name)
                parent = name
        if fresh and self.checksums:
            began = time.thread_time_ns()
            fresh.sort()
            for block, checksum in zip(fresh, self._sums(fresh), strict=True):
                self._checksum[block] = checksum
            self.checksum_ns += time.thread_time_ns() - began
        for block in fresh:
            self._sealed[block] = True
        return fresh

    def verify(self, blocks: Iterable[int]) -> list[int]:
        """Those of ``blocks`` (the sealed ones) whose bytes no longer match their checksum."""
        if not self.checksums:
            return []
        began = time.thread_time_ns()
        sealed = sorted({b for b in blocks if self._sealed[b]})
        checksum = self._checksum
        bad = [b for b, got in zip(sealed, self._sums(sealed), strict=True)
               if got != checksum[b]] if sealed else []
        self.checksum_ns += time.thread_time_ns() - began
        return bad

    def _sums(self, blocks: Sequence[int]) -> list[int]:
        """Checksums of ``blocks`` (sorted, distinct), in that order.

        Runs of nearby blocks are summed where they lie instead of being gathered first (a
        gather writes every byte once more: it made verification 3x slower); a gap of a few
        blocks is summed through, cheaper than one more call. A pool too fragmented for
        that is gathered. The sums come back as Python integers, compared with the stored
        ones in Python: a tensor per step for the comparison cost more than the sums
        (bench/results/serving-notes-2026-12.md).
        """
        spans: list[tuple[int, int]] = []
        for block in blocks:
            if spans and block - spans[-1][1] < _GAP:
                spans[-1] = (spans[-1][0], block + 1)
            else:
                spans.append((block, block + 1))
        if len(spans) > _MAX_SPANS:
            index = torch.tensor(blocks, device=self.kv.device)
            sums: list[int] = torch.index_select(self._words, 0, index).sum(dim=1).tolist()
            return sums
        out: list[int] = []
        i, n = 0, len(blocks)
        for lo, hi in spans:
            rows = self._words[lo:hi].sum(dim=1).tolist()
            while i < n and blocks[i] < hi:
                out.append(rows[blocks[i] - lo])
                i += 1
        return out

    def discard(self, block: int) -> list[int]:
        """Take a corrupt ``block`` and every cached block chained after it out of the cache.

        Returns the cached blocks removed (the bad one first, if it was cached). Unheld ones
        go back to the free list; held ones are freed when their holders release them. The bad
        block is no longer trusted even while held: it stops being sealed.
        """
        self._sealed[block] = False
        name = self._name[block]
        if name is None:
            return []
        removed = []
        stack = [name]
        while stack:
            current = stack.pop()
            stack.extend(self._children.get(current, ()))
            cached = self._cached.get(current)
            if cached is None:
                continue
            removed.append(cached)
            self._uncache(cached)
            if cached in self._lru:
                del self._lru[cached]
                self._sealed[cached] = False
                self._free.append(cached)
        return removed

    def _uncache(self, block: int) -> None:
        name = self._name[block]
        if name is None:
            return
        self._name[block] = None
        del self._cached[name]
        # Its cached descendants stay cached (reachable again once this chain is recomputed)
        # and stay linked through it, so that discarding an ancestor still reaches them. The
        # links of names that lead to no cached block are dropped, walking up the chain.
        current: bytes | None = name
        while current is not None and current not in self._cached:
            if self._children.get(current):
                break
            self._children.pop(current, None)
            parent = self._parent.pop(current, None)
            if parent is not None and parent in self._children:
                self._children[parent].discard(current)
            current = parent

    def most_shared(self) -> int | None:
        """The sealed cached block held by the most sequences (>= 2; ties: lowest id)."""
        best: int | None = None
        for block in self._cached.values():
            refs = self._ref[block]
            if refs < 2 or not self._sealed[block]:
                continue
            if best is None or (refs, -block) > (self._ref[best], -best):
                best = block
        return best

    def most_hit_idle(self) -> int | None:
        """The sealed cached block that no sequence holds and that the most prefix-cache hits
        went to (>= 1; ties: the most recently released). Such a block is read again only
        by a new request's hit, so only hit verification can catch it going bad."""
        best: int | None = None
        for block in self._lru:  # least recently released first: a later tie wins
            if self._sealed[block] and self._hits[block] and (
                    best is None or self._hits[block] >= self._hits[best]):
                best = block
        return best

    def is_sealed(self, block: int) -> bool:
        return self._sealed[block]
