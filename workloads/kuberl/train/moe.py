"""Mixture-of-Experts experts that run every expert every step, with a grouped-GEMM fast path.

The stock Hugging Face expert forward loops in Python over the experts that received tokens
(``expert_hit``). Its op sequence therefore depends on routing. Under FSDP2 with non-reentrant
activation checkpointing that is fatal: when the recompute in backward routes differently from
the forward (bf16 GPU kernels are not bit-deterministic), it saves a different number of tensors
and raises ``CheckpointError`` on that rank while the other ranks wait in the next collective:
a hang. Models whose experts are separate modules also leave unhit experts without gradients, so
ranks reduce-scatter different sets of gradients: a mismatch or a hang.

``GroupedExperts`` keeps the same parameters (``gate_up_proj`` ``(E, 2I, H)``, ``down_proj``
``(E, H, I)``: state dicts and Hugging Face exports are unchanged) and computes all experts in one
pass: tokens are sorted by expert and multiplied with ``torch._grouped_mm`` (one kernel for all
experts, bf16 on Hopper, any dtype on CPU). Every tensor it saves has a shape independent of
routing (``tokens x top_k`` rows), it never synchronises with the host, and every expert weight
receives a gradient (zeros for an expert without tokens). ``implementation="loop"`` runs a
Python loop over *all* experts (zero-row matmuls for empty ones), for platforms without
``_grouped_mm``: it issues the same collectives on every rank and gives every expert a gradient,
but its per-expert row counts follow the routing, so a recompute that routes differently still
fails it (tests/engine/train/test_moe_failure.py shows the grouped path surviving that).

With expert parallelism (spec.trainer.parallelism.expert) the weights are DTensors sharded on the
expert dimension, and the rows travel to their experts' ranks and back by all-to-all
(``_expert_parallel``); that path reads the split sizes on the host once per layer.

The swap replaces the ``experts`` submodule of our own model instance; no library module is patched.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

IMPLEMENTATIONS = ("grouped", "loop")


class GroupedExperts(nn.Module):
    """Drop-in for Hugging Face ``*MoeExperts`` with fused ``gate_up_proj`` (gate first) and ``down_proj``."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn: nn.Module,
                 implementation: str = "grouped"):
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"spec.trainer.moe.expertImplementation must be one of {IMPLEMENTATIONS}; "
                             f"got {implementation!r}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.num_experts = gate_up_proj.shape[0]
        self.implementation = implementation

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        # weight (E, out, in) -> (E, in, out) as a transposed view: no copy.
        w = weight.to(x.dtype).transpose(1, 2)
        if self.implementation == "grouped":
            if x.is_cuda and x.dtype != torch.bfloat16:
                raise ValueError(f"grouped experts on GPU compute in bfloat16 (torch._grouped_mm), got {x.dtype}: "
                                 f"set spec.trainer.paramDtype: bfloat16, or spec.trainer.moe.expertImplementation: loop")
            return torch._grouped_mm(x, w, offs=offsets)
        parts = x.split(counts.tolist())
        return torch.cat([parts[e] @ w[e] for e in range(w.shape[0])])

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts[e]`` of them for expert ``e`` of the weights given."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = self._grouped(rows, gate_up_proj, offsets, counts).chunk(2, dim=-1)
        return self._grouped(self.act_fn(gate) * up, down_proj, offsets, counts)

    def _expert_parallel(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism (torchtitan's ``ExpertParallel``): the weights are DTensors sharded
        on the expert dimension over the EP mesh, each rank holding ``num_experts / ep`` whole
        experts. Rows (sorted by expert, so by owning rank) go to their experts' ranks with one
        all-to-all, run through the local experts, and come back with the reverse all-to-all
        (autograd: the backward is the same exchange the other way). The split sizes are read on
        the host: the one synchronisation of this path."""
        mesh = self.gate_up_proj.device_mesh
        group, ep = mesh.get_group(), mesh.size()
        local = self.num_experts // ep
        # received[r * local + e]: rows rank r sends to this rank's local expert e.
        received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group=group))
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = received.view(ep, local).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, group)
        # Arrived grouped by (source rank, local expert): regroup by local expert, stably (each
        # expert's rows in source-rank order, hence deterministic).
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received)
        order = torch.argsort(expert_of_row, stable=True)
        out = self._experts(rows[order], received.view(ep, local).sum(0), self.gate_up_proj.to_local(),
                            self.down_proj.to_local())
        out = out[torch.argsort(order)]
        return funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        # Stable sort: within an expert, rows keep token order (deterministic index_add order).
        order = torch.argsort(flat_experts, stable=True)
        token_of_row = order // top_k
        # Not bincount: its output shape depends on the data, which breaks the compiled layer's
        # graph in two (tests/unit/train/test_moe.py checks the layer traces as one graph).
        counts = flat_experts.new_zeros(self.num_experts).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        rows = hidden_states[token_of_row]
        if torch.is_autocast_enabled(rows.device.type):
            # One unsharded rank trains under autocast, which leaves the residual stream (hence
            # the normed input here) in fp32 and does not cover _grouped_mm.
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        if isinstance(self.gate_up_proj, DTensor):
            out = self._expert_parallel(rows, counts)
        else:
            out = self._experts(rows, counts, self.gate_up_proj, self.down_proj)
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, token_of_row, out.to(final.dtype))


def _is_fused_experts(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("Experts")
            and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
            and isinstance(getattr(module, "down_proj", None), nn.Parameter)
            and module.gate_up_proj.dim() == 3
            and getattr(module, "has_bias", False) is False
            and getattr(module, "is_transposed", False) is False
            and getattr(module, "is_concatenated", True) is True)


def is_moe_config(config) -> bool:
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def use_grouped_experts(model: nn.Module, implementation: str = "grouped") -> int:
    """Swap every fused-experts module of ``model`` for ``GroupedExperts``; returns how many.

    Raises when the model is MoE but has no expert module this path understands, rather than
    silently training with the routing-dependent stock loop.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_fused_experts(child):
                setattr(parent, name, GroupedExperts(child.gate_up_proj, child.down_proj, child.act_fn,
                                                     implementation))
                swapped += 1
    if swapped == 0 and is_moe_config(getattr(model, "config", None)):
        raise NotImplementedError(
            f"{type(model).__name__}: no fused MoE expert module (gate_up_proj (E, 2I, H), down_proj "
            f"(E, H, I)) found; kuberl's every-expert path supports Qwen3-MoE-style experts")
    return swapped


# The child of an MoE block that scores the experts: "gate" (Qwen2/3-MoE, Mixtral, DeepSeek),
# "router" (GPT-OSS).
ROUTER_NAMES = ("gate", "router")


def freeze_routers(model: nn.Module) -> int:
    """spec.trainer.moe.freezeRouter (NeMo-RL's ``freeze_moe_router``): every MoE block's router
    stops training. Its parameters lose ``requires_grad``, so they get no gradient, the
    optimizer (built from the trainable parameters) keeps no state for them, and AdamW's weight
    decay never reaches them: they stay bit-identical over steps, while the experts and the
    dense weights train. Returns how many routers were frozen; raises on a dense model."""
    config = getattr(model, "config", None)
    if not is_moe_config(config):
        raise ValueError(f"spec.trainer.moe.freezeRouter needs a Mixture-of-Experts model; "
                         f"{type(config).__name__} has no experts: remove freezeRouter")
    frozen = 0
    for block in model.modules():
        children = dict(block.named_children())
        router = next((children[n] for n in ROUTER_NAMES if n in children), None)
        if "experts" in children and router is not None:
            router.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise NotImplementedError(f"spec.trainer.moe.freezeRouter: {type(model).__name__} has no MoE block with "
                                  f"an 'experts' module beside a router named one of {ROUTER_NAMES}")
    return frozen
