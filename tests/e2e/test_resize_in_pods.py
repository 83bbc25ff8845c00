"""A live resize of the rollout pool in real pods: examples/grpo-tiny-s3.yaml (one trainer pod,
to leave the machine room for a second rollout pod) is patched to rollout.replicas 2 after its
first step and back to 1 once the second engine has joined. KubeRay starts a second rollout pod,
its engine joins at a step boundary with the current weights; the scale-down retires that engine,
the driver names the pod of the engine left in status.rollout and the operator has KubeRay delete
the other pod, so the first engine serves on. No step fails, no restart, and the job Succeeds."""

from __future__ import annotations

import time

import pytest

from tests.harness.helpers import get_json, wait_for
from tests.e2e.conftest import NAMESPACE, example, record_timing

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

JOB = "resize"
# Enough steps (about 1.5 s each here) for the second rollout pod to start, stage the model, join
# Ray and start its engine (1-2 min) while training goes on, and for the scale-down after it.
STEPS = 160
TIMEOUT_S = 480


def rollout_pods(product) -> list[str]:
    pods = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB},kuberl.dev/role=rollout")
    return sorted(p["metadata"]["name"] for p in pods["items"] if not p["metadata"].get("deletionTimestamp"))


def resizes(status: dict) -> int:
    return ((status.get("recoveries") or {}).get("resize") or {}).get("count", 0)


# pytest-timeout counts fixture setup: run alone, this test also sets up the cluster (about 9 min).
@pytest.mark.timeout(1500)
def test_rollout_replicas_1_2_1_while_training_engines_join_and_leave_and_the_job_succeeds(product):
    manifest = example(JOB)
    spec = manifest["spec"]
    spec["algorithm"]["totalSteps"] = STEPS
    spec["trainer"]["replicas"] = 1
    spec["checkpoint"].update(intervalSteps=STEPS // 2, exportHuggingFace=False)
    product.apply(manifest)
    product.wait_status(JOB, "its first step", lambda s: (s.get("progress") or {}).get("step", 0) >= 1, TIMEOUT_S)
    [first] = rollout_pods(product)

    patch = ["patch", "rltj", JOB, "-n", NAMESPACE, "--type=merge", "-p"]
    product.kubectl(*patch, '{"spec":{"rollout":{"replicas":2}}}')
    patched = time.monotonic()
    status = product.wait_status(JOB, "the second engine joined", lambda s: resizes(s) >= 1, TIMEOUT_S)
    record_timing("rollout 1 -> 2: patch -> the new engine serving", f"{time.monotonic() - patched:.0f} s")
    assert (status["rollout"]["replicas"], status["rollout"]["enginePods"]) == (2, [first]), status
    [added] = set(rollout_pods(product)) - {first}
    joined_at = status["progress"]["step"]

    product.kubectl(*patch, '{"spec":{"rollout":{"replicas":1}}}')
    patched = time.monotonic()
    status = product.wait_status(JOB, "the scale-down applied", lambda s: resizes(s) >= 2, TIMEOUT_S)
    assert (status["rollout"]["replicas"], status["rollout"]["enginePods"]) == (1, [first]), status
    wait_for("the second rollout pod to go", lambda: rollout_pods(product) == [first], product.cluster,
             timeout=120, interval=1)
    record_timing("rollout 2 -> 1: patch -> the second pod gone", f"{time.monotonic() - patched:.0f} s")

    status = product.wait_status(JOB, "Succeeded", lambda s: s.get("phase") == "Succeeded", TIMEOUT_S)
    assert status["progress"]["step"] == STEPS and status.get("restarts", 0) == 0, status
    assert status["progress"]["step"] > joined_at
    assert status["recoveryEvents"]["resize"] == 2 and "engineLost" not in (status.get("recoveries") or {}), status
    events = get_json(product.cluster, "events", "-n", NAMESPACE, "--field-selector",
                      f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")["items"]
    assert {"Resizing", "Resized"} <= {e["reason"] for e in events}
    product.kubectl("delete", "rltj", JOB, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
