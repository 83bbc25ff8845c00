"""A live resize of the rollout pool in real pods: examples/grpo-tiny-s3.yaml (one trainer pod,
to leave the machine room for a second rollout pod) is patched to rollout.replicas 2 after its
first step and back to 1 once the second engine has joined. KubeRay starts a second rollout pod,
its engine joins at a step boundary with the current weights; the scale-down retires that engine,
the driver names the pod of the engine left in status.rollout and the operator has KubeRay delete
the other pod, so the first engine serves on. No step fails, no restart, and training goes on past
the scale-down; the job is then deleted (it is long enough never to finish first, however fast its
steps and however slow the new pod's start: in one CI run 160 steps were over before it joined)."""

from __future__ import annotations

import time

import pytest

from tests.harness.helpers import get_json, wait_for
from tests.e2e.conftest import NAMESPACE, example, record_timing

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

JOB = "resize"
# More steps (about 1 s each here) than the test can wait for: the job runs while the second
# rollout pod starts, stages the model, joins Ray and starts its engine (2-5 min here), and after.
STEPS = 100_000
STEPS_AFTER_SCALE_DOWN = 5
TIMEOUT_S = 480


def rollout_pods(product) -> list[str]:
    pods = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB},kuberl.dev/role=rollout")
    return sorted(p["metadata"]["name"] for p in pods["items"] if not p["metadata"].get("deletionTimestamp"))


def resizes(status: dict) -> int:
    return ((status.get("recoveries") or {}).get("resize") or {}).get("count", 0)


# pytest-timeout counts fixture setup: run alone, this test also sets up the cluster (about 9 min).
@pytest.mark.timeout(1500)
@pytest.mark.skip(reason="issue 34, open: in 2 of its 3 runs (2026-11-26) the second rollout pod's engine did not join "
                         "(within 150 s in CI; within 480 s in a run where that pod's container was restarted once "
                         "under load 34); it passed once, 277 s to join. Cause not found yet; the engine and cluster "
                         "tiers' resize tests pass")
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

    scaled_down_at = status["progress"]["step"]
    status = product.wait_status(JOB, f"{STEPS_AFTER_SCALE_DOWN} steps on one engine again, both resizes posted",
                                 lambda s: (s.get("progress") or {}).get("step", 0) >= scaled_down_at + STEPS_AFTER_SCALE_DOWN
                                 and (s.get("recoveryEvents") or {}).get("resize") == 2, TIMEOUT_S)
    assert status["phase"] == "Running" and status.get("restarts", 0) == 0, status
    assert status["progress"]["step"] > joined_at
    assert "engineLost" not in (status.get("recoveries") or {}), status
    events = get_json(product.cluster, "events", "-n", NAMESPACE, "--field-selector",
                      f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")["items"]
    assert {"Resizing", "Resized"} <= {e["reason"] for e in events}
    product.kubectl("delete", "rltj", JOB, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
