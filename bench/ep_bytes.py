"""Bytes a trainer rank moves per micro-batch for the MoE experts: plain FSDP2 against expert
parallelism, computed from a model config (no GPU; nothing is measured).

Plain FSDP2 over ``N`` ranks gathers every expert weight before the layer's forward and again
before its backward (``reshard_after_forward``), in the compute dtype, and reduce-scatters the
expert gradients in fp32 (kuberl's ``MixedPrecisionPolicy``): per rank ``(N-1)/N`` of each.
Expert parallelism over ``ep`` ranks sends each token's ``top_k`` hidden rows to their experts'
ranks and back (``all_to_all``), in the forward, again in the recompute when activations are
checkpointed, and twice in the backward: per rank ``(ep-1)/ep`` of the rows leave it. With
``ep < N`` the experts are still FSDP2-sharded over the ``N/ep`` ranks that hold the same ones.

    PYTHONPATH=workloads python bench/ep_bytes.py [--ranks 8] [--tokens 8192]

Defaults: Qwen3-30B-A3B's shape (48 layers, 128 experts of 768, top-8, hidden 2048), bf16.
"""

from __future__ import annotations

import argparse

GB = 1e9


def expert_params(config) -> int:
    # gate_up_proj (E, 2I, H) and down_proj (E, H, I) per MoE layer.
    return config.num_hidden_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size


def fsdp_expert_bytes(config, ranks: int, ep: int, compute_bytes: int = 2, grad_bytes: int = 4) -> float:
    """Per rank and micro-batch: the experts' all-gathers (forward, backward) and reduce-scatter."""
    group = ranks // ep
    if group == 1:
        return 0.0
    local = expert_params(config) / ep
    return (group - 1) / group * local * (2 * compute_bytes + grad_bytes)


def all_to_all_bytes(config, tokens: int, ep: int, recompute: bool = True, compute_bytes: int = 2) -> float:
    """Per rank and micro-batch of ``tokens``: dispatch and combine, forward (and recompute) and backward."""
    if ep == 1:
        return 0.0
    passes = (3 if recompute else 2) * 2
    rows = tokens * config.num_experts_per_tok
    return (ep - 1) / ep * passes * rows * config.hidden_size * compute_bytes * config.num_hidden_layers


def main() -> None:
    from transformers import Qwen3MoeConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank and micro-batch")
    args = parser.parse_args()
    config = Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, moe_intermediate_size=768,
                            num_experts_per_tok=8, hidden_size=2048)
    print(f"expert weights: {expert_params(config) / 1e9:.2f} B parameters, "
          f"{expert_params(config) * 2 / GB:.1f} GB in bf16")
    print(f"{'ep':>4} {'FSDP2 experts GB':>17} {'all-to-all GB':>14} {'total GB':>9}  (per rank, micro-batch of "
          f"{args.tokens} tokens, {args.ranks} ranks)")
    ep = 1
    while ep <= args.ranks:
        fsdp, a2a = fsdp_expert_bytes(config, args.ranks, ep), all_to_all_bytes(config, args.tokens, ep)
        print(f"{ep:>4} {fsdp / GB:>17.1f} {a2a / GB:>14.1f} {(fsdp + a2a) / GB:>9.1f}")
        ep *= 2
    per_token = all_to_all_bytes(config, 1, args.ranks)
    print(f"break-even at ep={args.ranks}: {fsdp_expert_bytes(config, args.ranks, 1) / per_token:,.0f} tokens "
          f"per rank and micro-batch")


if __name__ == "__main__":
    main()
