"""tests/harness/kueue.py: Kueue's webhooks and CRDs as the test control plane installs them."""

from __future__ import annotations

import base64

from tests.harness import kueue


def _hook(name: str, group: str, resource: str) -> dict:
    return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": f"/mutate-{resource}"}},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource]}]}


def test_webhooks_call_kueue_on_loopback_with_the_harness_ca_and_only_for_what_it_manages():
    docs = [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
             "metadata": {"name": "mutating-webhook-configuration"},
             "webhooks": [_hook("mrayjob.kb.io", "ray.io", "rayjobs"), _hook("mpod.kb.io", "", "pods"),
                          _hook("mworkload.kb.io", "kueue.x-k8s.io", "workloads")]}]
    [config] = kueue.webhook_configurations(docs, 9443, b"CA PEM")
    assert config["metadata"] == {"name": "kueue-mutating-webhook-configuration"}
    # The pod webhook would stand in front of every pod of every other test: not installed.
    assert [h["name"] for h in config["webhooks"]] == ["mrayjob.kb.io", "mworkload.kb.io"]
    assert config["webhooks"][0]["clientConfig"] == {"url": "https://127.0.0.1:9443/mutate-rayjobs",
                                                     "caBundle": base64.b64encode(b"CA PEM").decode()}
    assert docs[0]["webhooks"][0]["clientConfig"]["service"], "the module's manifests are left as they are"


def _crd(plural: str) -> dict:
    return {"kind": "CustomResourceDefinition", "spec": {"names": {"plural": plural}}}


def test_the_crds_kueue_converts_call_its_conversion_webhook():
    workloads, flavors = kueue.crds([_crd("workloads"), _crd("resourceflavors")], 9443, b"CA")
    assert workloads["spec"]["conversion"]["webhook"]["clientConfig"]["url"] == "https://127.0.0.1:9443/convert"
    assert "conversion" not in flavors["spec"]
