"""GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300): group-normalised advantages
``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the ``groupSize`` samples of a prompt, and the
PPO clipped surrogate with a per-token ratio ``exp(log pi - log pi_old)``, averaged over every
trained token of the update (token-mean, as verl and DAPO aggregate; the paper averages per
sequence first)."""

from __future__ import annotations

from kuberl.train import loss as L
from kuberl.train.algorithms.base import Algorithm, token_ratio_loss


class GRPO(Algorithm):
    name = "grpo"

    def advantages(self, rewards, group_ids):
        return L.group_advantages(rewards, group_ids)

    def policy_loss(self, logprobs, old_logprobs, advantages, mask, sequence_index, totals, *, clip_low, clip_high,
                    tis=None):
        return token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                divisor=totals.tokens, tis=tis)
