"""`helm install` into the real API server (with the real KubeRay operator), then the example
manifest: the operator, running with only the chart's RBAC, turns it into a RayJob."""

from __future__ import annotations

import pytest

from tests.cluster.chart.release import install, uninstall
from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import get_json, wait_for

pytestmark = pytest.mark.cluster
EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml"


@pytest.fixture
def release(k8s_cluster, tmp_path):
    release = install(k8s_cluster, tmp_path)
    yield release
    uninstall(k8s_cluster, release)


def test_install_then_example_gives_a_ray_job(k8s_cluster, release):
    ns = release.watched
    crd = get_json(k8s_cluster, "crd", "rltrainingjobs.kuberl.dev")
    assert crd["spec"]["group"] == "kuberl.dev"
    # Installed with the CRD (crds/): what keeps a job's pods to the driver's status fields.
    policy = get_json(k8s_cluster, "validatingadmissionpolicybinding", "workload-status.rltrainingjobs.kuberl.dev")
    assert policy["spec"]["validationActions"] == ["Deny"]
    service = get_json(k8s_cluster, "service", f"{release.name}-kuberl-operator-metrics", "-n", release.namespace)
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    dashboards = get_json(k8s_cluster, "configmaps", "-n", release.namespace, "-l", "grafana_dashboard=1")["items"]
    assert len(dashboards) == 2
    # NOTES name the next commands for this release.
    assert f"rollout status deployment/{release.name}-kuberl-operator" in release.notes
    assert f"kubectl apply -n {ns} -f" in release.notes

    k8s_cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    ray_jobs = wait_for("the operator to create a RayJob for the example",
                        lambda: get_json(k8s_cluster, "rayjobs", "-n", ns)["items"], k8s_cluster, timeout=90)
    ray_job, = ray_jobs
    owner, = ray_job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("RLTrainingJob", "grpo-tiny-cpu")
    # The real KubeRay operator picks it up and creates the RayCluster.
    wait_for("KubeRay to create the RayJob's RayCluster",
             lambda: get_json(k8s_cluster, "rayclusters", "-n", ns)["items"], k8s_cluster, timeout=90)
    status = wait_for("the RLTrainingJob status to report the RayJob",
                      lambda: get_json(k8s_cluster, "rltj", "grpo-tiny-cpu", "-n", ns).get("status", {}).get("phase"),
                      k8s_cluster, timeout=60)
    assert status in {"Staging", "Starting", "Running"}


def test_operator_identity_is_limited_to_the_watched_namespace(k8s_cluster, release):
    """The chart's RBAC in namespace-scoped mode: the operator's ServiceAccount may create RayJobs
    where it watches and nowhere else."""
    account = f"system:serviceaccount:{release.namespace}:{release.name}-kuberl-operator"
    can = lambda *args: k8s_cluster.kubectl("auth", "can-i", *args, "--as", account, check=False).stdout.strip()
    assert can("create", "rayjobs.ray.io", "-n", release.watched) == "yes"
    assert can("create", "rayjobs.ray.io", "-n", "default") == "no"
    assert can("delete", "pods", "-n", release.watched) == "no"
