"""Per-token log-probs and entropy straight from hidden states, chunked over tokens.

The RL loss needs, per trained token, ``log p(target)`` and the entropy of the next-token
distribution. Computing them from ``model(...).logits`` materialises ``[tokens x vocab]`` logits,
then their fp32 copy, log-softmax and ``exp``: at vocab 151,936 that is ~0.6 GB per 1k tokens per
tensor, kept for backward. ``TokenLogProbHead`` replaces the model's ``lm_head`` (same weight
parameter, same state-dict key) and, when asked, computes only the rows that are trained on, in
chunks of ``chunk_tokens`` rows. What is kept for backward is the hidden states, two floats per
token and, while they fit in ``keep_logits_bytes``, the logits in the compute dtype (bf16 on GPU:
4.4 GB for 14,336 rows at vocab 151,936); the backward turns kept logits into their gradient in
place and takes both gradients as one matmul each. Past that budget the backward recomputes them
slice by slice, one more pass of the head's matmul. Without a request it is the plain linear head
(exports, ``generate``).

Gradients, with ``z`` the temperature-scaled logits of one row, ``p = softmax(z)``,
``H = -sum p log p``:  ``d log p_t / dz = onehot(t) - p`` and ``dH / dz = -p * (log p + H)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("kuberl.train")

# Rows per chunk: 1024 x 151,936 fp32 logits is 0.6 GB; a chunk's logits matmul is still ~0.6
# TFLOP, far past launch overhead. Peak memory at this default: bench/train_speed.py --memory.
DEFAULT_CHUNK_TOKENS = 1024
# Logits up to this size are kept for backward instead of recomputed: at the dense preset's
# 16,384-token micro-batches (14,336 scored rows) that saves one of the head's four matmul passes,
# ~24 ms of a 0.96 s step on an H200, for 4.4 GB held from the head's forward to its backward.
DEFAULT_KEEP_LOGITS_BYTES = 8 << 30


def _acc(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision logits, float64 stays float64 (tests)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float, with_entropy: bool):
    """Off GPU; on GPU ``head_kernel.row_stats`` computes the same in one pass over the logits."""
    z = logits.to(_acc(logits.dtype)) * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, lse, None
    p = torch.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(-1)
    return logprobs, lse, entropy


def _dense_grad_logits(logits: torch.Tensor, inv_temp: float, lse: torch.Tensor, entropy: torch.Tensor | None,
                       grad_lp: torch.Tensor, grad_ent: torch.Tensor | None) -> torch.Tensor:
    """d loss / d logits without the one-hot term of the log-prob, in the accumulation dtype."""
    log_p = logits.to(_acc(logits.dtype)) * inv_temp - lse[:, None]
    p = torch.exp(log_p)
    coef = grad_lp[:, None]
    if grad_ent is not None:
        coef = coef + grad_ent[:, None] * (log_p + entropy[:, None])
    return -p * coef * inv_temp


def _chunk_grad_logits(logits: torch.Tensor, inv_temp: float, lse: torch.Tensor, entropy: torch.Tensor | None,
                       grad_lp: torch.Tensor, grad_ent: torch.Tensor | None) -> torch.Tensor:
    """d loss / d logits without the one-hot term of the log-prob (added sparsely by the caller)."""
    return _dense_grad_logits(logits, inv_temp, lse, entropy, grad_lp, grad_ent).to(logits.dtype)


def _chunk_grad_logits_into(logits: torch.Tensor, inv_temp: float, lse: torch.Tensor, entropy: torch.Tensor | None,
                            grad_lp: torch.Tensor, grad_ent: torch.Tensor | None, targets: torch.Tensor) -> None:
    """d loss / d logits, the one-hot term included (``targets`` relative to this slice's first
    column), written over ``logits`` in place: a kept slice is read once and never again."""
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    onehot = torch.where(hit, grad_lp[:, None] * inv_temp, 0.0)
    # Added before the one rounding to the logits' dtype: where p of the target is near 1 the two
    # terms nearly cancel.
    logits.copy_(_dense_grad_logits(logits, inv_temp, lse, entropy, grad_lp, grad_ent) + onehot)


_COMPILED: dict = {}


def _fused(fn, logits: torch.Tensor):
    """On CUDA, ``fn`` compiled (its elementwise passes over a chunk's logits fuse into few
    kernels, and fewer fp32 temporaries live at once); elsewhere ``fn`` itself. The row count
    stays dynamic (it changes with every batch) and the vocabulary width static: a symbolic
    width made every element's row index an integer division (the backward's kernel ran at a
    fifth of memory bandwidth), and the head has at most two widths (a slice and the last)."""
    if logits.device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    torch._dynamo.mark_static(logits, 1)
    return _COMPILED[fn]


class _ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk, with_entropy, keep_logits_bytes):
        n = hidden.shape[0]
        acc = _acc(hidden.dtype)
        logprobs = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc) if with_entropy else None
        keep = n * weight.shape[0] * hidden.element_size() <= keep_logits_bytes
        # Kept: one matmul for all rows (and on GPU one pass of the statistics kernel over them);
        # otherwise chunk by chunk.
        kept = hidden @ weight.t() if keep else None
        step = n if keep and hidden.is_cuda else chunk
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            logits = kept[lo:hi] if keep else hidden[lo:hi] @ weight.t()
            if logits.is_cuda:
                from kuberl.train import head_kernel  # Triton: only where there is a GPU

                head_kernel.row_stats(logits, targets[lo:hi], inv_temp, with_entropy, logprobs[lo:hi],
                                      lse[lo:hi], entropy[lo:hi] if with_entropy else None)
                continue
            lp, l, ent = _chunk_forward(logits, targets[lo:hi], inv_temp, with_entropy)
            logprobs[lo:hi], lse[lo:hi] = lp, l
            if with_entropy:
                entropy[lo:hi] = ent
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if with_entropy else lse,
                              kept if keep else lse)
        ctx.inv_temp, ctx.chunk, ctx.with_entropy, ctx.kept = inv_temp, chunk, with_entropy, keep
        if with_entropy:
            return logprobs, entropy
        no_entropy = torch.zeros_like(logprobs)
        ctx.mark_non_differentiable(no_entropy)
        return logprobs, no_entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, lse, entropy, kept = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        if not ctx.with_entropy:
            grad_ent, entropy = None, None
        grad_lp = grad_lp if grad_lp is not None else torch.zeros_like(lse)
        acc = lse.dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        # Chunked over the vocabulary (the forward's lse and entropy make each slice of a row's
        # gradient computable alone): each slice of grad_weight is one matmul over all rows,
        # written once. Chunks of rows would each add a [vocab x hidden] partial sum into an fp32
        # accumulator, a cast and an add of the whole matrix per chunk (at vocab 151,936, 14
        # chunks: ~60 ms a step on an H200). A logits chunk holds about ``chunk`` rows' worth; on
        # GPU its width is a multiple of 128 (a width of 10,852 ran cuBLAS's unaligned sm80
        # kernels at a third of the speed).
        align = 128 if weight.is_cuda else 1
        width = max(align, chunk * vocab // max(n, 1) // align * align)
        if ctx.kept:
            # The kept logits become d loss / d logits, slice by slice in place (one-hot term
            # included); then each gradient is one matmul over the whole vocabulary, in the compute
            # dtype. Per slice, a partial product of grad_hidden added into fp32 and grad_weight's
            # slice copied into fp32, then both cast back: ~7 ms of kernels a step in an H200
            # profile (issue 36).
            # A second backward (retain_graph) fails on the saved tensor's version, as autograd
            # checks it. On GPU one Triton pass over all of them (head_kernel.grad_logits_: the
            # compiled slices below ran at 1.2 TB/s, ~19 ms of an H200 step's kernels).
            if kept.is_cuda:
                from kuberl.train import head_kernel

                head_kernel.grad_logits_(kept, inv_temp, lse, entropy, grad_lp, grad_ent, targets)
            else:
                for lo in range(0, vocab, width):
                    logits = kept[:, lo:min(vocab, lo + width)]
                    _fused(_chunk_grad_logits_into, logits)(logits, inv_temp, lse, entropy, grad_lp, grad_ent,
                                                            targets - lo)
            return kept @ weight, kept.t() @ hidden, None, None, None, None, None
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        for lo in range(0, vocab, width):
            hi = min(vocab, lo + width)
            w = weight[lo:hi]
            logits = kept[:, lo:hi] if ctx.kept else hidden @ w.t()
            g = _fused(_chunk_grad_logits, logits)(logits, inv_temp, lse, entropy, grad_lp, grad_ent)
            grad_hidden += g @ w
            grad_weight[lo:hi] = g.t() @ hidden
        # The one-hot term of d log p_t / dz, sparse: row i adds grad_lp[i] * inv_temp at column t_i.
        onehot = (grad_lp * inv_temp)[:, None]
        grad_hidden += onehot * weight[targets].to(acc)
        grad_weight.index_add_(0, targets, onehot * hidden.to(acc))
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None


def chunked_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                             with_entropy: bool = True, keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden`` ``(n, H)``, ``weight`` ``(V, H)``, ``targets`` ``(n,)``: fp32 ``log p(target)``
    and (``with_entropy``) entropy per row of ``softmax(hidden @ weight.T / temperature)``.
    Logits of at most ``keep_logits_bytes`` are kept for backward, larger ones recomputed there."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lp, ent = _ChunkedLogProbEntropy.apply(hidden, weight, targets, 1.0 / temperature, chunk_tokens, with_entropy,
                                           keep_logits_bytes)
    return lp, ent if with_entropy else None


def full_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float = 1.0, with_entropy: bool = True):
    """The unchunked reference: all logits, their fp32 log-softmax, kept for autograd."""
    logits = hidden @ weight.t()
    log_p = torch.log_softmax(logits.to(_acc(logits.dtype)) / temperature, dim=-1)
    lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    return lp, (-(log_p.exp() * log_p).sum(-1) if with_entropy else None)


@dataclass
class LogProbRequest:
    """Rows of the flattened ``(batch * length)`` hidden states to score, and their targets."""

    rows: torch.Tensor
    targets: torch.Tensor
    temperature: float
    with_entropy: bool


class TokenLogProbHead(nn.Module):
    """Drop-in for a bias-free ``lm_head``: plain logits, or with ``request`` set, a ``(rows, 2)``
    tensor of log-prob and entropy (entropy 0 when not requested) for the requested rows only.
    ``chunk_tokens`` 0 computes them through full logits (the unchunked reference)."""

    def __init__(self, weight: nn.Parameter, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__()
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        self.request: LogProbRequest | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return F.linear(hidden, self.weight)
        flat = hidden.reshape(-1, hidden.shape[-1])[req.rows]
        weight = self.weight
        if torch.is_autocast_enabled(flat.device.type):
            # Under autocast (one unsharded rank) the chunked head gets the compute dtype as it
            # does under FSDP2 mixed precision: its backward runs outside autocast, where fp32
            # inputs would make every recomputed logits matmul an fp32 one.
            dtype = torch.get_autocast_dtype(flat.device.type)
            flat, weight = flat.to(dtype), weight.to(dtype)
        if self.chunk_tokens:
            lp, ent = chunked_logprobs_entropy(flat, weight, req.targets, temperature=req.temperature,
                                               chunk_tokens=self.chunk_tokens, with_entropy=req.with_entropy)
        else:
            lp, ent = full_logprobs_entropy(flat, weight, req.targets, temperature=req.temperature,
                                            with_entropy=req.with_entropy)
        return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)


def use_logprob_head(model: nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> TokenLogProbHead:
    """Swap ``model.lm_head`` for a ``TokenLogProbHead`` sharing its weight (tied stays tied)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise NotImplementedError(f"{type(model).__name__}: output head {type(head).__name__} is not a bias-free "
                                  f"Linear; the chunked log-prob head supports only that")
    ours = TokenLogProbHead(head.weight, chunk_tokens)
    model.set_output_embeddings(ours)
    return ours


def score_tokens(model: nn.Module, model_inputs: dict, rows: torch.Tensor, cols: torch.Tensor,
                 targets: torch.Tensor, grid_shape: tuple[int, int], *, temperature: float,
                 with_entropy: bool):
    """Run ``model`` and return ``(logprobs, entropy, output)`` as ``grid_shape`` grids (zeros
    outside the scored positions). Position ``(r, c)`` of the grid is hidden state ``(r, c)`` of
    the input, predicting ``targets`` at that position."""
    head = model.get_output_embeddings()
    if not isinstance(head, TokenLogProbHead):
        raise TypeError("score_tokens needs the model built with use_logprob_head")
    length = model_inputs["input_ids"].shape[1]
    head.request = LogProbRequest(rows=rows * length + cols, targets=targets, temperature=temperature,
                                  with_entropy=with_entropy)
    try:
        out = model(**model_inputs)
    finally:
        head.request = None
    scored = out.logits
    zeros = scored.new_zeros(grid_shape)
    logprobs = zeros.index_put((rows, cols), scored[:, 0])
    entropy = zeros.index_put((rows, cols), scored[:, 1]) if with_entropy else None
    return logprobs, entropy, out
