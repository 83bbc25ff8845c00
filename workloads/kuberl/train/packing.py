"""Packed variable-length micro-batches: samples laid end to end in one row, no padding.

RL responses range from a few tokens to ``maxResponseLength``; padding each micro-batch to its
longest sample spends compute on pad tokens. Packed, a micro-batch is one row of the samples'
tokens back to back, position ids restart at 0 for each sample, and attention is causal within
each sample only (document masking). Micro-batches are filled up to a token budget
(``micro_batch_tokens``) instead of a fixed sample count.

Attention goes through ``PACKED_ATTENTION``, registered with transformers' ``AttentionInterface``:
with ``cu_seq_lens_q`` in the forward kwargs it runs varlen attention (CUDA: PyTorch's own
flash-attention varlen kernel, ``torch.nn.attention.varlen``; a row whose documents all have one
length runs as a batch of causal rows through SDPA instead, cuDNN's kernels first), otherwise a block-diagonal causal
mask through SDPA (CPU, and GPUs without the varlen kernel). Without packing kwargs it is plain
causal SDPA: right-padded rows need no mask under causal attention, since no real token attends
to a later position. transformers builds no mask for an attention implementation it does not
know, so none of the ``[length x length]`` masks is ever allocated here. The attention call is
traced into each compiled decoder layer (one graph per layer; a varlen ``max_length`` that
changes between micro-batches becomes a dynamic int after the first recompile).
"""

from __future__ import annotations

import inspect
from itertools import chain

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PACKED_ATTENTION = "kuberl_packed"
# The model config attribute set from ``ModelOptions.uniform_sdpa``.
UNIFORM_SDPA_ATTR = "kuberl_uniform_sdpa"


