"""The preStop hook (`kuberl preemption-notice`) against a real notice board on a local Ray: it
never holds a pod for nothing (with no driver in the Ray cluster, no head to reach, or a trainer
group being recovered it returns well before its wait is up, exit 0), and the head's hook
(`--head`) tells the board it is the head, which holds it until the step in flight is committed.
The path where a driver checkpoints for it: tests/engine/driver/test_grpo_e2e.py; what the driver
does with a head's notice: tests/unit/driver/test_notice_boundary.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

WAIT_SECONDS = 120


def start_hook(address: str, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "kuberl.cli", "preemption-notice", "--wait-seconds",
                             str(WAIT_SECONDS), "--address", address, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def hook(address: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = start_hook(address, *args)
    stdout, stderr = proc.communicate(timeout=WAIT_SECONDS + 60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), time.monotonic() - started


@pytest.fixture
def board(ray_session):
    """A driver's notice board (kuberl.driver.notices.Notices), as the driver starts it."""
    import ray

    from kuberl.driver.notices import Notices

    notices = Notices(checkpoints=True)
    yield notices
    ray.kill(notices._board)  # the name is the cluster's: the next test's board takes it


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


def notice_then_commit(board, address: str, *args: str) -> str:
    """Starts a hook, waits for the board to see it at the driver's boundary after step 0 (step 1
    in flight) as the head's notice, holds 2 s (the hook must wait on), commits step 1 and returns
    the hook's output once it has let its pod go."""
    proc = start_hook(address, *args)
    try:
        deadline = time.monotonic() + WAIT_SECONDS / 2
        while not (going := board.take(0))[0]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        assert going == ([os.environ.get("HOSTNAME", "this pod")], True)
        time.sleep(2)
        assert proc.poll() is None, "the hook let its pod go before the step in flight was committed"
        board.committed(1)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "checkpoint step 1 (the step in flight at the notice) is committed" in stdout, \
        (stdout, stderr[-2000:])
    return stdout


def test_the_heads_hook_says_it_is_the_head_and_waits_for_the_commit(board):
    import ray

    notice_then_commit(board, ray.get_runtime_context().gcs_address, "--head")


def test_a_head_whose_name_no_longer_resolves_is_reached_by_this_pods_connection_to_it(board, tmp_path):
    """KubeRay deletes the head's Service, the name the worker pods joined the head by, with the
    RayCluster (a Kueue preemption, a suspend) while the pods wait in their hooks: the trainer's
    hook finds the GCS by the connection this pod's Ray node still holds to it, gives notice as
    the head would (the head is going too: no step may begin after the commit) and waits for
    the commit; what it did also goes to ``--log`` (in a pod, the container's own log)."""
    import ray

    port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    log = tmp_path / "container.log"
    stdout = notice_then_commit(board, f"kuberl-gone-head-svc.invalid:{port}", "--log", str(log))
    said = log.read_text()
    assert "is committed" in said and said.strip() in stdout, (said, stdout)


def test_while_the_trainer_group_is_recovered_the_hook_lets_the_pod_go_at_once(board):
    """Nothing more can be checkpointed then (the group that would save it is gone): the
    recovery, or the next attempt, restores the newest checkpoint either way."""
    import ray

    board.take(3)
    board.committed(2)
    board.recovering(True)
    done, seconds = hook(ray.get_runtime_context().gcs_address)
    assert done.returncode == 0 and "the trainer group is being recovered" in done.stdout, \
        (done.stdout, done.stderr[-2000:])
    assert "checkpoint (step 2) is restored" in done.stdout and seconds < WAIT_SECONDS / 2, (done.stdout, seconds)
    assert board.take(3) == ([], False)  # a pod that went meanwhile asks nothing of the next boundary
