"""The algorithm seam: what an RL algorithm decides, as one object per algorithm.

An ``Algorithm`` says, on the driver's side, how rewards become advantages (``advantages``), how
rewards are shaped before that (``shape_rewards``), which groups a step trains on
(``keep_group``; ``kuberl.driver.sampling`` refills the batch when it drops some) and
which log-probs the trainer must compute (``logprobs``); on the trainer's side, the policy loss of
one micro-batch (``policy_loss``: importance ratio, clip and aggregation). Algorithms hold no
state: the hyper-parameters come from ``spec.algorithm`` (driver) or ``TrainerConfig`` (trainer).

Aggregation and distributed training: each micro-batch's loss is its share of the whole
update's loss, so that the shares of every micro-batch on every rank add up to it. The divisors
are therefore the update's totals (``UpdateTotals``: trained tokens and trained sequences summed
over all micro-batches and ranks), never a micro-batch's own counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from kuberl.train import loss as L


@dataclass(frozen=True)
class UpdateTotals:
    """What one optimizer update trains on, over all its micro-batches and ranks."""

    tokens: torch.Tensor         # trained response tokens (the loss mask's sum)
    sequences: torch.Tensor      # samples with at least one trained token
    max_response_tokens: int | None = None  # rollout.maxResponseLength: dr-grpo's constant


class Algorithm:
    name: ClassVar[str]

    # --- the driver's side -------------------------------------------------------------------

    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """Per-sample advantages from per-sample rewards; samples of a group share ``group_ids``."""
        raise NotImplementedError

    def shape_rewards(self, rewards: list[float], response_tokens: list[int], *, response_limits: Sequence[int],
                      overlong_buffer: int, overlong_penalty: float) -> list[float]:
        """The rewards advantages are computed from; the reward function's by default.
        ``response_limits`` is each sample's longest possible response (``rollout.maxResponseLength``,
        less with a ``maxTotalLength`` budget its prompt took part of)."""
        return rewards

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Whether a group is trained on, from its reward function values (before shaping);
        every group by default."""
        return True

    def logprobs(self, kl_coef: float) -> tuple[str, ...]:
        """The log-probs the update needs: ``old`` (the behaviour policy's, for the importance
        ratio) always, ``ref`` (the reference policy's) when the KL term is on."""
        return ("old", "ref") if kl_coef > 0 else ("old",)

    # --- the trainer's side ------------------------------------------------------------------

    def policy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, sequence_index: torch.Tensor, totals: UpdateTotals, *,
                    clip_low: float, clip_high: float, tis: L.TruncatedIS | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the update's policy loss and detached metric sums
        (``clipped_tokens``). Grids are ``(rows, positions)``; ``advantages`` is per sample
        ``(rows,)`` or per position; ``sequence_index`` gives each position's sample within the
        micro-batch (packed rows hold several). ``tis`` (``algorithm.tis``) weights each term by
        its truncated importance weight against the engines' policy, at the level of the
        algorithm's ratio."""
        raise NotImplementedError


def token_ratio_loss(logprobs, old_logprobs, advantages, mask, *, clip_low: float, clip_high: float,
                     divisor: torch.Tensor, tis: L.TruncatedIS | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO clipped surrogate with a per-token ratio (and per-token truncated importance
    weight), summed over trained tokens and divided by ``divisor`` (the update's token count:
    token-mean; a constant: token-sum normalised)."""
    return L.policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, total_tokens=divisor,
                         tis=tis)

