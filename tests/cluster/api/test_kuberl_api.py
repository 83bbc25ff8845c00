"""Our RLTrainingJob API against the real API server and the real KubeRay operator.

The CRD (crds/), the examples (examples/), the bad-manifest table
(tests/unit/api/bad_manifests.py) and `kuberl.job.render.render_manifest` are the
foundation issue's; this checks that the API server agrees with them, and
that it accepts every spec the API types allow and `kuberl render` accepts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings

from tests.unit.api.spec_strategies import local_verdict, manifests
from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import get_json, wait_for
from tests.cluster.harness.test_kuberay import wait_for_running_ray_pods

pytestmark = pytest.mark.cluster

CRD_FILE = REPO_ROOT / "crds" / "rltrainingjobs.kuberl.dev.yaml"
CRD_NAME = "rltrainingjobs.kuberl.dev"
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
TINY_EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml"


def _bad_manifests():
    from tests.unit.api.bad_manifests import BAD_MANIFESTS

    return BAD_MANIFESTS


@pytest.fixture(scope="module")
def kuberl_crd(k8s_cluster):
    """Install crds/rltrainingjobs.kuberl.dev.yaml (server-side apply) and wait until Established."""
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    return CRD_NAME


def test_our_crd_installs_and_is_served(k8s_cluster, kuberl_crd, namespace):
    crd = get_json(k8s_cluster, "crd", kuberl_crd)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"
    assert "rltj" in crd["spec"]["names"].get("shortNames", [])
    # The short name resolves through discovery and the list is served.
    assert "No resources found" in k8s_cluster.kubectl("get", "rltj", "-n", namespace).stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(k8s_cluster, kuberl_crd, namespace, example: Path):
    dry = k8s_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example), check=False)
    assert dry.returncode == 0, f"server dry-run rejected {example.name}: {dry.stderr}"
    created = k8s_cluster.kubectl("create", "-n", namespace, "-f", str(example), "-o", "json", check=False)
    assert created.returncode == 0, f"create rejected {example.name}: {created.stderr}"
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    jobs = [d for d in docs if d.get("kind") == "RLTrainingJob"]
    assert jobs, f"{example.name} holds no RLTrainingJob"
    for job in jobs:
        stored = get_json(k8s_cluster, "rltj", job["metadata"]["name"], "-n", namespace)
        # Structural schema pruning keeps every field the example sets.
        assert _is_subset(job["spec"], stored["spec"]), (
            f"{example.name}: the API server pruned or changed fields: sent {job['spec']}, stored {stored['spec']}"
        )


def _is_subset(sent, stored) -> bool:
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and _is_subset(v, stored[k]) for k, v in sent.items())
    if isinstance(sent, list):
        return isinstance(stored, list) and len(sent) == len(stored) and all(map(_is_subset, sent, stored))
    if isinstance(sent, float) and isinstance(stored, (int, float)):
        return float(stored) == sent
    return sent == stored


def _create(cluster, manifest: dict, namespace: str):
    manifest = copy.deepcopy(manifest)
    if isinstance(manifest.get("metadata"), dict):
        manifest["metadata"]["namespace"] = namespace
    return cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(manifest), check=False)


@pytest.mark.parametrize("case", [c for c in _bad_manifests() if c.server], ids=lambda case: case.id)
def test_bad_manifest_is_rejected_by_the_api_server(k8s_cluster, kuberl_crd, namespace, case):
    result = _create(k8s_cluster, case.manifest, namespace)
    assert result.returncode != 0, f"{case.id}: the API server accepted a manifest that must be rejected"
    assert case.message in result.stderr, (
        f"{case.id}: expected {case.message!r} in the API server's error, got: {result.stderr.strip()}"
    )


@pytest.mark.parametrize("case", [c for c in _bad_manifests() if not c.server], ids=lambda case: case.id)
def test_what_the_api_server_lets_through_the_renderer_rejects(k8s_cluster, kuberl_crd, namespace, case):
    from kuberl.api.uri import URIError
    from kuberl.api.validate import ManifestError
    from kuberl.job.render import render_manifest
    from kuberl.api.uri import URIError

    result = _create(k8s_cluster, case.manifest, namespace)
    assert result.returncode == 0, (
        f"{case.id} is marked server=False but the API server rejected it: {result.stderr.strip()}"
    )
    stored = json.loads(result.stdout)
    job = {key: stored[key] for key in ("apiVersion", "kind", "spec")}
    job["metadata"] = {k: stored["metadata"][k] for k in ("name", "namespace", "uid")}
    with pytest.raises((ManifestError, URIError)) as info:
        render_manifest(job)
    assert case.message in str(info.value)


# Valid scheduling blocks without nodeSelector: the API server refused each with "no such key:
# nodeSelector" while `kuberl render` accepted it, so no job could set a queue or tolerations alone.
SCHEDULING_WITHOUT_NODE_SELECTOR = {
    "empty": {},
    "tolerations-only": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "priority-class-only": {"priorityClassName": "high-priority"},
    "queue-only": {"queueName": "team-a"},
}


@pytest.mark.parametrize("scheduling", SCHEDULING_WITHOUT_NODE_SELECTOR.values(),
                         ids=SCHEDULING_WITHOUT_NODE_SELECTOR.keys())
def test_a_scheduling_block_without_node_selector_is_accepted(k8s_cluster, kuberl_crd, namespace, scheduling):
    from kuberl.job.render import render_manifest
    from tests.unit.api.bad_manifests import minimal_manifest

    manifest = minimal_manifest("scheduling")
    manifest["spec"]["scheduling"] = scheduling
    assert "RayJob" in [o["kind"] for o in render_manifest(manifest)]
    result = _create(k8s_cluster, manifest, namespace)
    assert result.returncode == 0, f"the API server refused {scheduling}: {result.stderr.strip()}"


def _server_verdict(cluster, namespace: str, manifest: dict) -> str | None:
    """None when the API server accepts ``manifest`` in a server-side dry run (nothing is stored),
    else its message."""
    from kubernetes.client import CustomObjectsApi
    from kubernetes.client.exceptions import ApiException

    from kuberl.api.types import GROUP, PLURAL, VERSION

    try:
        CustomObjectsApi(cluster.api_client()).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All")
    except ApiException as exc:
        if exc.status != 422:  # Unprocessable: the object is invalid; anything else is the harness's
            raise
        return json.loads(exc.body)["message"]
    return None


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(manifest=manifests())
def test_the_api_server_accepts_every_spec_render_accepts(k8s_cluster, kuberl_crd, namespace, manifest):
    """Specs drawn from the API types (tests/unit/api/spec_strategies.py), each to the API server in a
    server-side dry run: every one `kuberl render` accepts, the server accepts; so what the
    server refuses, render refuses too (render may refuse more: its checks go deeper). Neither
    refuses one because a rule could not be evaluated. The namespace is shared by the examples:
    a dry run stores nothing."""
    local = local_verdict(manifest)
    server = _server_verdict(k8s_cluster, namespace, manifest)
    event(f"render {'accepts' if local is None else 'refuses'}, API server {'accepts' if server is None else 'refuses'}")
    assert server is None or local is not None, (
        f"the API server refuses what kuberl render accepts: {server}\nspec: {json.dumps(manifest['spec'])}")
    # A rule that cannot be evaluated is the CRD's fault, whoever reports it: the spec is one the
    # types allow, and the user could not fix it.
    assert "evaluating rule" not in (server or ""), f"{server}\nspec: {json.dumps(manifest['spec'])}"
    assert "could not be evaluated" not in (local or ""), local


def test_rendered_rayjob_runs_and_deleting_the_job_collects_everything(k8s_cluster, kuberl_crd, namespace):
    from kuberl.job.render import render_manifest

    manifest = yaml.safe_load(TINY_EXAMPLE.read_text())
    manifest["metadata"]["namespace"] = namespace
    created = json.loads(
        k8s_cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(manifest)).stdout
    )
    # What the operator would render for the stored object (now with a uid to own things).
    job = {
        "apiVersion": created["apiVersion"],
        "kind": created["kind"],
        "metadata": {k: created["metadata"][k] for k in ("name", "namespace", "uid")},
        "spec": created["spec"],
    }
    objects = render_manifest(job)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["RayJob", "ConfigMap", "NetworkPolicy", "ServiceAccount", "Role", "RoleBinding"]), kinds
    for obj in objects:
        obj["metadata"].setdefault("namespace", namespace)
        owners = obj["metadata"].get("ownerReferences", [])
        assert any(o["uid"] == created["metadata"]["uid"] for o in owners), f"{obj['kind']} is not owned by the job"
    k8s_cluster.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )

    ray_job = next(o for o in objects if o["kind"] == "RayJob")
    workers = sum(g.get("replicas", 1) for g in ray_job["spec"]["rayClusterSpec"].get("workerGroupSpecs", []))
    ray_cluster = wait_for(
        "RayJob status.rayClusterName",
        lambda: get_json(k8s_cluster, "rayjob", ray_job["metadata"]["name"], "-n", namespace)
        .get("status", {})
        .get("rayClusterName"),
        k8s_cluster,
    )
    wait_for_running_ray_pods(k8s_cluster, namespace, ray_cluster, workers=workers)

    k8s_cluster.kubectl("delete", "rltj", job["metadata"]["name"], "-n", namespace, "--wait=false")

    def everything_gone():
        left = []
        for obj in objects:
            kind = obj["kind"].lower()
            if k8s_cluster.kubectl("get", kind, obj["metadata"]["name"], "-n", namespace, check=False).returncode == 0:
                left.append(f"{obj['kind']}/{obj['metadata']['name']}")
        if k8s_cluster.kubectl("get", "raycluster", ray_cluster, "-n", namespace, check=False).returncode == 0:
            left.append(f"RayCluster/{ray_cluster}")
        pods = get_json(k8s_cluster, "pods", "-n", namespace, "-l", f"ray.io/cluster={ray_cluster}")["items"]
        left += [f"Pod/{p['metadata']['name']}" for p in pods]
        return not left or None

    wait_for("garbage collection of everything the RLTrainingJob owned", everything_gone, k8s_cluster, timeout=120)


def test_a_colocated_jobs_rollout_replicas_cannot_change_and_a_separate_pools_can(k8s_cluster, kuberl_crd, namespace):
    """The CEL transition rule on spec.rollout: the API server refuses a colocated job's rollout
    resize, naming why; a job with its own rollout pods takes it (the operator applies it live)."""
    for example, name in (("grpo-colocated.yaml", "colocated"), ("grpo-tiny-cpu.yaml", "separate")):
        manifest = yaml.safe_load((REPO_ROOT / "examples" / example).read_text())
        manifest["metadata"] = {"name": name}
        assert _create(k8s_cluster, manifest, namespace).returncode == 0
    patch = ["patch", "rltj", "-n", namespace, "--type=merge", "-p", '{"spec":{"rollout":{"replicas":3}}}']
    refused = k8s_cluster.kubectl(*patch[:2], "colocated", *patch[2:], check=False)
    assert refused.returncode != 0 and "spec.rollout.replicas" in refused.stderr
    assert "rollout.replicas cannot change on a colocated job" in refused.stderr
    assert k8s_cluster.kubectl(*patch[:2], "separate", *patch[2:], check=False).returncode == 0
