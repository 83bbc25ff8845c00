"""AdamW's update over every parameter of a group in one Triton launch, the gradient clipping's
multiply folded in.

The update reads each parameter, gradient and both moments once and writes the parameter and
moments once: 28 bytes per fp32 element, 55.5 GB a step for the dense preset's 1.98B parameters,
13.1 ms at the 4.24 TB/s an H200 copies. torch's fused AdamW (``torch._fused_adamw_``) took 17.4 ms
a call there, and the clipping before it (``clip_grads_with_norm_``: a multiply of every gradient
in place, another read and write of all of them) 4.9 ms; this kernel took 13.6 ms inside a
training step (bench/adamw_speed.py, docs/benchmarks.md). Here one program
updates ``BLOCK`` elements of one tensor; a table built once per set of shapes maps programs to
tensors, and the tensors' addresses come in as 64-bit integers (the parameters and moments stay
where torch allocated them, so the optimizer's state, and with it DCP checkpoints, keeps torch's
format).

Per element, with ``c`` the clip coefficient (the gradient times ``c``, rounded to fp32, is what
``clip_grads_with_norm_`` left in the gradient), as torch's AdamW (decoupled weight decay):
``p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. The two bias corrections come in per
tensor, computed in float64 as torch's kernel does (``kuberl.train.optim``); the rest is fp32, where
torch's kernel does part of it in float64: the results differ by rounding
(``tests/unit/train/test_optim.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _adamw_blocks(block_tensor, first_block, numels, addresses, n_tensors, step_size, bias2_sqrt, grad_mul,
                  found_inf, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                  HAS_GRAD_MUL: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = (pid - tl.load(first_block + t)) * BLOCK
    n = tl.load(numels + t)
    if HAS_FOUND_INF:
        # A skipped update (a non-finite gradient somewhere) reads and writes nothing, as torch's
        # fused kernels return early on found_inf: no element is in range.
        n = n * (tl.load(found_inf) == 0).to(tl.int64)
    # addresses: four rows of n_tensors (parameters, gradients, first and second moments).
    p_addr = tl.load(addresses + t)
    g_addr = tl.load(addresses + n_tensors + t)
    m_addr = tl.load(addresses + 2 * n_tensors + t)
    v_addr = tl.load(addresses + 3 * n_tensors + t)
    p_ptr = p_addr.to(tl.pointer_type(tl.float32))
    g_ptr = g_addr.to(tl.pointer_type(tl.float32))
    m_ptr = m_addr.to(tl.pointer_type(tl.float32))
    v_ptr = v_addr.to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK)
    p_ptrs, g_ptrs, m_ptrs, v_ptrs = p_ptr + offs, g_ptr + offs, m_ptr + offs, v_ptr + offs
    if ALIGNED:
        # Every address 16-byte aligned and every size a multiple of 16 (checked by the caller):
        # said so, the loads and stores become 16-byte vectors. Triton cannot know it of an address
        # read from memory, and without it issued one 4-byte access per element (its PTX).
        n = tl.multiple_of(n, 16)
        p_ptrs = tl.max_contiguous(tl.multiple_of(p_ptrs, 16), BLOCK)
        g_ptrs = tl.max_contiguous(tl.multiple_of(g_ptrs, 16), BLOCK)
        m_ptrs = tl.max_contiguous(tl.multiple_of(m_ptrs, 16), BLOCK)
        v_ptrs = tl.max_contiguous(tl.multiple_of(v_ptrs, 16), BLOCK)
    mask = offs < n
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    if HAS_GRAD_MUL:
        g = g * tl.load(grad_mul)
    p = tl.load(p_ptrs, mask=mask, other=0.0)
    m = tl.load(m_ptrs, mask=mask, other=0.0)
    v = tl.load(v_ptrs, mask=mask, other=0.0)
    p = p - lr_wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(bias2_sqrt + t)) + eps
    p = p - tl.div_rn(tl.load(step_size + t) * m, denom)
    tl.store(p_ptrs, p, mask=mask)
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)


def launch(n_blocks: int, block_tensor, first_block, numels, addresses, n_tensors: int, step_size, bias2_sqrt,
           grad_mul, found_inf, *, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
           aligned: bool, block: int, num_warps: int) -> None:
    """One launch over ``n_blocks`` programs (``kuberl.train.optim.AdamW`` builds the tables).
    ``grad_mul`` / ``found_inf``: fp32 scalar tensors or None."""
    _adamw_blocks[(n_blocks,)](
        block_tensor, first_block, numels, addresses, n_tensors, step_size, bias2_sqrt,
        grad_mul if grad_mul is not None else step_size, found_inf if found_inf is not None else step_size,
        lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        HAS_GRAD_MUL=grad_mul is not None, HAS_FOUND_INF=found_inf is not None, ALIGNED=aligned,
        BLOCK=block, num_warps=num_warps)
