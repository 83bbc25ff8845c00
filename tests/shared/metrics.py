"""Prometheus for the metrics tests of every tier (a pytest plugin, tests/conftest.py): the built
prometheus/promtool binaries, and worker feeds (tests/shared/worker_feed.py) as scrape targets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from kuberl.common.ports import unclaimed_port

from tests.harness.harness import REPO_ROOT
from tests.shared.prometheus import MISSING, binaries


@pytest.fixture(scope="session")
def prometheus_binaries() -> tuple[str, str]:
    found = binaries()
    if found is None:
        pytest.skip(MISSING)
    return found


class WorkerFeed:
    """tests.shared.worker_feed as a subprocess on a free loopback port."""

    def __init__(self, job: str, namespace: str, role: str, rank: int) -> None:
        self.port = unclaimed_port()
        env = dict(os.environ, KUBERL_JOB_NAME=job, KUBERL_NAMESPACE=namespace)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.shared.worker_feed", str(self.port), role, str(rank)],
                                     cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.scrape()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise AssertionError(f"worker feed exited {self.proc.returncode}: {self.proc.stdout.read().decode()}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.target}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.proc.stdout.close()


@pytest.fixture
def worker_feeds():
    started: list[WorkerFeed] = []

    def start(job: str, namespace: str, role: str, rank: int = 0) -> WorkerFeed:
        started.append(WorkerFeed(job, namespace, role, rank))
        return started[-1]

    yield start
    for feed in started:
        feed.stop()
