"""A worker process exporting metrics through kuberl.common.metrics, fed synthetic training steps: the
scrape target for the Prometheus tests. Usage: python -m tests.shared.worker_feed PORT ROLE RANK
(job and namespace come from KUBERL_JOB_NAME/KUBERL_NAMESPACE, as in a worker pod). It runs until
terminated. It stands in for the driver because a real run is too slow for a scrape test; the
step dicts have the driver's shape (kuberl.driver.loop/worker), checked in test_worker_metrics."""

from __future__ import annotations

import sys
import time

from kuberl.common import metrics

STEP_SECONDS = 0.2


def main(argv: list[str]) -> int:
    port, role, rank = int(argv[0]), argv[1], int(argv[2])
    metrics.start_exporter(port, addr="127.0.0.1", role=role, rank=rank)
    metrics.record_stage(nbytes=64 << 20, seconds=0.5)
    step = 0
    while True:
        step += 1
        if role == "trainer":
            metrics.record_step({
                "step": step, "reward_mean": min(1.0, step / 100), "kl": 0.01 * step ** 0.5, "loss": 1.0 / step,
                "pg_loss": 0.8 / step, "grad_norm": 1.5, "skipped": step % 7 == 0, "tokens_per_second": 2048.0,
                "mfu": 0.35, "step_seconds": STEP_SECONDS, "weight_sync_seconds": 0.05, "weight_sync_bytes": 1 << 20,
                "reward_std": 0.1, "generate_seconds": 0.4, "logprobs_seconds": 0.1, "update_seconds": 0.3,
                # A recovery each step: the recovery panels' rates have data in every window.
                "engines_lost": 1.0, "engine_replacements": 1.0, "engine_replacement_seconds": 40.0,
                "rollout_resizes": 1.0, "rollout_resize_seconds": 3.0})
            if step % 10 == 0:
                metrics.record_checkpoint(seconds=0.4, nbytes=8 << 20)
        else:
            metrics.record_rollout(tokens=512, seconds=STEP_SECONDS)
        metrics.record_stage(nbytes=1 << 20, seconds=0.01)
        time.sleep(STEP_SECONDS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
