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


def test_with_an_agent_validation_scores_episodes_sampled_as_the_validation_says():
    from kuberl.common.prompts import Prompt
    from kuberl.common.samples import Sample

    class Agent:  # stands in for AgentRollout: episodes are tests/engine/driver/test_agent_e2e.py's
        max_tokens = 16

        def generate(self, prompts, group_size, seed, sampling=None):
            self.asked = (len(prompts), group_size, seed, sampling)
            return [[Sample(prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 0, 0, 1],
                            reward=float(p.index == 0 and m == 1), group=g) for m in range(group_size)]
                    for g, p in enumerate(prompts)]

    prompts = [Prompt(text=str(i), answer=None, index=i, messages=({"role": "user", "content": str(i)},)) for i in range(2)]
    agent = Agent()
    validator = Validator(ValidationSpec(uri="/data/val.jsonl", n=2, temperature=0.5, stop=["</a>"]), prompts,
                          engines=None, tokenizer=None, reward_fn=None, prompt_ids=None,
                          rollout=RolloutSpec(maxResponseLength=64), seed=9, agent=agent)
    metrics = validator.run(step=4)
    count, n, seed, sampling = agent.asked
    assert (count, n, seed) == (2, 2, 9)
    assert (sampling.temperature, sampling.stop, sampling.max_tokens) == (0.5, ("</a>",), 16)
    assert metrics["val/reward"] == 0.25 and metrics["val/pass@2"] == 0.5
    assert metrics["val/response_length"] == 2  # the model's tokens, not the tool's
