"""Mini-batch policy updates: several optimizer steps per rollout batch, as PPO and GRPO run them.

The driver computes ``old_logprobs`` once, under the behaviour policy (the weights that produced
the rollouts), before the first update. The batch is then cut into mini-batches of whole groups
(``algorithm.miniBatchSize`` prompts each) and every mini-batch is one optimizer update; with
``algorithm.updateEpochs`` > 1 the pass repeats. From the second update on the weights differ
from the behaviour policy, the importance ratio moves away from 1 and the PPO clip
(``clipRatioLow``/``clipRatioHigh``) binds; with a single update it cannot, unless asynchronous
(``maxStaleness``, ``asyncRollout``): then the rollout is up to maxStaleness steps older than the
weights and ``old_logprobs`` are the engines' own (``kuberl.driver.schedule``).

The algorithm (``kuberl.train.algorithms``) composes here: the driver computes the log-probs
and advantages it asks for, and each update's loss on the trainer is the algorithm's.
"""

from __future__ import annotations

from typing import Any, Protocol

from kuberl.common.samples import TrainBatch

# Per-update metrics averaged over updates weighted by their trained tokens (each is a token mean).
TOKEN_MEANS = ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clip_frac", "tis_ratio", "tis_truncated_frac")


class Trainer(Protocol):
    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...


def mini_batches(batch: TrainBatch, prompts_per_update: int) -> list[TrainBatch]:
    """Contiguous runs of whole groups, ``prompts_per_update`` groups each, in batch order (the
    step's prompt order is already a seeded shuffle). Groups are never split: the advantages of a
    group are relative to each other."""
    groups: list[int] = []
    for sample in batch.samples:
        if not groups or groups[-1] != sample.group:
            groups.append(sample.group)
    if len(set(groups)) != len(groups):
        raise ValueError("mini_batches: samples of a group must be contiguous in the batch")
    if len(groups) % prompts_per_update:
        raise ValueError(f"{len(groups)} prompts do not split into mini-batches of {prompts_per_update} "
                         f"(algorithm.miniBatchSize must divide promptsPerStep)")
    out = []
    for lo in range(0, len(groups), prompts_per_update):
        members = set(groups[lo:lo + prompts_per_update])
        keep = [i for i, s in enumerate(batch.samples) if s.group in members]
        out.append(TrainBatch(
            samples=[batch.samples[i] for i in keep],
            old_logprobs=[batch.old_logprobs[i] for i in keep] if batch.old_logprobs is not None else None,
            ref_logprobs=[batch.ref_logprobs[i] for i in keep] if batch.ref_logprobs is not None else None))
    return out


def merge_update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates: token-weighted means of the loss terms and the clip
    fraction, the mean and max gradient norm, the last learning rate and counters."""
    tokens = [u["tokens"] for u in updates]
    total = sum(tokens) or 1.0
    out: dict[str, float] = {name: sum(u[name] * n for u, n in zip(updates, tokens)) / total for name in TOKEN_MEANS}
    norms = [u["grad_norm"] for u in updates]
    out.update(grad_norm=sum(norms) / len(norms), grad_norm_max=max(norms), lr=updates[-1]["lr"],
               tokens=float(sum(tokens)),  # trained tokens over all updates (epochs repeat them)
               skipped=float(sum(u["skipped"] for u in updates)), skipped_total=updates[-1]["skipped_total"],
               optimizer_steps=updates[-1]["optimizer_steps"], updates=float(len(updates)),
               # Inside update_seconds: the first update waiting for the last checkpoint's copy.
               checkpoint_wait_seconds=sum(u["checkpoint_wait"] for u in updates))
    return out


def policy_updates(trainer: Trainer, batch: TrainBatch, algorithm: Any) -> dict[str, float]:
    """Run the step's updates (``updateEpochs`` passes over mini-batches of ``miniBatchSize``
    prompts); ``batch.old_logprobs`` must already hold the behaviour policy's log-probs."""
    if batch.old_logprobs is None:
        raise ValueError("policy_updates needs batch.old_logprobs from the behaviour policy "
                         "(computed before the first update)")
    per_update = algorithm.mini_batch_size or algorithm.prompts_per_step
    parts = mini_batches(batch, per_update)
    return merge_update_metrics([trainer.train_step(part)
                                 for _ in range(algorithm.update_epochs) for part in parts])
