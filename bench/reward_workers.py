"""Reward workers: a slow batch reward function scored by ``RewardWorkers`` in N parallel Ray
tasks against the same function in one task, in the same run on a local Ray.

The function sleeps ``--seconds`` per sample (a sandbox run or a judge call: waiting, not CPU),
so the ideal is 1/workers of the serial time. The worker processes are started before anything is
timed; serial and parallel calls alternate round by round so load swings hit both.

    PYTHONPATH=workloads python bench/reward_workers.py [--samples 32] [--workers 4] [--seconds 0.1] [--rounds 3]

The last line is the headline: parallel time as a fraction of serial time, and the ideal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# The function is named by import path, as a job's spec.reward.function is: this file's directory
# is importable in the Ray workers through the runtime environment below.
BENCH_DIR = Path(__file__).resolve().parent
SECONDS_PER_SAMPLE = 0.1


def slow_reward(batch):
    """Sleeps per sample, then rewards by length; the per-sample time comes in extra_info."""
    for x in batch:
        time.sleep(x.extra_info["seconds"])
    return [x.response_tokens / x.max_response_tokens for x in batch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=SECONDS_PER_SAMPLE, help="per sample")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray

    from kuberl.api.types import RewardSpec
    from kuberl.driver.rewards import RewardInput, RewardWorkers

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{BENCH_DIR}:{':'.join(sys.path)}"}})
    batch = [RewardInput(prompt="q", response="r", answer=None, data_source="bench",
                         extra_info={"seconds": args.seconds}, prompt_tokens=3, response_tokens=i,
                         max_response_tokens=args.samples, group=i) for i in range(args.samples)]
    spec = RewardSpec(function="reward_workers:slow_reward", workers=args.workers, cpus_per_worker=1.0)
    parallel, serial = RewardWorkers(spec), RewardWorkers(spec.model_copy(update={"workers": 1}))
    for _ in range(2):  # start every worker process: not what is measured
        parallel(batch[:args.workers])
    times: dict[str, list[float]] = {"serial": [], "parallel": []}
    for _ in range(args.rounds):
        for name, workers in (("serial", serial), ("parallel", parallel)):
            began = time.perf_counter()
            rewards = workers(batch)
            times[name].append(time.perf_counter() - began)
            assert rewards == [i / args.samples for i in range(args.samples)]
    ray.shutdown()
    serial_s, parallel_s = statistics.median(times["serial"]), statistics.median(times["parallel"])
    print(f"{args.samples} samples x {args.seconds} s, {args.rounds} rounds (median s): "
          f"serial {serial_s:.2f}, {args.workers} workers {parallel_s:.2f}")
    print(f"parallel/serial = {parallel_s / serial_s:.3f} (ideal {1 / args.workers:.3f})")


if __name__ == "__main__":
    main()
