"""The reference server's model: a small byte-level GPT whose forward pass reads a paged KV pool.

Weights are drawn from a seeded generator, so every worker built from the same
:class:`ModelConfig` holds bitwise the same model (nothing is downloaded). Tokens are bytes:
``encode`` is UTF-8, ``decode`` is latin-1 so that every token maps to exactly one character
(a stream can be cut between any two tokens and still be shown).

Two forward passes share the weights:

- :meth:`GPT.forward_tiles`, the batch-invariant kernel. It computes *tiles*: tile ``k`` of
  a sequence is its positions ``[k*T, (k+1)*T)`` (``T`` the tile height, which divides the KV
  block size), always computed as ``T`` rows (unused rows are padding), the token at
  position ``p`` always in row ``p % T``, attending over the blocks that cover ``[0,
  (k+1)*T)``. Every matmul, layer norm, softmax and GELU runs on one tile at a time with
  shapes that depend on ``k`` only (only the embedding gathers and their sum, which are
  exact, run on all tiles at once), and no row of those ops depends on another row's values.
  So a token's KV and logits are a function of its token, its position and the KV before it:
  never of the batch it runs in, nor of whether it is computed in a prefill, in a decode
  step, after a preemption or after a migration. The price: small calls, one per tile and
  op, and padding rows in decode steps.
- :meth:`GPT.forward_batched`, what throughput-minded servers do: the rows of every sequence
  of the step go through one matmul per layer whose reduction is split in a number of chunks
  chosen from the row count (split-K, as GPU GEMM heuristics pick it). The order of the float
  additions then depends on how many rows the step has, so a request's logits (and sometimes
  its tokens) depend on which other requests share its batch.

The KV pool layout, shared with :mod:`aftershock.reference_impl.serving.kvcache`, is
``[num_blocks, n_layer, 2 (K, V), n_head, block_size, head_dim]``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Bump when the architecture or the initialisation changes: a model id must never name two
# different sets of weights, or two workers could share prefix-cache blocks they should not.
_ARCH_VERSION = 1


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # byte-level tokens: every UTF-8 byte is one token
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads per block; head_dim = d_model // n_head
    d_model: int = 128  # width of the residual stream
    max_seq: int = 1024  # longest sequence (prompt + generated) the position table covers
    seed: int = 0  # seed of the weight generator: same seed, bitwise the same weights

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        for name in ("vocab", "n_layer", "n_head", "d_model", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def model_id(config: ModelConfig) -> str:
    """A short hex name of the weights (config and seed). Prefix-cache keys start from it."""
    text = repr((_ARCH_VERSION, sorted(asdict(config).items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(text: str) -> list[int]:
    """Text to tokens: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    """Tokens to text, one character per token (latin-1), whatever the byte sequence."""
    return bytes(tokens).decode("latin-1")


@dataclass(frozen=True, slots=True)
class Tile:
    """One tile of one sequence, for :meth:`GPT.forward_tiles`."""

    table: Sequence[int]  # the sequence's block ids
    index: int  # tile k: positions [k * height, (k+1) * height)
    tokens: Sequence[int]  # tokens of the computed rows, lo .. lo + len(tokens)
    lo: int  # first computed row; the rows before it are in the KV pool already
    logits: bool  # whether to return the tile's logits


@dataclass(frozen=True, slots=True)
class _TilePlan:
    rows: slice  # the computed rows of the tile
    new_kv: torch.Tensor  # [n_layer, 2, H, rows, hd]: where the rows' K/V go in the pool
    current: torch.Tensor  # [n_layer, 2, H, B, hd]: the block the tile lies in
    past: slice | None  # where the ids of the blocks it attends to are, if more than one
    mask: torch.Tensor  # [height, keys] additive causal mask


@dataclass(frozen=True, slots=True)
class Segment:
    """The rows one sequence computes in a batched step: positions ``[start, start + len)``."""

    table: Sequence[int]  # block ids of the sequence, covering at least the new positions
    start: int  # first position computed (the KV of positions < start is in the pool)
    tokens: Sequence[int]  # tokens at the new positions


class Block(nn.Module):
    """Pre-LN transformer block; the attention is done by the GPT's paged forward passes."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)


def _split_k_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` with its reduction split into chunks chosen from the row count.

    Few rows leave a GPU's SMs idle, so GEMM heuristics split K to get more tiles; the
    partial products are then summed in a different order than an unsplit GEMM sums them.
    Mimicking that is what makes this path's results depend on the batch.
    """
    rows, k = x.shape
    splits = 8 if rows <= 2 else 4 if rows <= 8 else 2 if rows <= 32 else 1
    if splits == 1:
        return F.linear(x, layer.weight, layer.bias)
    size = k // splits
    out = F.linear(x[:, :size], layer.weight[:, :size], layer.bias)
    for i in range(1, splits):
        part = slice(i * size, (i + 1) * size)
        out = out + F.linear(x[:, part], layer.weight[:, part])
    return out


