"""The real KubeRay operator reconciles hand-written RayCluster/RayJob objects;
KWOK runs the pods it creates."""

from __future__ import annotations

import pytest

from tests.harness.helpers import apply, get_json, pod_phases, wait_for

pytestmark = pytest.mark.cluster

RAY_IMAGE = "rayproject/ray:2.49.0"  # never pulled: KWOK only pretends to run it


def _ray_container(name: str, gpus: int) -> dict:
    limits = {"cpu": "2", "memory": "4Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"name": name, "image": RAY_IMAGE, "resources": {"limits": limits, "requests": limits}}


def ray_cluster_spec(workers: int) -> dict:
    return {
        "headGroupSpec": {
            "rayStartParams": {},
            "template": {"spec": {"containers": [_ray_container("ray-head", 0)]}},
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": {},
                "template": {"spec": {"containers": [_ray_container("ray-worker", 8)]}},
            }
        ],
    }


def wait_for_running_ray_pods(cluster, namespace: str, ray_cluster: str, workers: int) -> dict[str, str]:
    """Head and every worker of `ray_cluster` Running (KubeRay labels its pods ray.io/cluster)."""

    def running():
        phases = pod_phases(cluster, namespace, f"ray.io/cluster={ray_cluster}")
        heads = pod_phases(cluster, namespace, f"ray.io/cluster={ray_cluster},ray.io/node-type=head")
        ok = len(phases) == workers + 1 and len(heads) == 1 and set(phases.values()) == {"Running"}
        return phases if ok else None

    return wait_for(f"RayCluster {ray_cluster}: 1 head + {workers} workers Running", running, cluster, timeout=90)


def test_raycluster_is_reconciled_into_running_head_and_workers(k8s_cluster, namespace):
    apply(
        k8s_cluster,
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "by-hand", "namespace": namespace},
            "spec": ray_cluster_spec(workers=2),
        },
    )
    phases = wait_for_running_ray_pods(k8s_cluster, namespace, "by-hand", workers=2)
    assert len(phases) == 3
    # Every GPU worker landed on a fake GPU node.
    workers = get_json(k8s_cluster, "pods", "-n", namespace, "-l", "ray.io/cluster=by-hand,ray.io/node-type=worker")
    assert {p["spec"]["nodeName"] for p in workers["items"]} <= set(k8s_cluster.node_names)
    services = get_json(k8s_cluster, "services", "-n", namespace, "-l", "ray.io/cluster=by-hand")["items"]
    assert services, "KubeRay creates the head service"
    state = wait_for(
        "RayCluster by-hand status.state",
        lambda: get_json(k8s_cluster, "raycluster", "by-hand", "-n", namespace).get("status", {}).get("state"),
        k8s_cluster,
    )
    assert state == "ready"


def test_rayjob_is_reconciled_into_a_raycluster_with_running_pods(k8s_cluster, namespace):
    apply(
        k8s_cluster,
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "job-by-hand", "namespace": namespace},
            "spec": {
                "entrypoint": "python -c 'print(1)'",
                "rayClusterSpec": ray_cluster_spec(workers=1),
            },
        },
    )
    name = wait_for(
        "RayJob job-by-hand status.rayClusterName",
        lambda: get_json(k8s_cluster, "rayjob", "job-by-hand", "-n", namespace).get("status", {}).get("rayClusterName"),
        k8s_cluster,
    )
    ray_cluster = get_json(k8s_cluster, "raycluster", name, "-n", namespace)
    owners = [(o["kind"], o["name"]) for o in ray_cluster["metadata"].get("ownerReferences", [])]
    assert ("RayJob", "job-by-hand") in owners
    wait_for_running_ray_pods(k8s_cluster, namespace, name, workers=1)
