"""A trainer pod deleted gracefully in real pods (`kubectl delete pod`, what a node drain or a
spot notice does too): its preStop hook (`kuberl preemption-notice`) tells the driver, which
checkpoints the step in flight at the next step boundary; the hook holds the pod until that
checkpoint is committed, and only then does the pod go. The driver then recovers the trainer group
in place from that checkpoint or a newer one (same attempt, same Ray cluster): no step done before
the notice is lost. The job's periodic checkpoints are too far apart to count, so the restored one
is the notice's. The job's reward function comes from a ConfigMap, not the image (issue 35).

Then, on the same job, the head pod killed (`--force`: no notice): the driver and the Ray
cluster's GCS go with it, and a new driver on a new head restores the newest checkpoint. The test
times the kill to the new driver's first step and counts the steps lost (completed after that
checkpoint)."""

from __future__ import annotations

import re
import time

import pytest

from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import get_json, wait_for
from tests.e2e.conftest import NAMESPACE, example, record_timing

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

JOB = "preempt"
STEPS = 100_000  # more than the test waits for: the job is deleted at the end
TIMEOUT_S = 900  # a trainer pod's start here, CPU-bound at high load (test_resize_in_pods' docstring)
NOTICE = re.compile(r"preemption notice from (\S+): checkpointing step (\d+), the step in flight")
RECOVERED = re.compile(r"trainer group recovered in ([\d.]+) s \(epoch (\d+)\): restored step (\d+)")
STEP_LINE = re.compile(r"step (\d+)/\d+ ")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")


def step(status: dict) -> int:
    return (status.get("progress") or {}).get("step", 0)


@pytest.mark.timeout(2400)
def test_a_trainer_pod_deleted_gracefully_commits_the_step_in_flight_and_loses_no_step(product):
    product.kubectl("create", "configmap", "letter-rewards", "-n", NAMESPACE,
                    f"--from-file={REPO_ROOT}/examples/reward-code/letter_rewards.py")
    manifest = example(JOB, reward={"function": "letter_rewards:share_of_letter",
                                    "source": {"configMap": {"name": "letter-rewards", "key": "letter_rewards.py"}}})
    spec = manifest["spec"]
    spec["algorithm"]["totalSteps"] = STEPS
    spec["trainer"]["replicas"] = 1
    spec["checkpoint"].update(intervalSteps=STEPS // 2, exportHuggingFace=False)
    product.apply(manifest)
    product.wait_status(JOB, "its third step", lambda s: step(s) >= 3, TIMEOUT_S)

    # The reward scored these steps from the ConfigMap, mounted in every pod (Ray runs reward
    # tasks wherever a CPU is free).
    for pod in get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB}")["items"]:
        mounted = [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v]
        assert "letter-rewards" in mounted, (pod["metadata"]["name"], mounted)
    trainers = get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={JOB},kuberl.dev/role=trainer")
    [trainer] = [p["metadata"]["name"] for p in trainers["items"]]
    at = step(product.status(JOB))
    product.kubectl("delete", "pod", trainer, "-n", NAMESPACE, "--wait=false")  # graceful: its preStop hook runs
    deleted = time.monotonic()
    wait_for(f"pod {trainer} to go", lambda: product.kubectl("get", "pod", trainer, "-n", NAMESPACE,
                                                              check=False).returncode != 0,
             product.cluster, timeout=TIMEOUT_S, interval=1)
    record_timing("trainer pod delete -> the notice's checkpoint committed, pod gone",
                  f"{time.monotonic() - deleted:.0f} s")
    [driver] = product.evidence.driver_logs(JOB)
    recovered = wait_for("the driver to recover the trainer group in place",
                         lambda: RECOVERED.search(driver.read_text(errors="replace")), product.cluster,
                         timeout=TIMEOUT_S, interval=2)
    status = product.wait_status(JOB, "training again after the recovery",
                                 lambda s: step(s) > int(recovered.group(3)), TIMEOUT_S)
    record_timing("trainer pod delete -> training again (in place)", f"{time.monotonic() - deleted:.0f} s")
    assert status["phase"] == "Running" and not status.get("restarts"), status  # no new attempt

    log = driver.read_text(errors="replace")
    notice = NOTICE.search(log)
    assert notice and notice.group(1) == trainer, log[-3000:]
    noticed, restored = int(notice.group(2)), int(recovered.group(3))
    # The restored checkpoint covers the step in flight at the delete: nothing done before the
    # notice is lost. No step begins before the commit; one begun between the commit and the
    # pod's end (the hook's poll, then the kubelet's SIGTERM) runs again, counted, not lost.
    assert restored >= noticed > at, (at, noticed, restored)
    completed = max(int(m.group(1)) for m in STEP_LINE.finditer(log[:recovered.start()]))
    record_timing("trainer pod delete: notice at step / restored / steps run again",
                  f"{noticed} / {restored} / {max(0, completed - restored)}")
    # With Ray's drain off (RAY_DRAIN_ENV), at most the step the rank was in as SIGTERM came.
    assert completed - restored <= 1, f"steps {restored + 1}-{completed} ran past the committed checkpoint"

    the_head_killed_is_a_new_attempt_from_the_newest_checkpoint(product, driver)
    product.kubectl("delete", "rltj", JOB, "-n", NAMESPACE, "--wait=true", "--timeout=120s")


