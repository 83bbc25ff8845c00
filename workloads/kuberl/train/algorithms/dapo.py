"""DAPO (Yu et al., "DAPO: an Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476). On top of GRPO's group-normalised advantages:

- clip-higher: separate bounds, ``clip(r, 1 - eps_low, 1 + eps_high)`` with eps_high 0.28 > 0.2,
  so low-probability tokens can still rise (against entropy collapse);
- token-level policy gradient loss: clipped surrogates averaged over every trained token of the
  batch, so long responses weigh by their tokens;
- dynamic sampling: groups whose rewards are all equal (the paper: accuracy 0 or 1; here the
  reward function's values, before shaping) give no gradient; they are dropped and the batch is
  refilled with new prompts (``kuberl.driver.sampling``, at most ``maxRefillRounds``
  extra rounds);
- soft overlong punishment: over the last ``L_cache`` = ``overlongBuffer`` tokens before
  ``L_max`` = ``rollout.maxResponseLength`` (with a ``rollout.maxTotalLength`` budget, what the
  sample's prompt left of it, if less) the reward falls linearly, ``(L_max - L_cache - |y|) /
  L_cache`` times ``overlongPenalty``, reaching ``-overlongPenalty`` at ``L_max``.
"""

from __future__ import annotations

from kuberl.train import loss as L
from kuberl.train.algorithms.base import Algorithm, token_ratio_loss


def overlong_shaping(response_tokens: int, max_response_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment scaled by ``penalty``: 0 up to ``max - buffer`` tokens,
    then falling linearly to ``-penalty`` at ``max`` (and beyond)."""
    if buffer <= 0:
        return 0.0
    over = response_tokens - (max_response_tokens - buffer)
    if over <= 0:
        return 0.0
    return -penalty * min(over, buffer) / buffer


class DAPO(Algorithm):
    name = "dapo"

    def advantages(self, rewards, group_ids):
        return L.group_advantages(rewards, group_ids)

    def shape_rewards(self, rewards, response_tokens, *, response_limits, overlong_buffer, overlong_penalty):
        return [r + overlong_shaping(n, limit, overlong_buffer, overlong_penalty)
                for r, n, limit in zip(rewards, response_tokens, response_limits, strict=True)]

    def keep_group(self, rewards):
        """Dynamic sampling: a group whose task rewards are all equal (all right or all wrong)
        teaches nothing about the answer."""
        return max(rewards) != min(rewards)

    def policy_loss(self, logprobs, old_logprobs, advantages, mask, sequence_index, totals, *, clip_low, clip_high,
                    tis=None):
        return token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                divisor=totals.tokens, tis=tis)

