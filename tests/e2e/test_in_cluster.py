"""Groundwork for the product end to end in pods (on the real-node cluster, tests/cluster/nodes.py):
the operator installed by `helm install` of charts/kuberl from its built image, running in the
cluster under the chart's own RBAC; and an S3 server (moto's, as in tests/storage) that pods reach
through a Service, staged from by the stager image in a pod."""

from __future__ import annotations

import sys
import uuid

import pytest

from tests.cluster.harness import REPO_ROOT, free_port
from tests.cluster.helpers import apply, get_json, wait_for
from tests.cluster.images import public_name

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def images_loaded(real_cluster):
    real_cluster.load_images(("operator", "stager"))


def test_the_operator_runs_as_a_pod_installed_by_helm_under_the_charts_rbac(real_cluster, images_loaded):
    namespace = f"kuberl-{uuid.uuid4().hex[:6]}"
    real_cluster.helm("install", "kuberl", str(REPO_ROOT / "charts" / "kuberl"), "-n", namespace, "--create-namespace",
                      "--wait", "--timeout", "5m")
    deployment = get_json(real_cluster, "deployment", "-n", namespace, "-l", "app.kubernetes.io/name=kuberl")["items"][0]
    assert deployment["status"].get("availableReplicas") == 1
    pods = get_json(real_cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/name=kuberl")["items"]
    pod, = pods
    assert pod["spec"]["containers"][0]["image"] == public_name("operator")
    assert pod["spec"]["serviceAccountName"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert pod["spec"]["nodeName"].startswith("real-node-")
    # It talks to the API server from inside the cluster (the `kubernetes` Service) with its own token.
    log = wait_for("the operator's log", lambda: real_cluster.kubectl("logs", pod["metadata"]["name"], "-n", namespace).stdout,
                   real_cluster, timeout=60)
    assert "Forbidden" not in log and "Traceback" not in log, log
    real_cluster.helm("uninstall", "kuberl", "-n", namespace, "--wait")


def test_a_pod_stages_from_an_s3_server_behind_a_service(real_cluster, images_loaded, tmp_path):
    import boto3

    namespace = f"s3-{uuid.uuid4().hex[:6]}"
    port = free_port()
    url = real_cluster.serve_in_network("s3", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)], port, namespace)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **{k.lower(): v for k, v in S3_CREDENTIALS.items()
                                                                         if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="tiny/config.json", Body=b'{"hidden_size": 64}')
    s3.put_object(Bucket="models", Key="tiny/weights.bin", Body=b"\0" * 4096)
    real_cluster.kubectl("create", "secret", "generic", "s3", "-n", namespace,
                         *(f"--from-literal={k}={v}" for k, v in S3_CREDENTIALS.items()),
                         f"--from-literal=AWS_ENDPOINT_URL_S3={url}")
    wait_for(f"ServiceAccount {namespace}/default",
             lambda: real_cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode == 0, real_cluster)
    node = real_cluster.real_nodes[-1].name
    apply(real_cluster, {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stage"},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "initContainers": [{
                "name": "stage", "image": public_name("stager"), "imagePullPolicy": "Never",
                "args": ["s3://models/tiny", "/models/tiny"], "envFrom": [{"secretRef": {"name": "s3"}}],
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }],
            "containers": [{
                "name": "show", "image": public_name("stager"), "imagePullPolicy": "Never",
                "command": ["sh", "-c", "ls /models/tiny && cat /models/tiny/config.json"],
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }],
            "volumes": [{"name": "models", "emptyDir": {}}],
        },
    }, "-n", namespace)

    def succeeded():
        phase = get_json(real_cluster, "pod", "stage", "-n", namespace).get("status", {}).get("phase")
        if phase == "Failed":
            raise AssertionError(real_cluster.kubectl("logs", "stage", "-c", "stage", "-n", namespace, check=False).stdout)
        return phase == "Succeeded"

    wait_for("the staging pod", succeeded, real_cluster, timeout=180, interval=1)
    log = real_cluster.kubectl("logs", "stage", "-c", "show", "-n", namespace).stdout
    assert "config.json" in log and "weights.bin" in log and '{"hidden_size": 64}' in log
