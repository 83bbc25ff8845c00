"""Held-out validation (``spec.validation``): the current policy's responses to a separate file,
sampled with their own parameters (greedy by default), scored by the job's reward function; with
``spec.agent``, whole episodes (the environment or harness, every turn sampled with the
validation's parameters), scored by the episodes' own rewards.

Reported as ``val/reward`` (mean reward over every sample) and, when ``validation.n`` > 1,
``val/pass@<n>`` (the share of prompts with at least one sample whose reward reaches
``passThreshold``), plus ``val/response_length``; in the driver's log, the metrics file, the
trackers, Prometheus and ``status.progress.validationReward``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from kuberl.api.types import RolloutSpec, ValidationSpec
from kuberl.common.prompts import Prompt
from kuberl.driver.rewards import RewardInput
from kuberl.rollout.transitions import EpisodeSampling

log = logging.getLogger("kuberl.train")


def pass_at_n(rewards: Sequence[float], groups: Sequence[int], threshold: float) -> float:
    """The share of groups (prompts) with at least one reward >= ``threshold``."""
    passed: dict[int, bool] = {}
    for reward, group in zip(rewards, groups, strict=True):
        passed[group] = passed.get(group, False) or reward >= threshold
    return sum(passed.values()) / len(passed) if passed else 0.0


class Validator:
    """``prompt_ids`` turns a prompt's chat messages into token ids (the driver's own function, so
    training and validation prompts are built alike); ``reward_fn`` scores ``RewardInput`` lists."""

    def __init__(self, spec: ValidationSpec, prompts: list[Prompt], *, engines: Any, tokenizer: Any,
                 reward_fn: Callable[[list[RewardInput]], list[float]] | None,
                 prompt_ids: Callable[[Sequence[dict]], list[int]], rollout: RolloutSpec, seed: int,
                 agent: Any = None):
        self.spec = spec
        self.prompts = prompts[:spec.max_prompts] if spec.max_prompts else prompts
        self.engines = engines
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.prompt_ids = prompt_ids
        self.max_tokens = spec.max_response_length or rollout.max_response_length
        self.rollout = rollout  # the engines' context caps each response below max_tokens
        self.seed = seed
        # With spec.agent: validation runs episodes (kuberl.rollout.agents.episodes.AgentRollout)
        # under the validation's sampling, and the episodes' rewards replace reward_fn's.
        self.agent = agent

    def due(self, step: int, total_steps: int) -> bool:
        """Before training (step 0) when asked, every ``intervalSteps`` and after the last step."""
        if step == 0:
            return self.spec.before_training
        return step % self.spec.interval_steps == 0 or step == total_steps

    def run(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        rewards, lengths, group_of = self._episodes() if self.agent is not None else self._responses()
        metrics = {"val/reward": sum(rewards) / len(rewards),
                   "val/response_length": sum(lengths) / len(lengths),
                   "val/seconds": time.perf_counter() - started}
        if self.spec.n > 1:
            metrics[f"val/pass@{self.spec.n}"] = pass_at_n(rewards, group_of, self.spec.pass_threshold)
        log.info("validation step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        return metrics

    def _episodes(self) -> tuple[list[float], list[int], list[int]]:
        """``n`` agent episodes per prompt: their rewards, their model tokens (tool and environment
        tokens are not the policy's) and their prompts' indices."""
        sampling = EpisodeSampling(temperature=self.spec.temperature, top_p=self.spec.top_p, top_k=self.spec.top_k,
                                   stop=tuple(self.spec.stop),
                                   max_tokens=self.spec.max_response_length or self.agent.max_tokens)
        groups = self.agent.generate(self.prompts, self.spec.n, self.seed, sampling=sampling)
        samples = [(index, sample) for index, group in enumerate(groups) for sample in group]
        return ([s.reward for _, s in samples], [sum(s.loss_mask or [1] * len(s.response_ids)) for _, s in samples],
                [index for index, _ in samples])

    def _responses(self) -> tuple[list[float], list[int], list[int]]:
        """``n`` single responses per prompt, scored by ``spec.reward``."""
        ids = [self.prompt_ids(p.messages) for p in self.prompts]
        groups = self.engines.generate(ids, self.spec.n, temperature=self.spec.temperature,
                                       max_tokens=self.max_tokens, seed=self.seed, top_p=self.spec.top_p,
                                       top_k=self.spec.top_k, stop=self.spec.stop or None)
        inputs, group_of = [], []
        for index, (prompt, group) in enumerate(zip(self.prompts, groups, strict=True)):
            for sample in group:
                inputs.append(RewardInput(
                    prompt=prompt.text, response=self.tokenizer.decode(sample.response_ids, skip_special_tokens=True),
                    answer=prompt.answer, data_source=prompt.data_source, extra_info=prompt.extra_info,
                    prompt_tokens=len(sample.prompt_ids), response_tokens=len(sample.response_ids),
                    max_response_tokens=self.rollout.response_limit(len(sample.prompt_ids), self.max_tokens),
                    finish_reason=sample.finish_reason, group=index))
                group_of.append(index)
        return self.reward_fn(inputs), [x.response_tokens for x in inputs], group_of
