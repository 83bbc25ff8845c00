"""docs/security.md against the real control plane: a job stored before the CEL rules that refuse
'..' (or under an older CRD) fails with the field named, once, instead of wedging its reconcile;
and the per-job NetworkPolicy is applied and owned by the job."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from kuberl.api.crd import generate_crd
from tests.harness.helpers import apply, get_json, wait_for
from tests.cluster.operator.conftest import CRD_FILE, example
from tests.cluster.operator.test_operator_cluster import JOB, conditions, owned, wait_phase

pytestmark = pytest.mark.cluster


def _crd_without_dot_segment_rules() -> dict:
    """The CRD as it was before the '..' rule: what an object stored back then went through."""
    crd = generate_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    model = spec["model"]
    model["x-kubernetes-validations"] = [r for r in model["x-kubernetes-validations"] if "'.' and '..'" not in r["message"]]
    return crd


def invalid_events(cluster, ns: str) -> list[dict]:
    return [e for e in get_json(cluster, "events", "-n", ns, "--field-selector",
                                f"involvedObject.name={JOB},involvedObject.kind=RLTrainingJob")["items"]
            if e["reason"] == "InvalidSpec"]


def test_job_with_dot_segments_fails_once_naming_the_field(k8s_cluster, namespace, operator):
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                        input=yaml.safe_dump(_crd_without_dot_segment_rules()))
    try:
        manifest = example(model={"uri": "/opt/kuberl/tiny/../../etc/model"})
        apply(k8s_cluster, manifest, "-n", namespace)
    finally:
        k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    status = wait_phase(k8s_cluster, namespace, "Failed")
    failed = conditions(status)["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "InvalidSpec")
    assert "spec.model.uri" in failed["message"] and "'..'" in failed["message"]
    assert "spec.model.uri" in status["message"] and status.get("completionTime")
    assert owned(k8s_cluster, "rayjobs", namespace) == []
    # Failed is final: resyncs (every 5 s here) neither retry nor repeat the event.
    time.sleep(12)
    assert len(invalid_events(k8s_cluster, namespace)) == 1
    assert "Traceback" not in operator.tail(400)

    # The CRD now in place refuses the same manifest up front, naming the field.
    manifest["metadata"]["name"] = "again"
    result = k8s_cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0 and "spec.model.uri" in result.stderr and "'..'" in result.stderr


def test_network_policy_guards_the_ray_pods_and_is_owned_by_the_job(k8s_cluster, namespace, operator):
    apply(k8s_cluster, example(), "-n", namespace)
    wait_phase(k8s_cluster, namespace, "Running")
    job = get_json(k8s_cluster, "rltj", JOB, "-n", namespace)
    policy, = owned(k8s_cluster, "networkpolicies", namespace)
    assert [r["uid"] for r in policy["metadata"]["ownerReferences"]] == [job["metadata"]["uid"]]
    head, = get_json(k8s_cluster, "pods", "-n", namespace, "-l", f"kuberl.dev/job={JOB},kuberl.dev/role=head")["items"]
    labels = head["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # The submitter peer selects the pod the real KubeRay creates to submit the Ray job.
    submitter, = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]
                  if "batch.kubernetes.io/job-name" in peer.get("podSelector", {}).get("matchLabels", {})]
    selector = ",".join(f"{k}={v}" for k, v in submitter["podSelector"]["matchLabels"].items())
    wait_for("KubeRay's submitter pod to match the policy's submitter peer",
             lambda: get_json(k8s_cluster, "pods", "-n", namespace, "-l", selector)["items"], k8s_cluster, timeout=90)
