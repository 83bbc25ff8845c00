"""The log-prob head's two passes over its logits on one GPU, Triton against compiled PyTorch.

Forward statistics (log p(target), logsumexp, entropy per row): the one-pass Triton kernel
(``kuberl.train.head_kernel.row_stats``, autotuned and at each fixed block) against the compiled
PyTorch formulation it replaced (``logprobs._chunk_forward`` under ``torch.compile``, 1024-row
chunks). Backward: the in-place gradient of the same logits (one read and one write), Triton
(``head_kernel.grad_logits_``) against the compiled PyTorch slices it replaced. The logits are
the dense preset's kept logits of one micro-batch (14,336 scored rows x vocab 151,936, bf16).

    PYTHONPATH=workloads python bench/head_stats.py [--rows 14336 --vocab 151936] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kuberl.train import head_kernel
from kuberl.train.logprobs import _chunk_forward, _chunk_grad_logits_into, _fused


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls, after two untimed."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    n, vocab = args.rows, args.vocab
    logits = (torch.randn(n, vocab, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    lp, lse, ent = (torch.empty(n, device="cuda") for _ in range(3))
    gigabytes = logits.numel() * logits.element_size() / 1e9

    def pytorch():
        for lo in range(0, n, args.chunk):
            hi = min(n, lo + args.chunk)
            chunk = logits[lo:hi]
            a, b, c = _fused(_chunk_forward, chunk)(chunk, targets[lo:hi], 1.0, True)
            lp[lo:hi], lse[lo:hi], ent[lo:hi] = a, b, c

    rows = {"compiled PyTorch, 1024-row chunks": timed(pytorch)}
    want = (lp.clone(), lse.clone(), ent.clone())
    rows["Triton one pass, autotuned"] = timed(lambda: head_kernel.row_stats(logits, targets, 1.0, True, lp, lse, ent))
    error = max((a - b).abs().max().item() for a, b in zip((lp, lse, ent), want))
    for block, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        rows[f"Triton one pass, block {block}, {warps} warps"] = timed(
            lambda b=block, w=warps: head_kernel.row_stats(logits, targets, 1.0, True, lp, lse, ent, block=b, num_warps=w))
    grad_lp, grad_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    # The backward's pass rewrites the logits in place: timed on a copy, rewritten again each call
    # (the values stay finite; only the time is read).
    scratch = logits.clone()
    width = args.chunk * vocab // n // 128 * 128

    def backward_pass():
        for lo in range(0, vocab, width):
            part = scratch[:, lo:min(vocab, lo + width)]
            _fused(_chunk_grad_logits_into, part)(part, 1.0, lse, ent, grad_lp, grad_ent, targets - lo)

    rows["backward, compiled PyTorch slices (read + write)"] = timed(backward_pass)
    rows["backward, Triton one pass, autotuned (read + write)"] = timed(
        lambda: head_kernel.grad_logits_(scratch, 1.0, lse, ent, grad_lp, grad_ent, targets))
    print(f"{torch.cuda.get_device_name()}: {n} x {vocab} bf16 logits ({gigabytes:.2f} GB); "
          f"max |Triton - PyTorch| over log-prob, lse, entropy: {error:.2e}")
    for name, ms in rows.items():
        passes = 2 if name.startswith("backward") else 1  # the backward reads and writes
        print(f"{name:<55} {ms:8.3f} ms  {passes * gigabytes / ms:6.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": n, "vocab": vocab,
                       "max_abs_error": error, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
