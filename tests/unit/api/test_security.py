"""The API's share of docs/security.md: revisions as git allows them (the same table in the CRD's
CEL and in parse()), no remote code staged unless trusted, and the Ray head's NetworkPolicy."""

from __future__ import annotations

import pytest

from kuberl.api.uri import URIError, parse, revision_problem
from kuberl.api.validate import ManifestError, validate_manifest
from kuberl.api.contract import RAY_DASHBOARD_PORT
from kuberl.job.render import render_manifest
from tests.unit.api.bad_manifests import minimal_manifest

GOOD = ["main", "v1.1", "refs/pr/12", "feature/x-y_z", "a" * 40, "0123456789abcdef0123456789abcdef01234567",
        "release@2", "x" * 255]
BAD = ["../../../etc", "a..b", "main.lock", "refs/x.lock/y", ".hidden", "a/.b", "@", "main@{1}", "a b", "a\tb",
       "a~1", "a^", "a:b", "a?", "a*", "a[b", "a\\b", "/main", "main/", "a//b", "main.", "x\x7f", "x" * 256]


@pytest.mark.parametrize("revision", GOOD + BAD)
def test_revision_rules_agree_between_cel_and_parse(revision):
    bad = revision in BAD
    assert (revision_problem(revision) is not None) == bad
    for edit in ({"uri": "hf://org/m", "revision": revision}, {"uri": f"hf://org/m@{revision}"},
                 {"uri": f"org/m@{revision}"}):
        manifest = minimal_manifest()
        manifest["spec"]["model"] = edit
        field = "spec.model.revision" if "revision" in edit else "spec.model.uri"
        if bad:
            with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
                validate_manifest(manifest)
            if "revision" not in edit:
                with pytest.raises(URIError):
                    parse(edit["uri"], field)
        else:
            validate_manifest(manifest)
            if "revision" not in edit:
                assert parse(edit["uri"]).revision == revision


@pytest.mark.parametrize("trust", [False, True])
def test_stage_model_leaves_python_out_unless_remote_code_is_trusted(trust):
    manifest = minimal_manifest()
    manifest["spec"]["model"]["trustRemoteCode"] = trust
    ray_job = next(o for o in render_manifest(manifest) if o["kind"] == "RayJob")
    cluster = ray_job["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for template in templates:
        stage_model = next(c for c in template["spec"]["initContainers"] if c["name"] == "stage-model")
        args = stage_model["args"]
        excluded = {args[i + 1] for i, a in enumerate(args) if a == "--exclude"}
        assert ("*.py" in excluded) is not trust


def test_network_policy_admits_only_the_job_kuberay_operators_and_prometheus_to_its_pods():
    manifest = minimal_manifest("np-job")
    manifest["metadata"]["namespace"] = "team-a"
    objects = render_manifest(manifest, attempt=2)
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert [o["kind"] for o in objects][-2:] == ["NetworkPolicy", "RayJob"]  # in place before the pods exist
    assert policy["metadata"]["namespace"] == "team-a"
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"kuberl.dev/job": "np-job"}  # the head and every worker
    assert spec["policyTypes"] == ["Ingress"]
    own, dashboard, metrics = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"kuberl.dev/job": "np-job"}}}]}
    assert dashboard["ports"] == [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}]
    submitter, kuberay, operator = dashboard["from"]
    assert submitter["podSelector"]["matchLabels"] == {"batch.kubernetes.io/job-name": "np-job-r2"}
    assert "namespaceSelector" not in submitter  # the submitter runs beside the job
    for peer in (kuberay, operator, *metrics["from"]):
        assert peer["namespaceSelector"] == {"matchLabels": {"kuberl.dev/ray-head-peers": "true"}}
    assert {p["port"] for p in metrics["ports"]} == {8080, 9400}
    # Every pod the policy lets in from the job is one of the job's own.
    ray_job = objects[-1]
    cluster = ray_job["spec"]["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        assert template["metadata"]["labels"]["kuberl.dev/job"] == "np-job"
    assert cluster["headGroupSpec"]["template"]["metadata"]["labels"]["kuberl.dev/role"] == "head"
