"""The images of images/Dockerfile, built for real from their targets (tests/harness/images.py:
podman, on the local Debian base) and run as pods on a real node: each entrypoint's `--help`, `id`
as the non-root user the pods run as, and the worker-cpu image importing its training stack."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.conftest import PRODUCT_IMAGES
from tests.harness.helpers import apply, get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

@pytest.fixture(scope="module")
def node(real_cluster) -> str:
    """The node the pods run on."""
    return real_cluster.real_nodes[0].name


def load(cluster, node: str, image: str) -> str:
    """The image in `node`. The product's images (tests/e2e's fixture) go into every node at once,
    as that fixture loads them: in a session that runs both, one `podman save` of the several-GB
    worker-cpu feeds both nodes' imports (the save costs as much as an import), and the product
    finds them there. Others go into `node` alone."""
    times = cluster.load_images((image,), node_names=None if image in PRODUCT_IMAGES else [node])
    print("image build/import seconds:", {k: round(v, 1) for k, v in times.items()})
    return public(image)


@pytest.fixture(scope="module")
def namespace(real_cluster):
    name = f"img-{uuid.uuid4().hex[:8]}"
    real_cluster.kubectl("create", "namespace", name)
    wait_for(f"ServiceAccount {name}/default",
             lambda: real_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0, real_cluster)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def run_pod(cluster, namespace: str, node: str, name: str, image: str, containers: dict[str, dict], timeout: float = 300) -> dict[str, str]:
    """Run `containers` (name -> command/args) one after the other (init containers, then the last
    as the main one) in a pod of `image`; return each container's log."""
    specs = [{"name": c, "image": image, "imagePullPolicy": "Never", **spec} for c, spec in containers.items()]
    apply(cluster, {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": node, "restartPolicy": "Never", "initContainers": specs[:-1], "containers": specs[-1:]},
    }, "-n", namespace)

    def finished():
        phase = get_json(cluster, "pod", name, "-n", namespace).get("status", {}).get("phase")
        if phase == "Failed":
            raise AssertionError(cluster.kubectl("describe", "pod", name, "-n", namespace).stdout)
        return phase == "Succeeded"

    wait_for(f"pod {name} Succeeded", finished, cluster, timeout=timeout, interval=1)
    return {c: cluster.kubectl("logs", name, "-c", c, "-n", namespace).stdout for c in containers}


def public(name: str) -> str:
    from tests.harness.images import public_name

    return public_name(name)


def test_operator_image(real_cluster, node, namespace):
    logs = run_pod(real_cluster, namespace, node, "operator", load(real_cluster, node, "operator"), {
        "help": {"args": ["--help"]},
        "id": {"command": ["id"]},
    })
    assert "usage: kuberl-operator" in logs["help"]
    assert logs["id"].startswith("uid=1000(kuberl) gid=1000(kuberl)")


def test_stager_image(real_cluster, node, namespace):
    logs = run_pod(real_cluster, namespace, node, "stager", load(real_cluster, node, "stager"), {
        "help": {},  # the image's CMD is --help
        "id": {"command": ["id"]},
    })
    assert "usage: kuberl stage" in logs["help"]
    assert logs["id"].startswith("uid=1000(kuberl) gid=1000(kuberl)")


def test_worker_cpu_image_imports_its_stack(real_cluster, node, namespace):
    imports = ("import importlib.util, os, torch, vllm, ray, kuberl, kuberl.train; "
               "print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__); "
               "print('bytecode', all(os.path.exists(importlib.util.cache_from_source(m.__file__)) "
               "for m in (torch, vllm, ray, kuberl)))")
    logs = run_pod(real_cluster, namespace, node, "worker-cpu", load(real_cluster, node, "worker-cpu"), {
        "id": {"command": ["id"]},
        "help": {"command": ["kuberl", "--help"]},
        "imports": {"command": ["python", "-c", imports]},
    }, timeout=600)
    assert logs["id"].startswith("uid=1000(kuberl) gid=1000(kuberl)")
    assert "usage: kuberl" in logs["help"]
    assert "bytecode True" in logs["imports"], "site-packages ship compiled: the pods' user cannot write them"
    assert "torch 2.13.0" in logs["imports"] and "vllm 0.32.0" in logs["imports"] and " ray " in logs["imports"]
