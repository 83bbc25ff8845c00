"""The control plane comes up whole: nodes, controllers, RBAC, KubeRay."""

from __future__ import annotations

import json
import urllib.request

import kubernetes
import pytest

from tests.harness.harness import GPU_PRODUCT
from tests.harness.helpers import apply, get_json, wait_for

pytestmark = pytest.mark.cluster


def test_fake_gpu_nodes_are_ready_with_capacity_and_topology(k8s_cluster):
    core = kubernetes.client.CoreV1Api(k8s_cluster.api_client())
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert set(k8s_cluster.node_names) <= set(nodes)
    zones = set()
    for name in k8s_cluster.node_names:
        node = nodes[name]
        ready = {c.type: c.status for c in node.status.conditions}
        assert ready.get("Ready") == "True", f"{name}: {ready}"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.status.capacity["cpu"] == "64"
        assert node.metadata.labels["nvidia.com/gpu.product"] == GPU_PRODUCT
        zones.add(node.metadata.labels["topology.kubernetes.io/zone"])
    assert len(zones) > 1, "nodes should spread over more than one zone"


def test_every_component_is_running_and_kuberay_is_healthy(k8s_cluster):
    k8s_cluster.check_alive()
    assert set(k8s_cluster.logs()) == {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
        "kuberay-operator",
    }
    probe = f"http://127.0.0.1:{k8s_cluster.ports['kuberay-probe']}/healthz"
    with urllib.request.urlopen(probe, timeout=5) as resp:
        assert resp.status == 200
    crds = {c["metadata"]["name"] for c in get_json(k8s_cluster, "crd")["items"]}
    assert {"rayclusters.ray.io", "rayjobs.ray.io"} <= crds
    version = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")


def test_a_plain_pod_is_scheduled_and_reported_running_by_kwok(k8s_cluster, namespace):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-pod", "namespace": namespace},
        "spec": {
            "containers": [
                {"name": "main", "image": "example.invalid/never-pulled:1", "resources": {"limits": {"nvidia.com/gpu": "8"}}}
            ],
        },
    }
    apply(k8s_cluster, pod)
    running = wait_for(
        "gpu-pod Running",
        lambda: (p := get_json(k8s_cluster, "pod", "gpu-pod", "-n", namespace)).get("status", {}).get("phase") == "Running"
        and p,
        k8s_cluster,
    )
    assert running["spec"]["nodeName"] in k8s_cluster.node_names


def test_deleting_an_owner_garbage_collects_what_it_owns(k8s_cluster, namespace):
    core = kubernetes.client.CoreV1Api(k8s_cluster.api_client())
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {"a": "1"}})
    owned = {
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
            ],
        },
        "data": {"b": "2"},
    }
    core.create_namespaced_config_map(namespace, owned)
    unrelated = core.create_namespaced_config_map(namespace, {"metadata": {"name": "unrelated"}})
    core.delete_namespaced_config_map("owner", namespace)

    def owned_gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        return "owned" not in names

    wait_for("the garbage collector to delete ConfigMap 'owned'", owned_gone, k8s_cluster, timeout=60)
    assert core.read_namespaced_config_map("unrelated", namespace).metadata.uid == unrelated.metadata.uid


def test_service_account_client_has_only_the_rights_rbac_grants(k8s_cluster, namespace):
    k8s_cluster.kubectl("create", "serviceaccount", "restricted", "-n", namespace)
    k8s_cluster.kubectl(
        "create", "role", "read-configmaps", "-n", namespace, "--verb=get,list", "--resource=configmaps"
    )
    k8s_cluster.kubectl(
        "create", "rolebinding", "restricted-reads", "-n", namespace,
        "--role=read-configmaps", f"--serviceaccount={namespace}:restricted",
    )
    client = k8s_cluster.client_for_service_account(namespace, "restricted")
    core = kubernetes.client.CoreV1Api(client)
    try:
        core.list_namespaced_config_map(namespace)
        with pytest.raises(kubernetes.client.ApiException) as denied:
            core.list_namespaced_secret(namespace)
        assert denied.value.status == 403
        with pytest.raises(kubernetes.client.ApiException) as denied_elsewhere:
            core.list_namespaced_config_map("default")
        assert denied_elsewhere.value.status == 403
    finally:
        client.close()
    whoami = json.loads(
        k8s_cluster.kubectl(
            "auth", "whoami", "-o", "json",
            kubeconfig=k8s_cluster.service_account_kubeconfig(namespace, "restricted"),
        ).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:restricted"


def test_helm_installs_a_chart_whose_deployment_becomes_available(k8s_cluster, namespace, tmp_path):
    k8s_cluster.helm("create", str(tmp_path / "hello"))
    k8s_cluster.helm(
        "install", "hello", str(tmp_path / "hello"), "-n", namespace, "--wait", "--timeout=90s",
        "--set", "image.repository=example.invalid/never-pulled",
    )
    status = json.loads(k8s_cluster.helm("status", "hello", "-n", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    deployment = get_json(k8s_cluster, "deployment", "hello", "-n", namespace)
    assert deployment["status"].get("availableReplicas") == 1
