"""Batch rewards in parallel Ray tasks (``RewardWorkers``), on the session's local Ray: a function
taking extra_info and token lengths, N slow calls in about 1/workers of the serial time."""

from __future__ import annotations

import time

import pytest

from kuberl.api.types import RewardSpec
from kuberl.train.rewards import RewardError, RewardInput, RewardWorkers
from tests.driver.reward_fixtures import SECONDS_PER_SAMPLE

pytest.importorskip("ray")

SAMPLES = 16
WORKERS = 4


def _batch(pid_dir="") -> list[RewardInput]:
    return [RewardInput(prompt="q", response="r", answer=None, data_source="toy",
                        extra_info={"weight": 2.0, "pid_dir": pid_dir}, prompt_tokens=3, response_tokens=i,
                        max_response_tokens=SAMPLES, group=i) for i in range(SAMPLES)]


def _timed(workers, batch) -> tuple[list[float], float]:
    started = time.perf_counter()
    rewards = workers(batch)
    return rewards, time.perf_counter() - started


def test_reward_function_runs_in_parallel_workers(ray_session, tmp_path):
    spec = RewardSpec(function="tests.driver.reward_fixtures:slow_length_shaped", workers=WORKERS,
                      cpus_per_worker=0.5)
    parallel = RewardWorkers(spec)
    serial = RewardWorkers(spec.model_copy(update={"workers": 1}))
    parallel(_batch()[:WORKERS])  # start the worker processes: not what is measured
    rewards, parallel_s = _timed(parallel, _batch(str(tmp_path)))
    # extra_info and the lengths reach the function; results come back in input order.
    assert rewards == [2.0 * i / SAMPLES for i in range(SAMPLES)]
    assert len(list(tmp_path.iterdir())) == WORKERS  # four processes scored
    _, serial_s = _timed(serial, _batch())
    assert serial_s >= SAMPLES * SECONDS_PER_SAMPLE
    # Ideal: serial / 4 (1 s of 4 s). Loosely: well under half, on a loaded 2-core machine.
    assert parallel_s < 0.5 * serial_s, (parallel_s, serial_s)


def test_bad_reward_function_fails_at_start_or_names_the_samples(ray_session):
    with pytest.raises(RewardError, match="has no function 'nope'"):
        RewardWorkers(RewardSpec(function="tests.driver.reward_fixtures:nope"))
    workers = RewardWorkers(RewardSpec(function="tests.driver.reward_fixtures:wrong_count", workers=2))
    with pytest.raises(RewardError, match=r"^reward function returned 7 rewards for 8 inputs \(samples 0-7\)$"):
        workers(_batch())
