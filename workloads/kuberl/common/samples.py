"""What flows between rollout and training: one sampled response, and a batch of them.

Engines produce ``Sample`` objects (token ids, the sampling policy's log-probs, the weight version
that produced them); the driver scores and groups them; trainers consume ``TrainBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SampleError(ValueError):
    """A sample cannot be trained on; the message says which sample and what is wrong."""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    # Log-probs of ``response_ids`` under the sampling policy (one per response token), or None.
    response_logprobs: list[float] | None = None
    # Which weights produced the sample, whole (no weight update reaches an engine with a request
    # in flight): the model after that many training steps, 0 the initial one.
    weight_version: int = 0
    # The prompt's position in the step's prompt list: samples with the same index form a GRPO group.
    group: int = 0
    finish_reason: str = ""
    prompt_text: str = ""
    response_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    # Response positions that are trained on (1) or not (0, e.g. tool output in agent rollouts).
    loss_mask: list[int] | None = None
    metadata: dict = field(default_factory=dict)

    def validate(self, index: int = 0) -> None:
        where = f"sample {index} (group {self.group})"
        if not self.prompt_ids:
            raise SampleError(f"{where}: empty prompt")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise SampleError(f"{where}: {len(self.response_logprobs)} log-probs for "
                              f"{len(self.response_ids)} response tokens")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_ids):
            raise SampleError(f"{where}: loss_mask has {len(self.loss_mask)} entries for "
                              f"{len(self.response_ids)} response tokens")


@dataclass
class TrainBatch:
    """Samples ready for the policy loss. Lists, not tensors: it crosses Ray without torch."""

    samples: list[Sample]
    # Per sample, per response token: log-probs under the policy before this step's update
    # (recomputed by the trainer with training numerics) and under the reference policy.
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """Rank ``rank``'s contiguous share; the batch size must divide evenly."""
        if len(self.samples) % world_size:
            raise SampleError(f"{len(self.samples)} samples do not split over {world_size} trainer ranks")
        per = len(self.samples) // world_size
        lo, hi = rank * per, (rank + 1) * per
        return TrainBatch(
            samples=self.samples[lo:hi],
            old_logprobs=self.old_logprobs[lo:hi] if self.old_logprobs is not None else None,
            ref_logprobs=self.ref_logprobs[lo:hi] if self.ref_logprobs is not None else None,
        )
