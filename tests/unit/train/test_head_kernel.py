"""The log-prob head's one-pass statistics kernel (``kuberl.train.head_kernel``) against the
PyTorch formulation the CPU path uses, in float64 (in fp32 that formulation's entropy, a
difference of two sums near the max logit, is the less exact of the two), and its check of the
target ids; run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set before Triton is imported, hence the subprocess)."""

from __future__ import annotations

import pytest

from tests.unit import triton_interpreter

# Triton 3.6's interpreter fails on the kernel's loop over the width (a TypeError on `range(0, vocab,
# BLOCK)`, seen on the GPU machine); 3.7's, the lock's, runs it.
pytest.importorskip("triton", minversion="3.7")

CHECK = r"""
import torch
from kuberl.train import head_kernel
from kuberl.train.logprobs import _chunk_forward

torch.manual_seed(0)
# Widths below, at and across the kernel's block (the masked tail); one row dominated by its
# target, one flat, one of large logits (the running max moves between blocks).
for vocab, dtype, inv_temp in [(1000, torch.float32, 1.0), (4096, torch.bfloat16, 1.0),
                               (9000, torch.bfloat16, 1 / 0.7), (9000, torch.float32, 1.0)]:
    n = 5
    logits = (torch.randn(n, vocab) * 3).to(dtype)
    logits[1] = 0.0
    logits[2, 7] = 60.0
    logits[3] = torch.linspace(-50, 80, vocab).to(dtype)
    targets = torch.randint(0, vocab, (n,))
    targets[2] = 7
    lp, lse, ent = (torch.empty(n) for _ in range(3))
    # Blocks of 1024 columns: several iterations per row, and a masked tail where 1024 does
    # not divide the width.
    head_kernel.row_stats(logits, targets, inv_temp, True, lp, lse, ent, block=1024)
    want = _chunk_forward(logits.double(), targets, inv_temp, True)
    for got, ref, name in zip((lp, lse, ent), want, ("logprob", "lse", "entropy")):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=2e-5), (vocab, dtype, name, got, ref)
    lp2, lse2 = torch.empty(n), torch.empty(n)
    head_kernel.row_stats(logits, targets, inv_temp, False, lp2, lse2, None, block=2048)
    assert torch.allclose(lp2, lp) and torch.allclose(lse2, lse)
# Rows of a wider tensor (a kept slice): the row stride, not the width, steps between rows.
wide = torch.randn(3, 5000)
sub = wide[:, :3000]
lp, lse, ent = (torch.empty(3) for _ in range(3))
head_kernel.row_stats(sub, torch.tensor([0, 1, 2999]), 1.0, True, lp, lse, ent, block=4096)
want = _chunk_forward(sub.double(), torch.tensor([0, 1, 2999]), 1.0, True)
assert all(torch.allclose(a.double(), b, rtol=1e-5, atol=2e-5) for a, b in zip((lp, lse, ent), want))
# The backward's in-place gradient, one-hot term included, with and without the entropy's term.
from kuberl.train.logprobs import _chunk_grad_logits_into
for vocab, dtype, with_entropy in [(3000, torch.float32, True), (9000, torch.bfloat16, True),
                                   (3000, torch.float32, False)]:
    n = 4
    logits = (torch.randn(n, vocab) * 3).to(dtype)
    logits[1, 5] = 40.0  # p of the target near 1: the two terms nearly cancel
    targets = torch.tensor([0, 5, vocab - 1, 17])
    lp, lse, ent = (torch.empty(n) for _ in range(3))
    head_kernel.row_stats(logits, targets, 0.8, True, lp, lse, ent, block=1024)
    grad_lp, grad_ent = torch.randn(n), torch.randn(n)
    entropy, g_ent = (ent, grad_ent) if with_entropy else (None, None)
    want = logits.double()
    _chunk_grad_logits_into(want, 0.8, lse.double(), entropy.double() if with_entropy else None,
                            grad_lp.double(), g_ent.double() if with_entropy else None, targets)
    got = logits.clone()
    head_kernel.grad_logits_(got, 0.8, lse, entropy, grad_lp, g_ent, targets, block=1024)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * 1e-2), (vocab, dtype, (got.double() - want).abs().max())
# Gradients as autograd hands them in: a sum()'s backward is a stride-0 view of one element.
expanded, dense = logits.clone(), logits.clone()
head_kernel.grad_logits_(expanded, 0.8, lse, None, torch.ones(()).expand(n), None, targets.expand(n), block=1024)
head_kernel.grad_logits_(dense, 0.8, lse, None, torch.ones(n), None, targets, block=1024)
assert torch.equal(expanded, dense), (expanded - dense).abs().max()
# A target id outside the head's columns raises, as the PyTorch path's gather does, where the
# kernel would read another row's logits (the id one past the width: the next row's first column).
logits = torch.randn(3, 1000)
out = [torch.empty(3) for _ in range(3)]
for bad in (1000, -1):
    try:
        head_kernel.row_stats(logits, torch.tensor([0, bad, 2]), 1.0, True, *out, block=1024)
    except RuntimeError as exc:
        assert "outside the head" in str(exc), exc
    else:
        raise AssertionError(f"target id {bad} of a width of 1000 was read: {out[0]}")
print("ok")
"""


@pytest.mark.triton_interpreter(CHECK)
def test_one_pass_kernel_matches_the_pytorch_formulation():
    triton_interpreter.result(CHECK)
