"""The preStop hook (`kuberl preemption-notice`) never holds a pod for nothing: with no driver in
the Ray cluster, or no head to reach, it returns well before its wait is up, exit 0.
The path where a driver checkpoints for it: tests/engine/driver/test_grpo_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

WAIT_SECONDS = 120


def hook(address: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kuberl.cli", "preemption-notice", "--wait-seconds",
                           str(WAIT_SECONDS), "--address", address],
                          env=env, capture_output=True, text=True, timeout=WAIT_SECONDS + 60)
    return done, time.monotonic() - started


def test_without_a_driver_the_hook_lets_the_pod_go_at_once(ray_session):
    """A Ray cluster with no kuberl driver (between attempts, before the driver starts)."""
    import ray

    done, seconds = hook(ray.get_runtime_context().gcs_address)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no kuberl driver is running in this Ray cluster" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert seconds < WAIT_SECONDS / 2, seconds


def test_when_the_head_is_gone_the_hook_lets_the_pod_go_at_once():
    """KubeRay deleting the whole cluster (a suspend, the job's end): the head's GCS answers
    nothing, which Ray's own client would retry for minutes."""
    done, seconds = hook("127.0.0.1:1")  # a port nothing listens on
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the Ray cluster's head does not answer" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert seconds < WAIT_SECONDS / 2, seconds
