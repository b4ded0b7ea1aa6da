"""The reference server's model, restated from its specification alone: the serving oracle.

This module recomputes what the reference server (``reference: server``) must answer to each
request of a load, with none of the serving stack: no engine, no paged KV cache, no tiles, no
batching, no router. It imports nothing from ``reference_impl``; it is a second statement of
the model (reference_impl/serving/model.py's docstring and docs/serving.md), so a bug on the
server's fault-free path (a wrong mask, a stale KV block, a wrong position, changed weights)
makes the two disagree instead of passing itself.

What is restated:

- **Weights.** One CPU ``torch.Generator`` seeded with the model seed draws, for every module
  in the order of its name (``blocks.0.attn_proj``, ``blocks.0.fc``, ..., ``lm_head``,
  ``ln_f``, ``wpe``, ``wte``), ``randn`` of an embedding's shape, or of a linear layer's
  weight times ``in_features ** -0.5`` (biases zero); layer norms are weight 1, bias 0.
- **Model.** Byte tokens; ``x = wte[token] + wpe[position]``; ``n_layer`` pre-LN blocks of
  causal multi-head attention (``qkv`` splits as ``[3, n_head, head_dim]`` columns, scale
  ``head_dim ** -0.5``) and a GELU MLP of width ``4 d_model``; final layer norm; a linear head
  without bias.
- **Decoding.** Greedy: each generated token is the argmax of the logits at the position
  before it, ``max_tokens`` of them, nothing stops earlier.

How it judges: one plain causal forward over the whole sequence (prompt and the twin's tokens)
gives the logits every position would have in a forward over its own prefix, which is what
greedy decoding one token at a time computes. It runs in float64, so it is more exact than the
server's float32 and never equal to it bit for bit: a token agrees when it is the oracle's
argmax, or within ``TIE`` of the maximum (two candidates that close are a tie that float32
rounding may break either way; the oracle then follows the twin's choice, as teacher forcing
does). The logits digests of the twin are bits of float32 kernels, which only a golden of the
same rounding key can witness.

Run as ``python -m aftershock.harness.oracle.serving_math`` with a JSON request on stdin (what
``aftershock.harness.oracle.serving.judge_outputs`` sends).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The reference server's model (ModelConfig's defaults; a scenario sets the seed alone).
#: Restated, not imported: tests/test_golden_hosts.py checks they still agree.
VOCAB, N_LAYER, N_HEAD, D_MODEL, MAX_SEQ = 256, 2, 4, 128, 1024
#: Logits this close to the maximum are a tie (relative to the maximum's magnitude, at least
#: 1): float32 rounding in the server differs from float64 by ~1e-6 here.
TIE = 1e-3


@dataclass(frozen=True, slots=True)
class Layer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    qkv: tuple[torch.Tensor, torch.Tensor]
    attn_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Weights:
    wte: torch.Tensor
    wpe: torch.Tensor
    layers: list[Layer]
    ln_f: tuple[torch.Tensor, torch.Tensor]
    lm_head: torch.Tensor


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    """The weights by parameter name, in float32, as the specification draws them."""
    d = D_MODEL
    linears = {"attn_proj": (d, d), "fc": (4 * d, d), "mlp_proj": (d, 4 * d), "qkv": (3 * d, d)}
    modules: dict[str, tuple[str, tuple[int, int]]] = {
        "wte": ("embedding", (VOCAB, d)), "wpe": ("embedding", (MAX_SEQ, d)),
        "ln_f": ("norm", (d, 0)), "lm_head": ("head", (VOCAB, d)),
    }
    for layer in range(N_LAYER):
        for name, shape in linears.items():
            modules[f"blocks.{layer}.{name}"] = ("linear", shape)
        for name in ("ln_1", "ln_2"):
            modules[f"blocks.{layer}.{name}"] = ("norm", (d, 0))
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(modules):  # the draw order: module names, sorted
        kind, (rows, cols) = modules[name]
        if kind == "norm":
            state[f"{name}.weight"] = torch.ones(rows)
            state[f"{name}.bias"] = torch.zeros(rows)
        elif kind == "embedding":
            state[f"{name}.weight"] = torch.randn((rows, cols), generator=generator)
        else:
            std = cols**-0.5
            state[f"{name}.weight"] = torch.randn((rows, cols), generator=generator) * std
            if kind == "linear":
                state[f"{name}.bias"] = torch.zeros(rows)
    return state


def weights(seed: int) -> Weights:
    s = {k: v.double() for k, v in state_dict(seed).items()}

    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return s[f"{name}.weight"], s[f"{name}.bias"]

    layers = [Layer(*(pair(f"blocks.{i}.{n}") for n in
                      ("ln_1", "qkv", "attn_proj", "ln_2", "fc", "mlp_proj")))
              for i in range(N_LAYER)]
    return Weights(s["wte.weight"], s["wpe.weight"], layers, pair("ln_f"), s["lm_head.weight"])


def logits(w: Weights, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), VOCAB]``: row ``p`` is the logits after tokens ``0..p``."""
    n, d, heads = len(tokens), D_MODEL, N_HEAD
    hd = d // heads
    x = w.wte[torch.tensor(tokens)] + w.wpe[torch.arange(n)]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for layer in w.layers:
        h = F.layer_norm(x, (d,), *layer.ln_1)
        q, k, v = F.linear(h, *layer.qkv).view(n, 3, heads, hd).permute(1, 2, 0, 3)
        scores = q @ k.transpose(1, 2) * hd**-0.5 + mask
        att = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(n, d)
        x = x + F.linear(att, *layer.attn_proj)
        h = F.gelu(F.linear(F.layer_norm(x, (d,), *layer.ln_2), *layer.fc))
        x = x + F.linear(h, *layer.mlp_proj)
    return F.linear(F.layer_norm(x, (d,), *w.ln_f), w.lm_head)


def judge(request: dict[str, Any]) -> dict[str, Any]:
    """Each request's tokens against greedy decoding: the first disagreement of each."""
    w = weights(int(request["model_seed"]))
    disagree: list[dict[str, Any]] = []
    ties = 0
    for item in request["requests"]:
        prompt, got, want = list(item["prompt"]), list(item["tokens"]), int(item["max_tokens"])
        if len(got) != want:
            disagree.append({"id": item["id"], "index": min(len(got), want),
                             "why": f"{len(got)} tokens, max_tokens is {want}"})
            continue
        if len(prompt) + want > MAX_SEQ or any(not 0 <= t < VOCAB for t in prompt + got):
            disagree.append({"id": item["id"], "index": 0, "why": "not a valid sequence"})
            continue
        rows = logits(w, prompt + got[:-1])[len(prompt) - 1:]
        for index, (row, token) in enumerate(zip(rows, got, strict=True)):
            top = float(row.max())
            if int(row.argmax()) == token:
                continue
            if float(row[token]) >= top - TIE * max(1.0, abs(top)):
                ties += 1
                continue
            disagree.append({"id": item["id"], "index": index,
                             "why": f"token {token}, the oracle's {int(row.argmax())} "
                                    f"(logit {float(row[token]):.4f} < {top:.4f})"})
            break
    return {"requests": len(request["requests"]), "disagree": disagree, "ties": ties}


def main() -> int:
    torch.set_num_threads(1)
    with torch.no_grad():
        print(json.dumps(judge(json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
