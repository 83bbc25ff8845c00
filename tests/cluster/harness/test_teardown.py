"""No component outlives the process that started it, however that process ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.harness.harness import REPO_ROOT

pytestmark = pytest.mark.cluster

_CHILD = """
import json, sys, time
from tests.harness.harness import Cluster
cluster = Cluster(nodes=1, kuberay={kuberay}).start()
print(json.dumps({{"pids": [p.pid for p in cluster.processes], "workdir": str(cluster.workdir)}}), flush=True)
{after}
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has stopped all the same.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def _start_child(after: str, kuberay: bool = False) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(kuberay=kuberay, after=after)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    assert line, f"child cluster did not start: {child.stderr.read()}"
    return child, json.loads(line)


def _wait_all_gone(pids: list[int], timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_sigkill_of_the_test_process_takes_every_component_with_it(k8s_cluster):
    child, state = _start_child("time.sleep(600)")
    assert len(state["pids"]) == 5 and all(_alive(p) for p in state["pids"])
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _wait_all_gone(state["pids"]) == [], "components outlived a SIGKILLed parent"


def test_sigterm_stops_the_cluster_and_exits(k8s_cluster):
    child, state = _start_child("time.sleep(600)")
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    assert _wait_all_gone(state["pids"]) == []
    # stop() drops etcd's data and keeps the logs.
    assert not os.path.exists(os.path.join(state["workdir"], "etcd-data"))
    assert os.path.exists(os.path.join(state["workdir"], "logs", "kube-apiserver.log"))


def test_a_crashing_script_still_stops_the_cluster(k8s_cluster):
    child, state = _start_child("raise SystemExit(3)")
    assert child.wait(timeout=60) == 3
    assert _wait_all_gone(state["pids"]) == []
