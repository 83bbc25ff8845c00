"""GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071): the importance
ratio is one per sequence, the geometric mean of its token ratios,
``s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|) = exp(mean_t(log pi - log pi_old))``, clipped
at sequence level, ``max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))``, and the loss
is the mean over the update's sequences. Advantages are GRPO's group-normalised ones. Token ratios
are noisy, and for Mixture-of-Experts models routing differences between the behaviour and the
current policy make them more so; one ratio per sequence keeps the update stable (the paper's
motivation). Its ratios sit near 1, hence the tight default clip ranges of its experiments
(3e-4, 4e-4).
"""

from __future__ import annotations

import torch

from kuberl.train import loss as L
from kuberl.train.algorithms.base import Algorithm


class GSPO(Algorithm):
    name = "gspo"

    def advantages(self, rewards, group_ids):
        return L.group_advantages(rewards, group_ids)

    def policy_loss(self, logprobs, old_logprobs, advantages, mask, sequence_index, totals, *, clip_low, clip_high,
                    tis=None):
        mask = mask.to(logprobs.dtype)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(mask)
        # Sums per sequence; no micro-batch holds more sequences than positions, and that bound
        # is known without reading the index back from the device.
        count = sequence_index.numel()
        tokens = L.sequence_sums(mask, sequence_index, count)
        per_seq = tokens.clamp(min=1)
        log_ratio = L.sequence_sums((logprobs - old_logprobs) * mask, sequence_index, count) / per_seq
        advantage = L.sequence_sums(advantages * mask, sequence_index, count) / per_seq
        ratio = torch.exp(log_ratio)
        unclipped = -advantage * ratio
        clipped = -advantage * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        trained = (tokens > 0).to(logprobs.dtype)
        divisor = torch.as_tensor(totals.sequences, dtype=torch.float32, device=mask.device).clamp(min=1.0)
        per_seq_loss = torch.maximum(unclipped, clipped)
        if tis is not None:  # one weight per sequence, as the ratio is
            per_seq_loss = per_seq_loss * tis.sequence_weights(mask, sequence_index, count)
        loss = (per_seq_loss * trained).sum() / divisor
        with torch.no_grad():
            clipped_tokens = ((clipped > unclipped).to(tokens.dtype) * tokens).sum()
        return loss, {"clipped_tokens": clipped_tokens}
