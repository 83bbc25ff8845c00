"""spec.scheduling.queueName in real pods, with a real Kueue (tests/harness/kueue.py) in front of
KubeRay, in one scenario of four job starts on one cluster (the two must-shows of issue 37 used
five starts in two scenarios):

1. Quota for one: job A is admitted, job B waits Pending with a condition naming the queue and the
   quota, and is admitted once A has Succeeded.
2. Preemption: a job H of a higher PriorityClass preempts B mid-run. Kueue suspends B's RayJob and
   KubeRay deletes its whole Ray cluster; the head's and trainer's preStop hooks give notice
   (kuberl.cli.notice), the driver checkpoints the step in flight, and, since its own pod (the
   head) is going, begins no step after the commit. B resumes once H has Succeeded and Succeeds
   with every step.

The checkpoint-first part is asserted from evidence: B's checkpoints are due only at its last step,
so a checkpoint newer than the step B was at when H came is the notice's; the head's and trainer's
hooks each wrote a line to their pod's log, and one of them saw that checkpoint committed; the
step B's first attempt reported last is that checkpoint's (no step past the commit); the resumed
attempt's driver restored that step and its first step is the next one (0 steps run again).

Opt-in (`KUBERL_E2E_KUEUE=1`): Kueue's cold build (about 7 min of CPU) and four job starts do not
fit CI's budget yet (docs/development.md, docs/benchmarks.md "Kueue in pods"):
    KUBERL_E2E_KUEUE=1 flock /tmp/kuberl-e2e.lock nice -n 5 python -m pytest -q tests/e2e/test_kueue_in_pods.py
The Kueue behaviour it rests on (admission as one gang, the Pending condition naming the queue,
suspend/resume through the Workload, eviction as a suspension) runs in CI against the real API
server and a real Kueue: tests/cluster/operator/test_kueue_cluster.py."""

from __future__ import annotations

import os
import re
import time

import pytest

from kuberl.api.contract import JOB_LABEL, ROLE_LABEL

from tests.e2e.conftest import NAMESPACE, condition, example, record_timing
from tests.harness.build import build
from tests.harness.helpers import apply, get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("KUBERL_E2E_KUEUE") != "1",
                                 reason="four jobs in pods and Kueue's build, outside CI's budget; "
                                        "KUBERL_E2E_KUEUE=1 runs them")]

QUEUE = "team"
# One trainer pod: a job asks 1.25 CPUs and KubeRay's submitter pod 0.5, so 3 CPUs admit one job, not two.
QUOTA = {"cpu": "3", "memory": "64Gi"}
HIGH = "kuberl-e2e-high"
PREEMPTED_STEPS = 40  # enough that the preemption lands mid-run (it takes Kueue, KubeRay and the hooks ~10-30 s)
RUN_TIMEOUT_S = 1200
RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)\)")
STEP_LINE = re.compile(r"step (\d+)/\d+ ")
HOOK_LINE = "kuberl preemption-notice "  # what the head's and trainer's preStop hooks write to their logs


@pytest.fixture(scope="module")
def queue(product):
    build(["kueue"])
    product.cluster.start_kueue()
    # The operator (kopf) rescans an API group only on its CRDs' events, and Kueue's CRDs came after
    # it started: served only after their last event, Workloads went unwatched (a run of 21:12 UTC:
    # job A admitted and run to the end, its status waiting for the Workload throughout). A change
    # to one of them now, all served, has it watch them (docs/operations.md, Queues).
    product.kubectl("annotate", "crd", "workloads.kueue.x-k8s.io", "kuberl.dev/rescan=1", "--overwrite")
    objects = [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "e2e"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "e2e"},
         "spec": {"namespaceSelector": {},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": list(QUOTA), "flavors": [
                      {"name": "e2e", "resources": [{"name": r, "nominalQuota": q} for r, q in QUOTA.items()]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": NAMESPACE},
         "spec": {"clusterQueue": "e2e"}},
        # Kueue takes a Workload's priority from its pods' PriorityClass (spec.scheduling.priorityClassName).
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": HIGH}, "value": 1000},
    ]
    apply(product.cluster, objects)
    yield QUEUE
    # Passed or failed, none of the four jobs is left to hold the nodes' CPUs for the next test.
    product.clear_jobs()


def queued(name: str, steps: int | None = None, priority: str | None = None) -> dict:
    manifest = example(name, scheduling={"queueName": QUEUE, **({"priorityClassName": priority} if priority else {})})
    spec = manifest["spec"]
    spec["trainer"]["replicas"] = 1
    spec["checkpoint"]["exportHuggingFace"] = False
    if steps:
        spec["algorithm"]["totalSteps"] = steps
        spec["checkpoint"]["intervalSteps"] = steps  # due at the last step only: any other is a notice's
    return manifest


def step(status: dict) -> int:
    return (status.get("progress") or {}).get("step", 0)


def admitted(status: dict) -> bool:
    return condition(status, "Admitted").get("status") == "True"


