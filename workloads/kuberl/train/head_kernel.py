"""The log-prob head's forward statistics in one pass over the logits (a Triton kernel).

Per row of ``z = logits * inv_temp``: ``lse = logsumexp(z)``, ``log p(target) = z_t - lse`` and
the entropy ``H = lse - sum(softmax(z) * z)``. Written in PyTorch (``logprobs._chunk_forward``)
the entropy's sum needs ``lse`` first, so the compiled kernels read each row of logits more than
once (at vocab 151,936 a row is 300 KB, so a re-read comes from HBM: ~4.4 GB per pass at the
dense preset's 14,336 scored rows per micro-batch). Here each row is read once, in blocks, with
the online-softmax recurrence carrying the running max ``m``, ``s = sum exp(z - m)`` and
``t = sum exp(z - m) * z``; at the end ``lse = m + log s`` and ``H = lse - t / s``.

Triton comes with PyTorch's CUDA builds; off CUDA (tests, CPU) ``logprobs`` uses the PyTorch
formulation. ``TRITON_INTERPRET=1`` runs this kernel on CPU tensors, which is how the unit test
checks it against the PyTorch reference on a machine without a GPU; ``bench/head_stats.py``
times it against the compiled PyTorch formulation on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Columns per loop iteration and warps per row, picked by Triton's autotuner once per vocabulary
# width on the first call (a warm-up step): how many bytes each SM keeps in flight decides
# whether one pass reaches the memory's bandwidth, and that was not measured per chip.
_CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps)
            for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16))]


@triton.autotune(configs=_CONFIGS, key=["vocab", "WITH_ENTROPY"])
@triton.jit
def _row_stats(logits, row_stride, targets, out_lp, out_lse, out_ent, vocab, inv_temp,
               WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = -float("inf")       # running max of z
    s = 0.0                 # sum exp(z - m)
    t = 0.0                 # sum exp(z - m) * z
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        z = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))   # finite: every block holds a column
        scale = tl.exp2((m - m_new) * 1.4426950408889634)   # exp(m - m_new); log2(e) inline
        e = tl.exp2((z - m_new) * 1.4426950408889634)       # 0 where masked
        s = s * scale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            t = t * scale + tl.sum(tl.where(mask, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets + row)
    z_t = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(out_lp + row, z_t - lse)
    tl.store(out_lse + row, lse)
    if WITH_ENTROPY:
        tl.store(out_ent + row, lse - t / s)


def row_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float, with_entropy: bool,
              out_lp: torch.Tensor, out_lse: torch.Tensor, out_ent: torch.Tensor | None, *,
              block: int | None = None, num_warps: int = 4) -> None:
    """Write fp32 ``log p(target)``, ``lse`` and (``with_entropy``) entropy of each row of
    ``logits`` ``(n, V)`` (rows contiguous) into the given ``(n,)`` tensors. ``block``: launch
    with these columns per iteration and ``num_warps`` instead of the autotuned choice (the
    interpreter, which cannot time configurations, and the bench's sweep)."""
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("row_stats needs each row of logits contiguous")
    targets = targets.contiguous()  # the kernel reads element ``row``
    # The kernel reads logits[row, target] unchecked: an id outside [0, vocab) would read another
    # row's logits, or past the tensor, and return a wrong log-prob without an error (the PyTorch
    # path's gather raises). Checked on the device, so no host sync: a bad id fails the process
    # with a device-side assert, as the gather's own check does on a GPU.
    torch._assert_async(((targets >= 0) & (targets < vocab)).all(),
                        f"row_stats: a target id is outside the head's {vocab} columns")
    args = (logits, logits.stride(0), targets, out_lp, out_lse, out_ent if with_entropy else out_lse,
            vocab, float(inv_temp))
    if block is None:
        _row_stats[(n,)](*args, WITH_ENTROPY=with_entropy)
    else:
        _row_stats.fn[(n,)](*args, WITH_ENTROPY=with_entropy, BLOCK=block, num_warps=num_warps)


# In place: the autotuner's timing runs would each read the previous run's gradients as logits, so
# it restores the logits before each (else the first call per width returns a wrong gradient).
@triton.autotune(configs=_CONFIGS, key=["vocab", "WITH_ENTROPY"], restore_value=["logits"])
@triton.jit
def _grad_logits(logits, row_stride, targets, lse, entropy, grad_lp, grad_ent, vocab, inv_temp,
                 WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    row_lse = tl.load(lse + row)
    g_lp = tl.load(grad_lp + row)
    coef0 = g_lp
    g_ent = 0.0
    if WITH_ENTROPY:
        g_ent = tl.load(grad_ent + row)
        coef0 = g_lp + g_ent * tl.load(entropy + row)
    target = tl.load(targets + row)
    for start in range(0, vocab, BLOCK):
        col = start + cols
        mask = col < vocab
        log_p = tl.load(base + col, mask=mask, other=0.0).to(tl.float32) * inv_temp - row_lse
        p = tl.exp2(log_p * 1.4426950408889634)
        coef = coef0
        if WITH_ENTROPY:
            coef = coef0 + g_ent * log_p
        # The one-hot term is added before the one rounding to the logits' dtype: where p of the
        # target is near 1 the two terms nearly cancel.
        g = tl.where(col == target, g_lp * inv_temp, 0.0) - p * coef * inv_temp
        tl.store(base + col, g.to(logits.dtype.element_ty), mask=mask)


def grad_logits_(logits: torch.Tensor, inv_temp: float, lse: torch.Tensor, entropy: torch.Tensor | None,
                 grad_lp: torch.Tensor, grad_ent: torch.Tensor | None, targets: torch.Tensor, *,
                 block: int | None = None, num_warps: int = 4) -> None:
    """Overwrite ``logits`` ``(n, V)`` with d loss / d logits, one-hot term included, in one
    read and one write per element (``logprobs._chunk_grad_logits_into`` in PyTorch; its
    compiled kernel ran at 1.2 TB/s on an H200, bench/head_stats.py). Entropy's term only when
    ``entropy`` and ``grad_ent`` are given. ``block``: as in ``row_stats``."""
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("grad_logits_ needs each row of logits contiguous")
    with_entropy = entropy is not None and grad_ent is not None
    # The kernel reads element ``row`` of each: autograd hands in expanded gradients (a ``sum()``'s
    # backward is a stride-0 view of one element), which are materialised here.
    targets, lse, grad_lp = targets.contiguous(), lse.contiguous(), grad_lp.contiguous()
    if with_entropy:
        entropy, grad_ent = entropy.contiguous(), grad_ent.contiguous()
    args = (logits, logits.stride(0), targets, lse, entropy if with_entropy else lse, grad_lp,
            grad_ent if with_entropy else grad_lp, vocab, float(inv_temp))
    if block is None:
        _grad_logits[(n,)](*args, WITH_ENTROPY=with_entropy)
    else:
        _grad_logits.fn[(n,)](*args, WITH_ENTROPY=with_entropy, BLOCK=block, num_warps=num_warps)
