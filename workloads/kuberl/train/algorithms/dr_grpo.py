"""Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv 2503.20783): GRPO without its two biases. The advantage is not divided by the group's
standard deviation, ``A_i = r_i - mean(r)`` (which over-weights groups that are nearly all right
or all wrong), and the loss is not divided by each response's length (which favours long wrong
answers): per-token clipped surrogates are summed and divided by a constant,
``(1 / (G * L_max)) * sum_i sum_t``, with ``L_max`` = ``rollout.maxResponseLength`` and G the
update's number of sequences, as the paper's code (``masked_sum / generate_max_length``)."""

from __future__ import annotations

from kuberl.train import loss as L
from kuberl.train.algorithms.base import Algorithm, token_ratio_loss


class DrGRPO(Algorithm):
    name = "dr-grpo"

    def advantages(self, rewards, group_ids):
        return L.group_centred(rewards, group_ids)[0]

    def policy_loss(self, logprobs, old_logprobs, advantages, mask, sequence_index, totals, *, clip_low, clip_high,
                    tis=None):
        if not totals.max_response_tokens:
            raise ValueError("dr-grpo normalises by rollout.maxResponseLength; the trainer config has "
                             "no max_response_tokens")
        return token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                divisor=totals.sequences * totals.max_response_tokens, tis=tis)
