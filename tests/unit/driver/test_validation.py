"""When validation runs and what pass@n means (the pure parts of ``kuberl.driver.validation``; the
end-to-end run with a real engine is tests/engine/driver/test_peers_e2e.py)."""

from __future__ import annotations

from kuberl.api.types import RolloutSpec, ValidationSpec
from kuberl.driver.validation import Validator, pass_at_n


def _validator(**spec) -> Validator:
    return Validator(ValidationSpec(uri="/data/val.jsonl", **spec), [], engines=None, tokenizer=None,
                     reward_fn=None, prompt_ids=None, rollout=RolloutSpec(maxResponseLength=16), seed=0)


def test_validation_runs_before_training_at_its_interval_and_after_the_last_step():
    validator = _validator(intervalSteps=4)
    assert [s for s in range(0, 11) if validator.due(s, total_steps=10)] == [0, 4, 8, 10]
    assert not _validator(beforeTraining=False).due(0, total_steps=10)


def test_pass_at_n_counts_prompts_with_a_passing_sample():
    rewards = [0.0, 1.0, 0.0, 0.0, 0.5, 1.0]
    groups = [0, 0, 1, 1, 2, 2]
    assert pass_at_n(rewards, groups, threshold=1.0) == 2 / 3
    assert pass_at_n(rewards, groups, threshold=0.5) == 2 / 3
    assert pass_at_n(rewards, groups, threshold=0.0) == 1.0