def the_head_killed_is_a_new_attempt_from_the_newest_checkpoint(product, driver) -> None:
    """The head pod killed (no grace, no notice): the driver and its Ray cluster's GCS go with it,
    and a new driver on a new head restores the newest checkpoint (docs/operations.md, the fault
    matrix's head rows). Which new driver: the next attempt's (the RayJob fails, the operator
    counts a restart and creates the next RayJob), or KubeRay's own retry of the submitter inside
    the attempt (its submitter Job, backoffLimit 2, submits the job again to the head KubeRay
    recreated when that head is up first); the test records which."""
    [head] = [p["metadata"]["name"] for p in get_json(product.cluster, "pods", "-n", NAMESPACE, "-l",
                                                      f"kuberl.dev/job={JOB},kuberl.dev/role=head")["items"]]
    newest = product.status(JOB)["lastCheckpoint"]["step"]
    drivers_before = len(product.evidence.driver_logs(JOB))
    product.kubectl("delete", "pod", head, "-n", NAMESPACE, "--grace-period=0", "--force", "--wait=false")
    killed = time.monotonic()

    def a_new_driver_training():  # a driver started after the kill that has logged a step
        return next((path for path in product.evidence.driver_logs(JOB)[drivers_before:]
                     if STEP_LINE.search(path.read_text(errors="replace"))), None)
    new_driver = wait_for("a new driver's first step after the head's kill", a_new_driver_training, product.cluster,
                          timeout=TIMEOUT_S, interval=1)
    again = time.monotonic() - killed
    old, new = driver.read_text(errors="replace"), new_driver.read_text(errors="replace")
    resumed = RESUMED.search(new)
    # The newest checkpoint at the kill: the preStop hook, which the kubelet may still start in
    # the 2 s it gives a forced delete, could not have had a newer one committed (its join to Ray
    # alone takes about 4 s).
    assert resumed and int(resumed.group(1)) == newest, new[-3000:]
    assert int(STEP_LINE.search(new).group(1)) == newest + 1, new[-3000:]
    completed = max(int(m.group(1)) for m in STEP_LINE.finditer(old))
    status = product.status(JOB)
    assert status["phase"] == "Running", status
    how = (f"a new attempt (restarts {status['restarts']})" if status.get("restarts")
           else "KubeRay's resubmission to the new head, in the same attempt")
    record_timing("head pod kill -> training again", f"{again:.0f} s, {how}")
    record_timing("head pod kill: the newest checkpoint / the last step done / steps lost",
                  f"{newest} / {completed} / {completed - newest}")