@pytest.mark.timeout(3600)
def test_quota_admits_one_job_at_a_time_and_a_preempted_job_checkpoints_first_and_loses_no_step(product, queue):
    total = example()["spec"]["algorithm"]["totalSteps"]
    started = time.monotonic()
    # --- quota for one: A runs, B waits on the quota, then runs once A has Succeeded ---------------
    product.apply(queued("kueue-a"))
    product.wait_status("kueue-a", "admitted", admitted, 120)
    product.apply(queued("kueue-b", steps=PREEMPTED_STEPS))
    waiting = product.wait_status("kueue-b", "Pending on quota",
                                  lambda s: s.get("phase") == "Pending" and "quota" in condition(s, "Admitted").get("message", ""),
                                  120)
    assert f"LocalQueue {QUEUE}" in condition(waiting, "Admitted")["message"], waiting
    first = product.wait_status("kueue-a", "Succeeded", lambda s: s.get("phase") == "Succeeded", RUN_TIMEOUT_S)
    assert step(first) == total, first
    finished = time.monotonic()
    product.wait_status("kueue-b", "admitted after A", admitted, 180)
    record_timing("Kueue: A Succeeded -> B admitted", f"{time.monotonic() - finished:.0f} s")

    # --- preemption: H (higher priority) preempts B mid-run ---------------------------------------
    running = product.wait_status("kueue-b", "its second step", lambda s: step(s) >= 2, RUN_TIMEOUT_S)
    # The first attempt's pods (its Ray cluster's; the second attempt's carry the same job label).
    first_attempt = {pod["metadata"]["uid"]: (pod["metadata"]["name"], pod["metadata"]["labels"].get(ROLE_LABEL))
                     for pod in get_json(product.cluster, "pods", "-n", NAMESPACE, "-l", f"{JOB_LABEL}=kueue-b")["items"]}
    product.apply(queued("kueue-h", priority=HIGH))
    at = step(product.status("kueue-b"))  # no step after this one was begun before the preemption
    applied = time.monotonic()
    evicted = product.wait_status("kueue-b", "evicted by Kueue",
                                  lambda s: condition(s, "Admitted").get("reason", "").startswith("Evicted"), 180)
    assert evicted["phase"] == "Pending" and condition(evicted, "Failed").get("status") != "True", evicted
    assert not running.get("lastCheckpoint"), running  # none due before the last step
    wait_for("kueue-b's first attempt's pods to go", lambda: not first_attempt.keys() & {
        pod["metadata"]["uid"] for pod in get_json(product.cluster, "pods", "-n", NAMESPACE)["items"]},
             product.cluster, timeout=300, interval=1)
    record_timing("Kueue: H applied -> B's pods gone (checkpoint first)", f"{time.monotonic() - applied:.0f} s")
    # The first attempt is over: what it committed and the last step it reported are final, unless
    # the second attempt has already run on (Kueue readmits B once H is done).
    gone = product.status("kueue-b")
    checkpoint, last = (gone.get("lastCheckpoint") or {}).get("step", 0), step(gone)
    record_timing("Kueue preemption: B at step when H came / checkpointed / last step",
                  f"{at} / {checkpoint} / {last}")
    # What the going pods' preStop hooks did, from the pods' own logs (the hook writes its line there).
    hooks = {role: [line for path in sorted(product.evidence.directory.glob(f"{name}.*.log"))
                    for line in path.read_text(errors="replace").splitlines() if HOOK_LINE in line]
             for name, role in first_attempt.values() if role in ("head", "trainer")}
    for role, said in sorted(hooks.items()):
        record_timing(f"Kueue preemption: the {role}'s preStop hook", said[-1].split(": ", 1)[-1] if said else "no line")
    committed = f"checkpoint step {checkpoint} (the step in flight at the notice) is committed"
    assert set(hooks) == {"head", "trainer"} and all(hooks.values()), hooks
    assert any(committed in said[-1] for said in hooks.values()), (committed, hooks)
    # The notice's checkpoint: none other is due before step PREEMPTED_STEPS.
    assert at < checkpoint < PREEMPTED_STEPS, (at, gone)
    # The driver began no step after the commit (its head was going): nothing ran past it.
    assert last == checkpoint, f"steps {checkpoint + 1}-{last} ran past the committed checkpoint: {gone}"

    high = product.wait_status("kueue-h", "Succeeded", lambda s: s.get("phase") == "Succeeded", RUN_TIMEOUT_S)
    assert step(high) == total, high
    resumed = product.wait_status("kueue-b", "Succeeded", lambda s: s.get("phase") == "Succeeded", RUN_TIMEOUT_S)
    assert step(resumed) == PREEMPTED_STEPS and not resumed.get("restarts"), resumed  # a suspension, not a failure
    # The resumed attempt restored the notice's checkpoint and ran on from the step after it.
    log = product.evidence.driver_logs("kueue-b")[-1].read_text(errors="replace")
    restored = RESUMED.search(log)
    assert restored and int(restored.group(2)) == checkpoint, log[-3000:]
    steps = [int(m.group(1)) for m in STEP_LINE.finditer(log)]
    assert steps and min(steps) == checkpoint + 1, (checkpoint, steps[:5])
    record_timing("Kueue: steps run again after the preemption", f"{last - checkpoint}")
    record_timing("Kueue scenario: A apply -> B Succeeded", f"{time.monotonic() - started:.0f} s")
