"""Batch rewards in parallel Ray tasks (``RewardWorkers``), on the session's local Ray: a function
taking extra_info and token lengths, its shares scored at the same time in separate processes
(a barrier in the function proves it, not a timing), results in input order; a function that
hangs or fails has its other workers' processes killed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kuberl.api.types import RewardSpec
from kuberl.common.reward_values import RewardError
from kuberl.driver.rewards import RewardInput, RewardWorkers
from tests.processes import running

pytest.importorskip("ray")

SAMPLES = 16
WORKERS = 4


def _batch(pid_dir="", parties=WORKERS) -> list[RewardInput]:
    return [RewardInput(prompt="q", response="r", answer=None, data_source="toy",
                        extra_info={"weight": 2.0, "pid_dir": pid_dir, "parties": parties}, prompt_tokens=3,
                        response_tokens=i, max_response_tokens=SAMPLES, group=i) for i in range(SAMPLES)]


def test_reward_function_runs_in_parallel_workers(ray_session, tmp_path):
    spec = RewardSpec(function="tests.engine.driver.reward_fixtures:concurrent_length_shaped", workers=WORKERS,
                      cpus_per_worker=0.5)
    rewards = RewardWorkers(spec)(_batch(str(tmp_path)))
    # extra_info and the lengths reach the function; results come back in input order.
    assert rewards == [2.0 * i / SAMPLES for i in range(SAMPLES)]
    # Each share waited until all four had started: four processes scored at the same time.
    assert len(list(tmp_path.iterdir())) == WORKERS


def test_bad_reward_function_fails_at_start_or_names_the_samples(ray_session):
    with pytest.raises(RewardError, match="has no function 'nope'"):
        RewardWorkers(RewardSpec(function="tests.engine.driver.reward_fixtures:nope"))
    workers = RewardWorkers(RewardSpec(function="tests.engine.driver.reward_fixtures:wrong_count", workers=2))
    # Both shares are wrong; the step fails on the first to come back, whichever that is.
    with pytest.raises(RewardError, match=r"^spec.reward.function tests.engine.driver.reward_fixtures:wrong_count returned "
                                          r"7 rewards for 8 inputs \(samples (0-7|8-15)\)$"):
        workers(_batch())


def _hung_pids(pid_dir: Path) -> list[int]:
    return [int(p.name) for p in pid_dir.iterdir()]


def test_a_hung_reward_function_times_out_naming_it_and_its_worker_is_killed(ray_session, tmp_path):
    workers = RewardWorkers(RewardSpec(function="tests.engine.driver.reward_fixtures:hang_or_fail", workers=2,
                                       cpus_per_worker=0.5))
    workers.timeout_s = 20  # long enough for Ray to start both workers on a loaded machine
    batch = _batch(str(tmp_path))
    for x in batch[8:]:
        x.extra_info["mark"] = "hang"
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"^spec.reward.function tests.engine.driver.reward_fixtures:hang_or_fail did not "
                                          r"return within 20 s \(spec.reward.timeoutSeconds, the bound on a step's "
                                          r"reward calls\) for samples 8-15; its workers were killed$"):
        workers(batch)
    assert time.monotonic() - started < 20 + 10
    assert len(list(tmp_path.iterdir())) == 1, "the hung share had not started: raise timeout_s"
    assert running(_hung_pids(tmp_path)) == []


def test_a_failed_share_fails_the_step_at_once_and_kills_the_hung_one(ray_session, tmp_path):
    workers = RewardWorkers(RewardSpec(function="tests.engine.driver.reward_fixtures:hang_or_fail", workers=2,
                                       cpus_per_worker=0.5))
    batch = _batch(str(tmp_path))
    for i, x in enumerate(batch):
        x.extra_info["mark"] = "hang" if i < 8 else "fail"
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"^spec.reward.function tests.engine.driver.reward_fixtures:hang_or_fail failed: "
                                          r"RuntimeError\('the verifier is down'\)$"):
        workers(batch)  # not after the 600 s the hung share has
    assert time.monotonic() - started < 120
    assert len(list(tmp_path.iterdir())) == 1
    assert running(_hung_pids(tmp_path)) == []


def test_a_share_whose_worker_dies_runs_again_and_the_step_completes(ray_session, tmp_path):
    """A trainer pod preempted in pods took a reward share with it and ended the job."""
    workers = RewardWorkers(RewardSpec(function="tests.engine.driver.reward_fixtures:die_once", workers=1))
    assert workers(_batch(str(tmp_path))) == [1.0] * SAMPLES
    assert (tmp_path / "died").exists()


def test_reward_workers_import_the_function_from_the_jobs_source_directory(ray_session, tmp_path):
    """spec.reward.source: a module in no image and on no sys.path of the Ray workers, only in the
    directory the plan names (a mounted ConfigMap here): each worker process puts it on its own path."""
    code = tmp_path / "reward"
    code.mkdir()
    (code / "source_only_rewards.py").write_text(
        "import os\n\ndef tripled(batch):\n    return [3.0 * x.response_tokens for x in batch]\n\n"
        "def pid(batch):\n    return [float(os.getpid()) for _ in batch]\n")
    source = {"configMap": {"name": "rewards", "key": "source_only_rewards.py"}}
    spec = RewardSpec(function="source_only_rewards:tripled", source=source, workers=2, cpus_per_worker=0.5)
    assert RewardWorkers(spec, str(code))(_batch()) == [3.0 * i for i in range(SAMPLES)]
    pids = RewardWorkers(spec.model_copy(update={"function": "source_only_rewards:pid"}), str(code))(_batch())
    assert os.getpid() not in pids  # scored in Ray's worker processes, not in this one
