"""Batch rewards in parallel Ray tasks (``RewardWorkers``), on the session's local Ray: a function
taking extra_info and token lengths, its shares scored at the same time in separate processes
(a barrier in the function proves it, not a timing), results in input order."""

from __future__ import annotations

import pytest

from kuberl.api.types import RewardSpec
from kuberl.train.rewards import RewardError, RewardInput, RewardWorkers

pytest.importorskip("ray")

SAMPLES = 16
WORKERS = 4


def _batch(pid_dir="", parties=WORKERS) -> list[RewardInput]:
    return [RewardInput(prompt="q", response="r", answer=None, data_source="toy",
                        extra_info={"weight": 2.0, "pid_dir": pid_dir, "parties": parties}, prompt_tokens=3,
                        response_tokens=i, max_response_tokens=SAMPLES, group=i) for i in range(SAMPLES)]


def test_reward_function_runs_in_parallel_workers(ray_session, tmp_path):
    spec = RewardSpec(function="tests.driver.reward_fixtures:concurrent_length_shaped", workers=WORKERS,
                      cpus_per_worker=0.5)
    rewards = RewardWorkers(spec)(_batch(str(tmp_path)))
    # extra_info and the lengths reach the function; results come back in input order.
    assert rewards == [2.0 * i / SAMPLES for i in range(SAMPLES)]
    # Each share waited until all four had started: four processes scored at the same time.
    assert len(list(tmp_path.iterdir())) == WORKERS


def test_bad_reward_function_fails_at_start_or_names_the_samples(ray_session):
    with pytest.raises(RewardError, match="has no function 'nope'"):
        RewardWorkers(RewardSpec(function="tests.driver.reward_fixtures:nope"))
    workers = RewardWorkers(RewardSpec(function="tests.driver.reward_fixtures:wrong_count", workers=2))
    with pytest.raises(RewardError, match=r"^reward function returned 7 rewards for 8 inputs \(samples 0-7\)$"):
        workers(_batch())
