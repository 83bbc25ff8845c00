"""The operator against the real control plane: kube-apiserver, kube-controller-manager (garbage
collection), the real KubeRay operator, KWOK nodes. The operator runs as a subprocess with exactly
the chart's RBAC (a ServiceAccount token), never as cluster admin."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import kubernetes
import pytest
import yaml

from kuberl.job import plan as plans
from kuberl.api.contract import CONFIG_FILE, PLAN_FILE
from tests.harness.helpers import apply, get_json, wait_for
from tests.cluster.operator.conftest import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, example, get

pytestmark = pytest.mark.cluster
JOB = "grpo-tiny-cpu"


def job_status(cluster, ns, name=JOB) -> dict:
    return (get(cluster, "rltj", name, "-n", ns) or {}).get("status") or {}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions", [])}


def owned(cluster, kind: str, ns: str, name: str = JOB) -> list[dict]:
    return get_json(cluster, kind, "-n", ns, "-l", f"kuberl.dev/job={name}")["items"]


def wait_phase(cluster, ns, phase, name=JOB, timeout=90) -> dict:
    return wait_for(f"RLTrainingJob {name} phase {phase}",
                    lambda: (s := job_status(cluster, ns, name)).get("phase") == phase and s, cluster, timeout=timeout)


def printed_row(table: str) -> dict[str, str]:
    """`kubectl get` output as {column: value}, cut at the header's column offsets (values may be empty)."""
    header, row = table.splitlines()[:2]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, starts[1:] + [None]))
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def fail_ray_job(cluster, ns: str, name: str) -> None:
    """Mark a RayJob failed the way KubeRay does when the Ray job fails (AppFailed). KubeRay leaves
    a terminal RayJob's status alone (it only tears the cluster down), so this sticks."""
    wait_for(f"KubeRay to initialise RayJob {name}",
             lambda: (get(cluster, "rayjob", name, "-n", ns) or {}).get("status", {}).get("jobDeploymentStatus"), cluster)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    patch = {"status": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
                        "message": "Job entrypoint command failed with exit code 1", "endTime": now}}
    cluster.kubectl("patch", "rayjob", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def test_example_becomes_a_running_rayjob_cluster_and_pods(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(), "-n", namespace)
    status = wait_phase(k8s_cluster, namespace, "Running")
    cond = conditions(status)
    assert cond["Running"]["status"] == cond["ClusterReady"]["status"] == cond["Staged"]["status"] == "True"
    assert cond["Failed"]["status"] == cond["Suspended"]["status"] == "False"
    assert status["rayJobName"] == JOB and status["restarts"] == 0 and status["observedGeneration"] == 1
    assert status["dashboardURL"].startswith("http://") and status["rayClusterName"].startswith(JOB)

    job = get_json(k8s_cluster, "rltj", JOB, "-n", namespace)
    [ray_job] = owned(k8s_cluster, "rayjobs", namespace)
    assert ray_job["metadata"]["name"] == JOB
    for kind in ("rayjobs", "configmaps", "serviceaccounts", "roles", "rolebindings", "networkpolicies"):
        for obj in owned(k8s_cluster, kind, namespace):
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [job["metadata"]["uid"]], kind
    [cluster] = owned(k8s_cluster, "rayclusters", namespace)
    assert cluster["metadata"]["name"] == status["rayClusterName"]
    pods = get_json(k8s_cluster, "pods", "-n", namespace, "-l", f"ray.io/cluster={cluster['metadata']['name']}")["items"]
    assert sorted(p["metadata"]["labels"]["kuberl.dev/role"] for p in pods) == ["head", "rollout", "trainer"]
    assert {p["status"]["phase"] for p in pods} == {"Running"}

    row = printed_row(k8s_cluster.kubectl("get", "rltj", JOB, "-n", namespace, "-o", "wide").stdout)
    assert (row["NAME"], row["PHASE"], row["TOTAL"], row["RESTARTS"], row["RAYJOB"]) == (JOB, "Running", "20", "0", JOB)

    events = get_json(k8s_cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")
    assert {"Creating", "Running"} <= {e["reason"] for e in events["items"]}
    metrics = operator.metrics()
    assert 'kuberl_operator_jobs{phase="Running"} 1.0' in metrics
    assert "kuberl_operator_reconcile_duration_seconds_count" in metrics


def test_failed_rayjob_restarts_from_checkpoint_then_fails_after_backoff_limit(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(backoffLimit=1, checkpoint={"uri": "s3://kuberl-ckpt/tiny"}), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    # The workload reports a checkpoint through its own per-job identity (patch on its status only).
    # Whatever it writes there must not steer the restart: a claim of someone else's to mount.
    workload = k8s_cluster.client_for_service_account(namespace, f"{JOB}-workload")
    checkpoint = {"uri": "pvc://someone-elses-claim/secrets", "step": 10, "time": "2026-01-01T00:00:00Z"}
    kubernetes.client.CustomObjectsApi(workload).patch_namespaced_custom_object_status(
        "kuberl.dev", "v1alpha1", namespace, "rltrainingjobs", JOB, {"status": {"lastCheckpoint": checkpoint}})

    fail_ray_job(k8s_cluster, namespace, JOB)
    wait_for("RayJob grpo-tiny-cpu-r1", lambda: get(k8s_cluster, "rayjob", f"{JOB}-r1", "-n", namespace), k8s_cluster)
    status = wait_for("restarts == 1", lambda: (s := job_status(k8s_cluster, namespace)).get("restarts") == 1 and s, k8s_cluster)
    assert status["lastCheckpoint"]["uri"] == checkpoint["uri"], "the operator must never overwrite the workload's fields"
    config = get_json(k8s_cluster, "configmap", f"{JOB}-config", "-n", namespace)
    annotations = yaml.safe_load(config["data"][CONFIG_FILE])["metadata"]["annotations"]
    assert annotations["kuberl.dev/attempt"] == "1"
    # The restart resumes from the newest checkpoint under spec.checkpoint.uri, decided from the spec.
    assert plans.read(config["data"][PLAN_FILE]).resume == plans.Resume(newest_under="s3://kuberl-ckpt/tiny")
    restarted = get(k8s_cluster, "rayjob", f"{JOB}-r1", "-n", namespace)
    assert "someone-elses-claim" not in json.dumps(restarted)
    wait_for("the failed RayJob to be deleted", lambda: get(k8s_cluster, "rayjob", JOB, "-n", namespace) is None, k8s_cluster)

    fail_ray_job(k8s_cluster, namespace, f"{JOB}-r1")
    status = wait_phase(k8s_cluster, namespace, "Failed")
    failed = conditions(status)["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
    assert "AppFailed" in failed["message"] and status["restarts"] == 1 and status["completionTime"]
    assert [rj["metadata"]["name"] for rj in owned(k8s_cluster, "rayjobs", namespace)] == [f"{JOB}-r1"]
    reasons = [e["reason"] for e in get_json(k8s_cluster, "events", "-n", namespace, "--field-selector",
                                             f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")["items"]]
    assert "Restarting" in reasons and "Failed" in reasons
    assert "kuberl_operator_restarts_total 1.0" in operator.metrics()


def test_suspend_removes_the_cluster_and_resume_brings_it_back(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    k8s_cluster.kubectl("patch", "rltj", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    status = wait_for("Suspended, cluster gone",
                      lambda: (s := job_status(k8s_cluster, namespace)).get("phase") == "Suspended"
                      and conditions(s)["Suspended"]["reason"] == "Suspended"
                      and not owned(k8s_cluster, "rayclusters", namespace) and s, k8s_cluster, timeout=90)
    assert conditions(status)["Suspended"]["status"] == "True"
    assert all(rj["spec"].get("suspend") for rj in owned(k8s_cluster, "rayjobs", namespace))

    k8s_cluster.kubectl("patch", "rltj", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    status = wait_phase(k8s_cluster, namespace, "Running")
    assert conditions(status)["Suspended"]["status"] == "False"
    assert len(owned(k8s_cluster, "rayclusters", namespace)) == 1


def test_immutable_spec_change_is_refused(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    k8s_cluster.kubectl("patch", "rltj", JOB, "-n", namespace, "--type=merge", "-p",
                        '{"spec":{"model":{"uri":"s3://other-bucket/model"},"backoffLimit":5}}')
    status = wait_for("SpecChangeRefused", lambda: (s := job_status(k8s_cluster, namespace))
                      and conditions(s).get("SpecChangeRefused", {}).get("status") == "True" and s, k8s_cluster)
    message = conditions(status)["SpecChangeRefused"]["message"]
    assert "spec.model" in message and "backoffLimit" not in message
    assert status["observedGeneration"] == 2
    config = get_json(k8s_cluster, "configmap", f"{JOB}-config", "-n", namespace)
    assert "s3://other-bucket/model" not in config["data"][CONFIG_FILE]


def test_delete_removes_everything_it_owns(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    assert owned(k8s_cluster, "pods", namespace)
    k8s_cluster.kubectl("delete", "rltj", JOB, "-n", namespace, "--wait=false")

    def all_gone():
        left = {kind: len(owned(k8s_cluster, kind, namespace))
                for kind in ("rayjobs", "rayclusters", "pods", "configmaps", "serviceaccounts", "roles", "rolebindings")}
        return not any(left.values()) or None

    wait_for("every owned object to be garbage-collected", all_gone, k8s_cluster, timeout=120)


def test_operator_killed_mid_reconcile_leaves_no_duplicates_or_orphans(k8s_cluster, namespace, operator):
    names = [f"job-{i}" for i in range(6)]
    apply(k8s_cluster, [example(n) for n in names], "-n", namespace)
    # SIGKILL as soon as the first RayJob exists: the others are half-way (some objects applied,
    # some not, statuses unwritten).
    wait_for("a first RayJob", lambda: get_json(k8s_cluster, "rayjobs", "-n", namespace)["items"], k8s_cluster,
             interval=0.05)
    operator.kill()
    operator.start()
    for name in names:
        wait_phase(k8s_cluster, namespace, "Running", name=name, timeout=120)
    ray_jobs = get_json(k8s_cluster, "rayjobs", "-n", namespace)["items"]
    assert sorted(rj["metadata"]["name"] for rj in ray_jobs) == names
    for kind in ("rayclusters", "configmaps", "serviceaccounts", "roles", "rolebindings"):
        items = [o for o in get_json(k8s_cluster, kind, "-n", namespace, "-l", "kuberl.dev/job")["items"]]
        assert sorted(o["metadata"]["labels"]["kuberl.dev/job"] for o in items) == names, kind
        assert all(o["metadata"].get("ownerReferences") for o in items), f"orphaned {kind}"


def test_operator_identity_is_exactly_the_charts_rbac(k8s_cluster, namespace, operator):
    account = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"

    def can(verb, resource, ns=namespace, subresource=None):
        args = ["auth", "can-i", verb, resource, f"--as={account}"] + (["-n", ns] if ns else [])
        args += [f"--subresource={subresource}"] if subresource else []
        return k8s_cluster.kubectl(*args, check=False).stdout.strip() == "yes"

    assert can("create", "rayjobs.ray.io") and can("patch", "rltrainingjobs.kuberl.dev", subresource="status")
    assert not can("get", "secrets"), "the operator never reads Secrets"
    assert not can("create", "rayjobs.ray.io", ns="default"), "namespaced install: nothing outside its namespaces"
    assert not can("create", "clusterroles", ns=None)
    # And it works with only that: the first test's flow, briefly.
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")


def rollout_group(cluster, ns) -> dict:
    [ray_cluster] = owned(cluster, "rayclusters", ns)
    return next(g for g in ray_cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "rollout")


def rollout_pods(cluster, ns) -> list[str]:
    return sorted(p["metadata"]["name"] for p in get_json(cluster, "pods", "-n", ns, "-l", "ray.io/group=rollout")["items"]
                  if not p["metadata"].get("deletionTimestamp"))


def test_rollout_replicas_resize_live_and_scale_down_deletes_the_pod_without_a_live_engine(k8s_cluster, namespace, operator):
    """The operator's side of a live resize, with the real KubeRay: up at once; down only once the
    driver (here its identity, patching status.rollout as the driver does) names the pods its
    live engines run in, and the other pod goes. The attempt stays the same throughout."""
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    [first] = rollout_pods(k8s_cluster, namespace)
    resize = ["patch", "rltj", JOB, "-n", namespace, "--type=merge", "-p"]

    k8s_cluster.kubectl(*resize, '{"spec":{"rollout":{"replicas":2}}}')
    wait_for("2 rollout pods", lambda: len(rollout_pods(k8s_cluster, namespace)) == 2, k8s_cluster, timeout=90)
    assert rollout_group(k8s_cluster, namespace)["replicas"] == 2
    config = get_json(k8s_cluster, "configmap", f"{JOB}-config", "-n", namespace)
    assert yaml.safe_load(config["data"][CONFIG_FILE])["spec"]["rollout"]["replicas"] == 2  # a restart runs 2
    assert plans.read(config["data"][PLAN_FILE]).layout.rollout_pods == 2
    [added] = set(rollout_pods(k8s_cluster, namespace)) - {first}

    k8s_cluster.kubectl(*resize, '{"spec":{"rollout":{"replicas":1}}}')
    workload = k8s_cluster.client_for_service_account(namespace, f"{JOB}-workload")
    wait_for("the ConfigMap's replicas 1", lambda: yaml.safe_load(get_json(
        k8s_cluster, "configmap", f"{JOB}-config", "-n", namespace)["data"][CONFIG_FILE])["spec"]["rollout"]["replicas"] == 1,
        k8s_cluster)
    assert rollout_group(k8s_cluster, namespace)["replicas"] == 2, "no pod goes before the driver retired an engine"
    # The driver retired the engine on the FIRST pod (KubeRay alone would pick either).
    kubernetes.client.CustomObjectsApi(workload).patch_namespaced_custom_object_status(
        "kuberl.dev", "v1alpha1", namespace, "rltrainingjobs", JOB,
        {"status": {"rollout": {"attempt": 0, "replicas": 1, "enginePods": [added]},
                    "recoveries": {"resize": {"count": 2, "lastSeconds": 1.5}}}})
    wait_for("the pod without an engine gone", lambda: rollout_pods(k8s_cluster, namespace) == [added], k8s_cluster, timeout=90)
    group = rollout_group(k8s_cluster, namespace)
    assert group["replicas"] == 1 and group["scaleStrategy"]["workersToDelete"] == [first]
    status = wait_for("resize Event posted", lambda: (s := job_status(k8s_cluster, namespace)).get(
        "recoveryEvents", {}).get("resize") == 2 and s, k8s_cluster)
    assert status["phase"] == "Running" and status["restarts"] == 0
    assert conditions(status)["SpecChangeRefused"]["status"] == "False"
    events = get_json(k8s_cluster, "events", "-n", namespace, "--field-selector",
                      f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")["items"]
    resizing = " ".join(e["message"] for e in events if e["reason"] == "Resizing")
    assert "rollout.replicas 1 -> 2" in resizing and f"2 -> 1: RayCluster" in resizing and first in resizing
    assert "Resized" in {e["reason"] for e in events}
    assert [rj["metadata"]["name"] for rj in owned(k8s_cluster, "rayjobs", namespace)] == [JOB]
