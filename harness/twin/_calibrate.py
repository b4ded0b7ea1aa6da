"""The rounding battery: how this host's kernels round, as one digest
(aftershock.harness.twin.golden's
key).

Run as ``python -m aftershock.harness.twin._calibrate DEVICE THREADS`` in the environment the system
under
test gets (aftershock.harness.twin.golden builds it). It runs a small fixed battery of the kernels
the
reference systems use, on fixed inputs, with the thread count their processes use, and
prints one JSON line: ``{"key": sha256 of every result's bits, "platform": what a human
reads}``. Two hosts (or two settings of one host: ``MKL_CBWR``, an ISA cap, another BLAS,
other thread counts) that round any of these kernels differently get different keys, whatever
their CPU names say; hosts that round them alike share one.

The battery, in the shapes the reference systems use them:

- the trainer: the column- and row-parallel matmuls of a shard (2x2 and 2x1 layouts), their
  backward products, GELU, the sine target and mean squared error, and a few AdamW steps
  (the optimizer's arithmetic: its foreach ``lerp``, ``addcmul``, ``sqrt``, ``addcdiv``);
- the server: ``F.linear`` of every layer on a tile and on a longer run of rows, layer norm,
  the paged attention's ``baddbmm`` + softmax + ``bmm`` over one and several blocks, GELU.

Inputs are drawn from seeded CPU generators (bitwise the same everywhere) and moved to the
device. It takes well under a second after torch's import.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys

import torch
import torch.nn.functional as F

#: Bumped when the battery changes: every key changes with it, so goldens must be recorded
#: again (aftershock golden --update).
BATTERY = "1"


def _inputs(seed: int, *shape: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device)


def battery(device: torch.device) -> list[torch.Tensor]:
    """Every result whose bits make the key, in a fixed order."""
    out: list[torch.Tensor] = []
    seed = iter(range(1000))

    def rnd(*shape: int) -> torch.Tensor:
        return _inputs(next(seed), *shape, device=device)

    # Trainer: batch 32, d_model 64, hidden 256 split in 1 or 2 shards, head of 8.
    for hidden in (256, 128):
        x, w_in, w_out = rnd(32, 64), rnd(hidden, 64) * 0.125, rnd(64, hidden) * hidden**-0.5
        h = F.gelu(F.linear(x, w_in, torch.zeros(hidden, device=device)))
        y = F.linear(h, w_out)
        grad = rnd(32, 64)
        out += [h, y, grad @ w_out, grad.t() @ h, (grad @ w_out).t() @ x]
    head, x = rnd(8, 64) * 0.125, rnd(32, 64)
    teacher = rnd(64, 8)
    out += [F.mse_loss(F.linear(x, head), torch.sin(3 * x @ teacher)).reshape(1)]
    # AdamW's arithmetic, as torch's foreach implementation does it (the optimizer object
    # itself would import torch._dynamo: 1.5 s, more than the whole battery).
    params = [rnd(64, 32), rnd(32)]
    avg = [torch.zeros_like(p) for p in params]
    avg_sq = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [rnd(*p.shape) for p in params]
        torch._foreach_lerp_(avg, grads, 1 - 0.9)
        torch._foreach_mul_(avg_sq, 0.999)
        torch._foreach_addcmul_(avg_sq, grads, grads, 1 - 0.999)
        denom = torch._foreach_sqrt(avg_sq)
        torch._foreach_div_(denom, (1 - 0.999**step) ** 0.5)
        torch._foreach_add_(denom, 1e-8)
        torch._foreach_addcdiv_(params, avg, denom, -3e-3 / (1 - 0.9**step))
    out += [*params, *avg, *avg_sq]
    # Server: d_model 128, 4 heads of 32, MLP 512, vocab 256; tiles of 4 rows, blocks of 16.
    for rows in (4, 16, 88):
        x = rnd(rows, 128)
        h = F.layer_norm(x, (128,), rnd(128), rnd(128))
        for w in (rnd(384, 128), rnd(128, 128), rnd(512, 128), rnd(256, 128)):
            out.append(F.linear(h, w * 128**-0.5))
        out.append(F.gelu(F.linear(h, rnd(512, 128) * 128**-0.5)))
        out.append(F.linear(rnd(rows, 512), rnd(128, 512) * 512**-0.5, rnd(128)))
    for span in (16, 48):
        q, keys, values = rnd(4, 4, 32), rnd(4, span, 32), rnd(4, span, 32)
        mask = torch.full((4, span), float("-inf"), device=device).triu(span - 3)
        scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=32**-0.5)
        out += [scores, torch.bmm(scores.softmax(dim=-1), values)]
    return out


def digest(results: list[torch.Tensor]) -> str:
    sha = hashlib.sha256(BATTERY.encode())
    for tensor in results:
        data = tensor.detach().to("cpu").contiguous()
        sha.update(repr((data.dtype, tuple(data.shape))).encode())
        sha.update(data.numpy().tobytes())
    return sha.hexdigest()


def platform_line(device: torch.device) -> str:
    """What a human reads: torch, the CPU and the ISA torch dispatches to, the device (and,
    where torch uses MKL, MKL's code path: aftershock.harness.twin.golden reads it from MKL's
    verbose
    line)."""
    isa = torch.backends.cpu.get_cpu_capability()
    cpu = " ".join(p for p in (platform.machine(), isa) if p)
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    else:
        name = "cpu"
    return f"torch {torch.__version__}; {cpu}; {name}"


def main(argv: list[str]) -> int:
    kind, threads = argv[0], int(argv[1])
    if kind == "cuda" and not torch.cuda.is_available():
        print("cuda (unavailable)", file=sys.stderr)
        return 1
    if threads > 0:  # as the system's processes set it (trainer ranks and workers: 1)
        torch.set_num_threads(threads)
    device = torch.device(kind)
    with torch.no_grad():
        key = digest(battery(device))
    print(json.dumps({"key": key, "platform": platform_line(device)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
