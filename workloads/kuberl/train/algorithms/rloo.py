"""RLOO (Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", arXiv 2402.14740; Kool et al. 2019): each sample's baseline is the
mean reward of the other samples of its prompt, ``A_i = r_i - (1 / (k - 1)) * sum_{j != i} r_j``
(equal to ``k / (k - 1) * (r_i - mean(r))``); a group of one has no baseline and gets 0. The loss
is GRPO's token-mean clipped surrogate, as verl and OpenRLHF run RLOO: with one update per step
the ratio is 1 and it is the paper's REINFORCE gradient with that baseline, averaged per token."""

from __future__ import annotations

import torch

from kuberl.train import loss as L
from kuberl.train.algorithms.base import Algorithm, token_ratio_loss


class RLOO(Algorithm):
    name = "rloo"

    def advantages(self, rewards, group_ids):
        diff, size = L.group_centred(rewards, group_ids)
        return torch.where(size > 1, diff * size / (size - 1).clamp(min=1), torch.zeros_like(diff))

    def policy_loss(self, logprobs, old_logprobs, advantages, mask, sequence_index, totals, *, clip_low, clip_high,
                    tis=None):
        return token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                divisor=totals.tokens, tis=tis)
