"""Kueue against the test control plane: its CRDs, its webhooks on loopback, its configuration.

Kueue runs as a process (like the KubeRay operator) with only its RayJob integration. Its
webhooks are served, not disabled: its mutating RayJob webhook is what suspends a queued RayJob at
creation and its validating ones refuse what Kueue cannot manage (kuberl's RayJob goes through
both), and Kueue cannot run without them (its manager registers them whatever the integrations).
Kueue's own certificate management is off: it would issue a certificate for its in-cluster
Service name, which a loopback control plane has no route to. Instead the webhook server serves a
certificate of the harness's CA for 127.0.0.1, and every webhook (and the CRD conversion webhooks
Kueue's kustomization adds) calls https://127.0.0.1:<port><path> with that CA as caBundle.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

from tests.harness.components import data_path

NAMESPACE = "kueue-system"
# Kueue's kustomization (config/components/crd/kustomization.yaml) turns on a conversion webhook
# for these CRDs only; the bases in the module have none.
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
# With its certificate management off, Kueue 0.17 loads its metrics server's certificate from this
# fixed path (cmd/kueue/main.go), whatever its configuration says; it must exist at start.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def manifests() -> list[dict]:
    """Kueue's CRDs and webhook configurations, from the module the binary was built from."""
    return [doc for doc in yaml.safe_load_all(data_path("kueue").read_text()) if doc]


def crds(docs: list[dict], port: int, ca_pem: bytes) -> list[dict]:
    """The CRDs, those Kueue converts calling its conversion webhook on loopback."""
    out = []
    for doc in docs:
        if doc["kind"] != "CustomResourceDefinition":
            continue
        crd = copy.deepcopy(doc)
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {"clientConfig": _client_config("/convert", port, ca_pem), "conversionReviewVersions": ["v1"]},
            }
        out.append(crd)
    return out


def webhook_configurations(docs: list[dict], port: int, ca_pem: bytes) -> list[dict]:
    """Kueue's webhook configurations, kept to what this Kueue manages (its own kinds and RayJobs:
    the webhooks of the integrations it does not run, pods and Deployments among them, would
    otherwise stand in front of every pod the other tests create) and calling it on loopback."""
    out = []
    for doc in docs:
        if doc["kind"] not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        config = copy.deepcopy(doc)
        config["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        config["webhooks"] = [
            {**hook, "clientConfig": _client_config(hook["clientConfig"]["service"]["path"], port, ca_pem)}
            for hook in doc["webhooks"] if _managed_here(hook)
        ]
        out.append(config)
    return out


def _managed_here(hook: dict) -> bool:
    return any("kueue.x-k8s.io" in rule.get("apiGroups", []) or "rayjobs" in rule.get("resources", [])
               for rule in hook.get("rules", []))


def _client_config(path: str, port: int, ca_pem: bytes) -> dict:
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


def configuration(webhook_port: int, cert_dir: Path, health_port: int, metrics_port: int) -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2): the RayJob integration only, jobs
    without a queue name left alone, everything bound to loopback."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "leaderElection": {"leaderElect": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "integrations": {"frameworks": ["ray.io/rayjob"]},
        # The pending-workloads API is an aggregated API server: not needed, and one more port.
        "featureGates": {"VisibilityOnDemand": False},
    }