@dataclass(frozen=True, slots=True)
class _LayerParams:
    ln_1_w: torch.Tensor
    ln_1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    ln_2_w: torch.Tensor
    ln_2_b: torch.Tensor
    fc_w: torch.Tensor
    fc_b: torch.Tensor
    mlp_w: torch.Tensor
    mlp_b: torch.Tensor

    @staticmethod
    def of(blk: nn.Module) -> _LayerParams:
        assert isinstance(blk, Block)
        return _LayerParams(
            blk.ln_1.weight, blk.ln_1.bias, blk.qkv.weight, blk.qkv.bias,
            blk.attn_proj.weight, blk.attn_proj.bias, blk.ln_2.weight, blk.ln_2.bias,
            blk.fc.weight, blk.fc.bias, blk.mlp_proj.weight, blk.mlp_proj.bias,
        )  # fmt: skip


class GPT(nn.Module):
    """Byte-level pre-LN decoder with learned positions; untrained, seeded weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.max_seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c.d_model) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        self._init_weights()
        # The parameters of each block, looked up once: nn.Module attribute access is slow
        # next to these small kernels. They stay valid across ``.to(device)`` (which swaps a
        # parameter's data, not the object) and see faults that change weights in place.
        self._params = [_LayerParams.of(blk) for blk in self.blocks]
        # Serving never trains; without autograd the kernels skip the graph bookkeeping.
        self.requires_grad_(False)
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Drawn on the CPU, in module-name order, from one generator: the same seed gives the
        # same bits on any device (device generators do not promise the same stream). Unit
        # scale per layer (std 1/sqrt(fan_in)) rather than GPT-2's 0.02: an untrained model
        # with tiny weights just repeats its last token; this one's output depends on the
        # whole context, so a wrong KV value shows in the tokens.
        generator = torch.Generator().manual_seed(self.config.seed)
        for _, module in sorted(self.named_modules(), key=lambda item: item[0]):
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
            elif isinstance(module, nn.Linear):
                std = module.in_features**-0.5
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if module.bias is not None:
                    module.bias.zero_()

    def _causal_mask(self, size: int, device: torch.device) -> torch.Tensor:
        """Additive causal mask over every position, rounded up to whole blocks of ``size``."""
        n = -(-self.config.max_seq // size) * size
        mask = self._masks.get((n, device))
        if mask is None:
            mask = torch.full((n, n), float("-inf"), device=device).triu(1)
            self._masks[(n, device)] = mask
        return mask

    def forward_tiles(
        self, kv: torch.Tensor, tiles: Sequence[Tile], height: int
    ) -> list[torch.Tensor | None]:
        """Compute ``tiles`` (of any sequences); return each one's logits if it asked for them.

        The batch-invariant kernel. Tile ``k`` of a sequence is its positions ``[k*height,
        (k+1)*height)``, always computed as ``height`` rows (rows outside the computed ones
        are padding) and attending over the blocks that cover positions ``[0,
        (k+1)*height)``: every shape depends on ``k`` only, and every op is applied to each
        tile separately. ``height`` divides the block size, so a tile lies in one block.
        Writes the new K/V to the pool; the KV of the positions before a tile's first
        computed row must be there already or come from an earlier tile of ``tiles``.
        Logits are ``[height, vocab]``, one row per position of the tile.
        """
        c = self.config
        size = kv.shape[4]
        heads, hd, d = c.n_head, c.head_dim, c.d_model
        device = kv.device
        scale = hd**-0.5
        causal = self._causal_mask(size, device)
        ids: list[int] = []
        positions: list[int] = []
        past_ids: list[int] = []
        plans = []
        for t in tiles:
            first = t.index * height  # position of row 0
            hi = t.lo + len(t.tokens)
            # Padding rows hold token 0 at their own position (clamped to the table): finite,
            # and never written to the pool.
            ids += [0] * t.lo + list(t.tokens) + [0] * (height - hi)
            positions += [min(first + row, c.max_seq - 1) for row in range(height)]
            n_blocks = (first + height - 1) // size + 1
            current = kv[t.table[first // size]]  # [n_layer, 2, H, B, hd]
            offset = first % size
            past = None
            if n_blocks > 1:
                past = slice(len(past_ids), len(past_ids) + n_blocks)
                past_ids += t.table[:n_blocks]
            plans.append(
                _TilePlan(
                    rows=slice(t.lo, hi),
                    new_kv=current.narrow(3, offset + t.lo, hi - t.lo),
                    current=current,
                    past=past,
                    # Keys past a row's position are masked: later slots of the current block
                    # hold zeros (blocks are zeroed when allocated) or this tile's later rows.
                    mask=causal[first : first + height, : n_blocks * size],
                )
            )
        # Gathers and one elementwise add for all tiles at once: exact, so no tile's values
        # depend on the others.
        tok = torch.embedding(self.wte.weight, torch.tensor(ids, device=device))
        pos = torch.embedding(self.wpe.weight, torch.tensor(positions, device=device))
        xs = list((tok + pos).view(len(tiles), height, d).unbind(0))
        blocks = torch.tensor(past_ids, dtype=torch.long, device=device)
        # Op by op across the tiles rather than tile by tile: each weight matrix then stays in
        # cache while every tile uses it. A tile's arithmetic is the same either way.
        for layer, p in enumerate(self._params):
            hs = [torch.layer_norm(x, (d,), p.ln_1_w, p.ln_1_b) for x in xs]
            qkvs = [F.linear(h, p.qkv_w, p.qkv_b) for h in hs]
            atts = []
            for qkv, plan in zip(qkvs, plans, strict=True):  # in order: tiles read earlier KV
                qkv = qkv.view(height, 3, heads, hd).permute(1, 2, 0, 3)  # [3, H, T, hd]
                plan.new_kv[layer].copy_(qkv[1:, :, plan.rows])
                if plan.past is None:
                    keys, values = plan.current[layer]
                else:
                    attended = blocks[plan.past]
                    both = kv.select(1, layer).index_select(0, attended)  # [n, 2, H, B, hd]
                    span = len(attended) * size
                    keys, values = both.permute(1, 2, 0, 3, 4).reshape(2, heads, span, hd)
                scores = torch.baddbmm(plan.mask, qkv[0], keys.transpose(1, 2), alpha=scale)
                att = torch.bmm(scores.softmax(dim=-1), values)
                atts.append(att.transpose(0, 1).reshape(height, d))
            xs = [x + F.linear(a, p.proj_w, p.proj_b) for x, a in zip(xs, atts, strict=True)]
            hs = [torch.layer_norm(x, (d,), p.ln_2_w, p.ln_2_b) for x in xs]
            hs = [F.gelu(F.linear(h, p.fc_w, p.fc_b)) for h in hs]
            xs = [x + F.linear(h, p.mlp_w, p.mlp_b) for x, h in zip(xs, hs, strict=True)]
        out: list[torch.Tensor | None] = []
        for x, t in zip(xs, tiles, strict=True):
            if t.logits:
                x = torch.layer_norm(x, (d,), self.ln_f.weight, self.ln_f.bias)
                out.append(F.linear(x, self.lm_head.weight))
            else:
                out.append(None)
        return out

    def forward_batched(self, kv: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """Compute every segment's new rows together; return ``[len(segments), vocab]`` logits
        of each segment's last row.

        Not batch-invariant (see the module docstring): the linear layers see all rows of
        the step at once and split their reduction by the row count.
        """
        c = self.config
        size = kv.shape[4]
        heads, hd = c.n_head, c.head_dim
        device = kv.device
        tokens = torch.tensor([t for s in segments for t in s.tokens], device=device)
        pos = torch.tensor(
            [p for s in segments for p in range(s.start, s.start + len(s.tokens))], device=device
        )
        bounds = [0]
        for s in segments:
            bounds.append(bounds[-1] + len(s.tokens))
        x = self.wte(tokens) + self.wpe(pos)
        causal = self._causal_mask(size, device)
        scale = 1.0 / math.sqrt(hd)
        for layer, blk in enumerate(self.blocks):
            assert isinstance(blk, Block)
            h = F.layer_norm(x, (c.d_model,), blk.ln_1.weight, blk.ln_1.bias)
            qkv = _split_k_linear(h, blk.qkv).view(-1, 3, heads, hd).permute(1, 2, 0, 3)
            outs = []
            for i, s in enumerate(segments):
                rows = qkv[:, :, bounds[i] : bounds[i + 1]]  # [3, H, n, hd]
                end = s.start + len(s.tokens)
                p = s.start
                while p < end:  # the new rows may straddle blocks
                    stop = min(end, (p // size + 1) * size)
                    dst = kv[s.table[p // size], layer, :, :, p % size : p % size + stop - p]
                    dst.copy_(rows[1:, :, p - s.start : stop - s.start])
                    p = stop
                n_blocks = -(-end // size)
                past = kv[torch.tensor(s.table[:n_blocks], device=device), layer]
                past = past.permute(1, 2, 0, 3, 4).reshape(2, heads, n_blocks * size, hd)
                mask = causal[s.start : end, : n_blocks * size]
                scores = torch.baddbmm(mask, rows[0], past[0].transpose(1, 2), alpha=scale)
                outs.append(torch.bmm(scores.softmax(dim=-1), past[1]))
            att = torch.cat(outs, dim=1).transpose(0, 1).reshape(-1, c.d_model)
            x = x + _split_k_linear(att, blk.attn_proj)
            h = F.layer_norm(x, (c.d_model,), blk.ln_2.weight, blk.ln_2.bias)
            h = F.gelu(_split_k_linear(h, blk.fc))
            x = x + _split_k_linear(h, blk.mlp_proj)
        last = torch.tensor([b - 1 for b in bounds[1:]], device=device)
        x = F.layer_norm(x[last], (c.d_model,), self.ln_f.weight, self.ln_f.bias)
        return F.linear(x, self.lm_head.weight)