def split_by_tokens(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` ranges of samples whose lengths sum to at most ``budget`` (a
    longer sample gets a range of its own). Order is kept, so results map back to samples."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    ranges, lo, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and used + n > budget:
            ranges.append((lo, i))
            lo, used = i, 0
        used += n
    if lo < len(lengths):
        ranges.append((lo, len(lengths)))
    return ranges


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# Read once at import: inspecting inside the compiled decoder layer would break its graph.
_VARLEN_PARAMS = frozenset(inspect.signature(_varlen()).parameters) if _varlen() is not None else frozenset()


def flash_varlen_attention(query, key, value, cu, max_len, scaling):
    """PyTorch's FlashAttention-2 varlen kernel: ``(1, heads, T, D)`` -> ``(1, T, heads, D)``."""
    varlen_attn = _varlen()
    # (1, heads, T, D) -> (T, heads, D)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    params = _VARLEN_PARAMS
    groups = q.shape[1] // k.shape[1]
    kwargs = {"scale": scaling} if "scale" in params else {}
    if groups > 1:
        if "enable_gqa" in params:  # torch >= 2.12
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:  # causal as a window (torch >= 2.11)
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return out.unsqueeze(0)  # (1, T, heads, D)


# SDPA's order of preference for rows of equal-length documents: cuDNN's fused flash attention
# first (its Hopper kernels: 1.17 ms forward, 3.38 ms backward against FlashAttention-2 varlen's
# 2.01 / 5.31 at 4 x 4096 tokens, 32 heads of 128 on an H200, bench/packed_attention.py), as
# torchtitan asks for it.
_UNIFORM_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]


def uniform_sdpa_attention(query, key, value, docs, scaling):
    """A packed row of ``docs`` documents of one length as a batch of ``docs`` causal rows (no
    padding, so no mask): ``(1, heads, T, D)`` -> ``(1, T, heads, D)``."""
    _, heads, length, dim = query.shape

    def rows(t):  # (1, h, T, D) -> (docs, h, T / docs, D)
        return t[0].unflatten(1, (docs, length // docs)).transpose(0, 1)

    # K/V keep their own heads: SDPA's enable_gqa lets cuDNN read each K/V head for its group of
    # query heads. The kernel times match those with K/V repeated to every head within two runs'
    # noise (bench/packed_attention.py, H200); what goes is the repeat and its backward, a sum
    # over each group (15 ms of a 0.9 s step at the dense preset).
    with sdpa_kernel(_UNIFORM_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(rows(query), rows(key), rows(value), is_causal=True, scale=scaling,
                                             enable_gqa=heads != key.shape[1])
    return out.transpose(1, 2).reshape(1, length, heads, dim)


def _masked_sdpa_attention(query, key, value, cu, scaling):
    length = query.shape[2]
    doc = torch.searchsorted(cu[1:], torch.arange(length, device=query.device), right=True)
    pos = torch.arange(length, device=query.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention interface: ``query`` ``(B, heads, T, D)`` -> ``((B, T, heads, D), None)``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got batch {query.shape[0]}")
    if torch.is_autocast_enabled(query.device.type):
        # One unsharded rank trains under autocast: rotary embeddings leave q and k in fp32, and
        # the varlen kernels take only half precision.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    docs, longest = cu.shape[0] - 1, kwargs["max_length_q"]
    if longest * docs == query.shape[2] and getattr(getattr(module, "config", None), UNIFORM_SDPA_ATTR, True):
        out = uniform_sdpa_attention(query, key, value, docs, scaling)
    elif query.is_cuda and _varlen() is not None:
        out = flash_varlen_attention(query, key, value, cu, longest, scaling)
    else:
        out = _masked_sdpa_attention(query, key, value, cu, scaling)
    return out, None


def register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the GPU. torch synchronizes the stream after
    a host-to-GPU copy with ``non_blocking=False`` (and a copy from pageable memory cannot be
    asynchronous), so a micro-batch's inputs copied while the previous one's backward runs drained
    the queue first and the next kernels started on an idle GPU (bench/gpu_gaps.py's profile,
    issue 36). From pinned memory the copy is queued like a kernel; torch's caching host allocator
    keeps the pinned block until the copy has run."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def attention_kwargs(lengths: list[int], device: torch.device) -> dict:
    """Model forward kwargs that make ``PACKED_ATTENTION`` treat one row as these documents."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    cu = to_device(cu, device)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def position_ids(lengths: list[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.cat([torch.arange(n) for n in lengths])[None], device)


def packed_fields(samples, old_logprobs, ref_logprobs, device: torch.device,
                  weights: list[float] | None = None, behaviour_logprobs=None) -> dict:
    """The tensors of one packed micro-batch (``worker.MicroBatch`` fields): every grid is
    ``(1, T-1)``, position t predicting token t+1; the positions that cross from one sample into
    the next are never in the mask. Advantages are per token (each sample's on its own tokens)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = sum(lengths) - 1
    # numpy reads the token lists three times faster than torch.tensor (host time before the
    # step's first kernel).
    tokens = chain.from_iterable(part for s in samples for part in (s.prompt_ids, s.response_ids))
    ids = torch.from_numpy(np.fromiter(tokens, dtype=np.int64, count=width + 1))[None]
    mask = torch.zeros(1, width)
    advantages = torch.zeros(1, width)
    old = torch.zeros(1, width) if old_logprobs is not None else None
    ref = torch.zeros(1, width) if ref_logprobs is not None else None
    behaviour = torch.zeros(1, width) if behaviour_logprobs is not None else None
    starts, offset = [], 0
    for i, (s, n) in enumerate(zip(samples, lengths)):
        start = offset + len(s.prompt_ids) - 1
        end = start + len(s.response_ids)
        starts.append(start)
        w = 1.0 if weights is None else weights[i]
        mask[0, start:end] = w * (torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask is not None else 1.0)
        advantages[0, start:end] = s.advantage
        if old is not None:
            old[0, start:end] = torch.tensor(old_logprobs[i], dtype=torch.float32)
        if ref is not None:
            ref[0, start:end] = torch.tensor(ref_logprobs[i], dtype=torch.float32)
        if behaviour is not None:
            behaviour[0, start:end] = torch.tensor(behaviour_logprobs[i], dtype=torch.float32)
        offset += n
    ids = to_device(ids, device)
    return dict(
        input_ids=ids, attention_mask=None, targets=ids[:, 1:],
        mask=to_device(mask, device), response_lengths=[len(s.response_ids) for s in samples],
        response_starts=starts, response_rows=[0] * len(samples), advantages=to_device(advantages, device),
        old_logprobs=to_device(old, device) if old is not None else None,
        ref_logprobs=to_device(ref, device) if ref is not None else None,
        behaviour_logprobs=to_device(behaviour, device) if behaviour is not None else None,
        position_ids=position_ids(lengths, device), attention_kwargs=attention_kwargs(lengths, device),
    )
