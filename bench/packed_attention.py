"""Packed (document-masked causal) attention kernels at the dense preset's shape, forward +
backward, on one GPU (issue 36): PyTorch's FlashAttention-2 varlen kernel, and for a row of
equal-length documents SDPA over them as a batch (cuDNN's kernels first, as torchtitan runs
them; ``kuberl.train.packing.uniform_sdpa_attention``), with K/V repeated to every head or
through SDPA's ``enable_gqa``. Checks each against FlashAttention-2's
output and gradients.

    PYTHONPATH=workloads python bench/packed_attention.py --json attn.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    from torch.nn import functional as F
    from torch.nn.attention import sdpa_kernel

    from kuberl.train.packing import _UNIFORM_BACKENDS, flash_varlen_attention, uniform_sdpa_attention

    def uniform_sdpa_native_gqa(query, key, value, docs, scaling):
        """uniform_sdpa_attention with SDPA's enable_gqa instead of K/V repeated to every head."""
        _, heads, length, dim = query.shape

        def rows(t):
            return t[0].unflatten(1, (docs, length // docs)).transpose(0, 1)

        with sdpa_kernel(_UNIFORM_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(rows(query), rows(key), rows(value), is_causal=True, scale=scaling,
                                                 enable_gqa=True)
        return out.transpose(1, 2).reshape(1, length, heads, dim)

    dev = torch.device("cuda")
    rng = random.Random(0)
    ragged = []
    while sum(ragged) < args.tokens - 4096:
        ragged.append(rng.randint(64, 4096))
    ragged.append(args.tokens - sum(ragged))
    cases = {"4 x 4096": [args.tokens // 4] * 4, f"ragged {len(ragged)}": ragged}
    rows = []
    for case, lengths in cases.items():
        T, H, KV, D = sum(lengths), args.heads, args.kv_heads, args.head_dim
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        cu = cu.to(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        dout = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        scale = D ** -0.5
        kernels = {"flash2 varlen": lambda: flash_varlen_attention(q, k, v, cu, max(lengths), scale)}
        if len(set(lengths)) == 1:
            kernels["uniform sdpa (cudnn first)"] = lambda: uniform_sdpa_attention(q, k, v, len(lengths), scale)
            kernels["uniform sdpa, enable_gqa"] = lambda: uniform_sdpa_native_gqa(q, k, v, len(lengths), scale)
        ref = None
        for name, fn in kernels.items():
            try:
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), dout)
                if ref is None:
                    ref = (out.detach(), [x.detach() for x in grads])
                err = max([(out - ref[0]).abs().max().item()] + [(a - b).abs().max().item()
                                                                    for a, b in zip(grads, ref[1])])
                fwd = timed(lambda: fn())
                both = timed(lambda: torch.autograd.grad(fn(), (q, k, v), dout))
                row = dict(case=case, kernel=name, fwd_ms=fwd, bwd_ms=both - fwd, max_abs_diff_vs_flash2=err)
            except Exception as exc:  # noqa: BLE001 - a kernel that fails here is reported, not fatal
                row = dict(case=case, kernel=name, error=repr(exc)[:300])
            print(row, flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
