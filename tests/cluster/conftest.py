"""Tier 3, `tests/cluster`: the real control plane (the session's `k8s_cluster`: etcd, kube-apiserver,
KubeRay, KWOK nodes; tests/harness), and the operator as a subprocess against it."""

import uuid

import pytest

from tests.harness.helpers import wait_for
from tests.tiers import tier_marker

pytest_collection_modifyitems = tier_marker(__file__)


@pytest.fixture
def namespace(k8s_cluster):
    """A fresh namespace per test on the shared session cluster, with its `default` ServiceAccount."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_cluster.kubectl("create", "namespace", name)
    wait_for(
        f"ServiceAccount {name}/default",
        lambda: k8s_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        k8s_cluster,
    )
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
