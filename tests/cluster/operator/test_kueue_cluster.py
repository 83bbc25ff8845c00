"""spec.scheduling.queueName with a real Kueue (tests/harness/kueue.py: built from its Go module,
its RayJob integration on, its webhooks served on loopback) and the real KubeRay operator: quota
for one job, two jobs. No pod needs to run: admission is Kueue's and the RayJob's suspend flag."""

from __future__ import annotations

import pytest

from tests.cluster.operator.conftest import example, get
from tests.cluster.operator.test_operator_cluster import conditions, job_status
from tests.harness.helpers import apply, get_json, wait_for

pytestmark = pytest.mark.cluster
QUEUE = "team"
# One grpo-tiny-cpu job asks 5.5 CPUs (head 1, trainer 2, rollout 2, KubeRay's submitter 0.5):
# 8 admit one and not two.
QUOTA = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}


def queues(namespace: str, preemption: bool = False) -> list[dict]:
    """A ResourceFlavor, a ClusterQueue with quota for one job, and a LocalQueue in `namespace`
    (cluster-scoped names carry the namespace: the session cluster is shared)."""
    flavor, cluster_queue = f"flavor-{namespace}", f"cq-{namespace}"
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                  **({"preemption": {"withinClusterQueue": "LowerPriority"}} if preemption else {}),
                  "resourceGroups": [{"coveredResources": list(QUOTA), "flavors": [
                      {"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in QUOTA.items()]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": namespace},
         "spec": {"clusterQueue": cluster_queue}},
    ]


def workload_of(cluster, namespace: str, ray_job: str) -> dict | None:
    return next((w for w in get_json(cluster, "workloads.kueue.x-k8s.io", "-n", namespace)["items"]
                 if any(ref["name"] == ray_job for ref in w["metadata"].get("ownerReferences", []))), None)


def admitted(cluster, namespace: str, name: str) -> dict | bool:
    status = job_status(cluster, namespace, name)
    return conditions(status).get("Admitted", {}).get("status") == "True" and status


@pytest.fixture
def local_queue(k8s_cluster, kueue, namespace, request):
    objects = queues(namespace, preemption=getattr(request, "param", False))
    apply(k8s_cluster, objects)
    yield QUEUE
    for obj in objects[:2]:  # cluster-scoped: the namespace's deletion does not take them
        k8s_cluster.kubectl("delete", obj["kind"].lower() + ".kueue.x-k8s.io", obj["metadata"]["name"], "--wait=false",
                            check=False)


def unsuspended(cluster, namespace: str, name: str) -> bool:
    ray_job = get(cluster, "rayjob", name, "-n", namespace)
    return ray_job is not None and not ray_job["spec"].get("suspend")  # false is omitted


def test_quota_for_one_admits_one_gang_and_the_second_waits_then_runs(k8s_cluster, namespace, local_queue, operator):
    first, second = "first", "second"
    # No Ray runs in this tier: KubeRay fails a RayJob ~30 s after its submitter pod completed. With
    # no restart that ends the first job (its quota freed), as its deletion below would.
    apply(k8s_cluster, example(first, scheduling={"queueName": QUEUE}, backoffLimit=0), "-n", namespace)
    status = wait_for("the first job admitted by Kueue", lambda: admitted(k8s_cluster, namespace, first), k8s_cluster,
                      timeout=90)
    assert f"LocalQueue {QUEUE}" in conditions(status)["Admitted"]["message"]
    # One gang: one Workload holds every pod set of the RayJob, admitted at once; Kueue unsuspended it.
    workload = workload_of(k8s_cluster, namespace, first)
    assert {"head", "trainer", "rollout"} <= {p["name"] for p in workload["spec"]["podSets"]}
    assigned = {a["name"] for a in workload["status"]["admission"]["podSetAssignments"]}
    assert assigned == {p["name"] for p in workload["spec"]["podSets"]}
    wait_for("the first RayJob unsuspended", lambda: unsuspended(k8s_cluster, namespace, first), k8s_cluster)

    apply(k8s_cluster, example(second, scheduling={"queueName": QUEUE}), "-n", namespace)

    def waiting():
        s = job_status(k8s_cluster, namespace, second)
        cond = conditions(s).get("Admitted", {})
        return s.get("phase") == "Pending" and cond.get("status") == "False" and "quota" in cond.get("message", "") and s

    status = wait_for("the second job Pending, saying what it waits for", waiting, k8s_cluster, timeout=90)
    message = conditions(status)["Admitted"]["message"]
    assert f"LocalQueue {QUEUE}" in message and "cpu" in message, message
    assert get(k8s_cluster, "rayjob", second, "-n", namespace)["spec"]["suspend"] is True
    assert not get_json(k8s_cluster, "rayclusters", "-n", namespace, "-l", f"kuberl.dev/job={second}")["items"]
    assert conditions(status).get("Failed", {}).get("status") != "True"

    # The first finishes (deleted: its RayJob and Workload go with it): the second is admitted.
    k8s_cluster.kubectl("delete", "rltj", first, "-n", namespace, "--wait=false")
    wait_for("the second job admitted once the quota is free", lambda: admitted(k8s_cluster, namespace, second),
             k8s_cluster, timeout=120)
    wait_for("the second RayJob unsuspended", lambda: unsuspended(k8s_cluster, namespace, second), k8s_cluster)


def test_suspend_and_resume_of_a_queued_job_go_through_kueue(k8s_cluster, namespace, local_queue, operator):
    """Kueue would unsuspend a RayJob whose Workload is admitted: spec.suspend deactivates the
    Workload instead, Kueue evicts it and suspends the RayJob (KubeRay deletes the cluster), and the
    job is Suspended, not failed; resumed, Kueue admits it again."""
    name = "queued"
    apply(k8s_cluster, example(name, scheduling={"queueName": QUEUE}), "-n", namespace)
    wait_for("admitted", lambda: admitted(k8s_cluster, namespace, name), k8s_cluster, timeout=90)
    k8s_cluster.kubectl("patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')

    def suspended():
        s = job_status(k8s_cluster, namespace, name)
        return s.get("phase") == "Suspended" and conditions(s)["Suspended"]["reason"] == "Suspended" and s

    wait_for("Suspended through Kueue", suspended, k8s_cluster, timeout=90)
    assert workload_of(k8s_cluster, namespace, name)["spec"]["active"] is False
    # Kueue's eviction suspends the RayJob on its own schedule: the job's Suspended status can come
    # first (CI of 2f98236 read the RayJob before Kueue had written spec.suspend).
    wait_for("the RayJob suspended by Kueue",
             lambda: get(k8s_cluster, "rayjob", name, "-n", namespace)["spec"].get("suspend") is True,
             k8s_cluster, timeout=60)
    k8s_cluster.kubectl("patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for("admitted again", lambda: admitted(k8s_cluster, namespace, name), k8s_cluster, timeout=90)
    assert workload_of(k8s_cluster, namespace, name)["spec"].get("active", True) is True


@pytest.mark.parametrize("local_queue", [True], indirect=True, ids=["preempting-queue"])
def test_a_kueue_preemption_is_a_suspension_not_a_failure(k8s_cluster, namespace, local_queue, operator):
    """A job of a higher priority (its pods' PriorityClass, which Kueue reads) preempts the admitted
    one: Kueue evicts its Workload and suspends its RayJob; the preempted job is Pending with the
    eviction in its Admitted condition, neither failed nor restarted, until the quota is free."""
    high_class = f"high-{namespace}"
    k8s_cluster.kubectl("create", "priorityclass", high_class, "--value=1000")
    try:
        apply(k8s_cluster, example("low", scheduling={"queueName": QUEUE}, backoffLimit=0), "-n", namespace)
        wait_for("the low job admitted", lambda: admitted(k8s_cluster, namespace, "low"), k8s_cluster, timeout=90)
        apply(k8s_cluster, example("high", scheduling={"queueName": QUEUE, "priorityClassName": high_class}),
              "-n", namespace)

        def evicted():
            s = job_status(k8s_cluster, namespace, "low")
            return conditions(s).get("Admitted", {}).get("reason", "").startswith("Evicted") and s

        status = wait_for("the low job evicted by Kueue", evicted, k8s_cluster, timeout=90)
        assert status["phase"] == "Pending", status
        assert "newest checkpoint" in conditions(status)["Admitted"]["message"]
        assert conditions(status)["Failed"]["status"] == "False" and status.get("restarts", 0) == 0
        wait_for("the high job admitted", lambda: admitted(k8s_cluster, namespace, "high"), k8s_cluster, timeout=90)
        low = get(k8s_cluster, "rayjob", "low", "-n", namespace)
        assert low["spec"]["suspend"] is True
    finally:
        k8s_cluster.kubectl("delete", "priorityclass", high_class, "--wait=false", check=False)
