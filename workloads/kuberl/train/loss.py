"""Policy-loss terms as plain functions on tensors (the algorithms in
``kuberl.train.algorithms`` compose them).

Shapes: per-token tensors are ``(batch, tokens)``; ``mask`` is 1 where a response token is
trained on. Aggregation is token-level: the sum over every trained token of the batch divided by
the number of such tokens (``total_tokens`` overrides the divisor, so that micro-batches and data
parallel ranks add up to the token mean of the whole step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _divisor(mask: torch.Tensor, total_tokens: float | torch.Tensor | None) -> torch.Tensor:
    if total_tokens is None:
        total_tokens = mask.sum()
    return torch.as_tensor(total_tokens, dtype=torch.float32, device=mask.device).clamp(min=1.0)


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor,
                      total_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    return (values * mask).sum() / _divisor(mask, total_tokens)


@dataclass(frozen=True)
class TruncatedIS:
    """Truncated importance sampling (``algorithm.tis``; Yao et al., "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", 2025): the tokens were drawn by the engines'
    policy ``mu`` (vLLM's numerics, and with asyncRollout a step-older weight version), while the
    PPO ratio is taken against ``pi_old``, the trainer's own log-probs before the update. Each
    token's loss is weighted by ``min(pi_old / mu, cap)``, detached: the off-policy correction,
    truncated so that one token the engine found unlikely cannot dominate the update.

    ``log_ratio`` is ``log pi_old - log mu`` per position (0 outside responses)."""

    log_ratio: torch.Tensor
    cap: float

    def token_weights(self) -> torch.Tensor:
        return torch.exp(self.log_ratio).clamp(max=self.cap)

    def sequence_weights(self, mask: torch.Tensor, sequence_index: torch.Tensor, count: int) -> torch.Tensor:
        """One weight per sequence, for sequence-level ratios (gspo): the geometric mean of its
        token ratios, ``exp(mean_t log(pi_old / mu))``, truncated at ``cap``."""
        tokens = sequence_sums(mask, sequence_index, count).clamp(min=1)
        return torch.exp(sequence_sums(self.log_ratio * mask, sequence_index, count) / tokens).clamp(max=self.cap)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float, clip_high: float, *,
                total_tokens: float | torch.Tensor | None = None,
                tis: TruncatedIS | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped-ratio policy-gradient loss.

    ``advantages`` is per token ``(batch, tokens)`` or per sample ``(batch,)`` (broadcast over
    tokens). Per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(logprobs - old_logprobs)``, times ``tis``'s truncated weight when given. Returns
    the loss and detached metric sums (``clipped_tokens``: tokens where the clipped term was the
    larger one).
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if tis is not None:
        per_token = per_token * tis.token_weights()
    loss = masked_token_mean(per_token, mask, total_tokens)
    with torch.no_grad():
        clipped_tokens = ((clipped > unclipped).to(mask.dtype) * mask).sum()
    return loss, {"clipped_tokens": clipped_tokens}


def sequence_sums(values: torch.Tensor, sequence_index: torch.Tensor, count: int) -> torch.Tensor:
    """Per sequence, the sum of ``values`` over its positions: ``(count,)``. ``sequence_index``
    (same shape as ``values``) names each position's sequence; multiply ``values`` by the mask
    first, so positions outside a response add nothing."""
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
        0, sequence_index.reshape(-1), values.reshape(-1))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *,
               total_tokens: float | torch.Tensor | None = None, clamp: float | None = None) -> torch.Tensor:
    """KL(policy || reference) with the k3 estimator ``exp(ref - lp) - (ref - lp) - 1`` (>= 0,
    unbiased), token-level mean. ``clamp`` caps each token's value (verl and NeMo-RL: 10), so one
    token whose probability collapsed cannot dominate the penalty."""
    log_ratio = ref_logprobs - logprobs
    per_token = torch.exp(log_ratio) - log_ratio - 1.0
    if clamp is not None:
        per_token = per_token.clamp(max=clamp)
    return masked_token_mean(per_token, mask.to(logprobs.dtype), total_tokens)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension, computed in float32."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def _grouped(rewards: torch.Tensor | list[float], group_ids: torch.Tensor | list[int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``r - mean_group``, each sample's group index and each group's size, all in float64: in
    float32 the squares of GRPO's variance overflow from |r| of about 1e19 (the std becomes inf
    and every advantage of the group silently 0), and a large common offset cancels the digits
    that tell the group's rewards apart."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = torch.as_tensor(group_ids)
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} "
                         f"must be 1-D and of the same length")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts_f = counts.to(torch.float64)
    sums = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, rewards)
    return rewards - (sums / counts_f)[inverse], inverse, counts_f


def group_centred(rewards: torch.Tensor | list[float], group_ids: torch.Tensor | list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``r - mean_group`` and each sample's group size, float64; samples of a group share
    ``group_ids`` (dr-grpo's advantage; rloo's scales it by the group size)."""
    centred, inverse, counts = _grouped(rewards, group_ids)
    return centred, counts[inverse]


def group_advantages(rewards: torch.Tensor | list[float], group_ids: torch.Tensor | list[int],
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - mean_group) / (std_group + eps)``, std unbiased (n - 1), as in the
    GRPO paper's implementations; a group of one sample gets std 0 (advantage 0). Float64."""
    centred, inverse, counts = _grouped(rewards, group_ids)
    sq = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, centred * centred)
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(counts))
    return centred / (std[inverse] + eps)
