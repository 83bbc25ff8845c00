"""Activation checkpointing of a decoder layer's forward, both ways under torch.compile (the
compiled forward wraps the checkpointed one: ``kuberl.train.model.shard_model``):

- per op (``checkpoint_per_op``), as torchtitan's default for Qwen3: every layer is checkpointed,
  but the outputs of attention and of every other matmul are saved, so backward recomputes only
  the cheap elementwise ops (norms, rotary, SiLU) and half of the matmuls;
- whole layer (``checkpoint_whole``): only the layer's inputs are saved. Traced by the compiler,
  the recomputation becomes part of the compiled backward, which needs to rerun only what the
  gradients read (a layer's last matmuls, attention's output projection and the MLP's down
  projection, feed no gradient), where an eager checkpoint around the compiled forward (the
  library's ``gradient_checkpointing_enable``, which MoE models keep: see ``shard_model``)
  reruns the whole compiled forward. On an H200 at the dense preset, checkpointing every 4th
  layer then cost 44 ms a step over none, as torchtitan's every-4th-block does, against 52-59 ms
  before (docs/benchmarks.md).

None keeps everything."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _saved_ops() -> frozenset:
    """Attention kernels (whichever backend ran) and matmuls; ops this torch lacks are skipped."""
    names = ("aten.mm.default", "aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_flash_attention_for_cpu.default",
             "torch_attn._varlen_attn.default", "aten.max.default")
    ops = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            ops.add(getattr(packet, overload))
    return frozenset(ops)


SAVED_OPS = _saved_ops()
MM = torch.ops.aten.mm.default


def _policy_context():
    # Counted per checkpoint call and per pass, so the forward and its recomputation agree on
    # which matmuls were saved.
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op == MM:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:  # every second one: torchtitan's memory/compute balance
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_whole(forward: Callable) -> Callable:
    """``forward`` under non-reentrant checkpointing, everything recomputed (no policy)."""

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed


def checkpoint_per_op(forward: Callable) -> Callable:
    """``forward`` under non-reentrant checkpointing with the per-op policy above."""

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_policy_context, **kwargs)

    return checkpointed
