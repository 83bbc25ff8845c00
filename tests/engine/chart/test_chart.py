"""`helm lint` and `helm template` of charts/kuberl: the defaults, every monitoring switch, and the
strict values.schema.json rejecting misspelt or mistyped values with the key's path."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.shared.helm import CHART, by_kind

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def test_lint_defaults_and_every_switch(helm):
    helm.run("lint", "--strict", str(CHART))
    helm.run("lint", "--strict", str(CHART), "--set", "monitoring.serviceMonitor.enabled=true",
             "--set", "monitoring.podMonitor.enabled=true", "--set", "watchNamespaces={team-a,team-b}")
    helm.run("lint", "--strict", str(CHART), "--set", "monitoring.podMonitor.enabled=true",
             "--set", "watchAllNamespaces=true")


def test_defaults_render_operator_metrics_service_and_dashboards(helm):
    objects = helm.template()
    deployment, = by_kind(objects, "Deployment")
    service, = by_kind(objects, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container, = deployment["spec"]["template"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    # Monitoring CRD objects only when asked: a cluster without prometheus-operator has no such kinds.
    assert not by_kind(objects, "ServiceMonitor") and not by_kind(objects, "PodMonitor")
    dashboards = {o["metadata"]["name"]: o for o in by_kind(objects, "ConfigMap")}
    assert set(dashboards) == {"kuberl-kuberl-operator-dashboard-overview", "kuberl-kuberl-operator-dashboard-training"}
    for configmap in dashboards.values():
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        (key, text), = configmap["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key.removeprefix("kuberl-")).read_text())


def test_service_monitor_scrapes_the_operator_service(helm):
    objects = helm.template("--set", "monitoring.serviceMonitor.enabled=true",
                            "--set", "monitoring.serviceMonitor.labels.release=prom")
    monitor, = by_kind(objects, "ServiceMonitor")
    service, = by_kind(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kuberl-system"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service["spec"]["ports"][0]["name"]]


def test_service_monitor_without_service_fails_with_the_fix(helm):
    result = helm.run("template", "kuberl", str(CHART), "--set", "monitoring.serviceMonitor.enabled=true",
                      "--set", "monitoring.service.enabled=false", check=False)
    assert result.returncode != 0
    assert "monitoring.serviceMonitor.enabled needs monitoring.service.enabled" in result.stderr


def test_pod_monitor_selects_rendered_worker_pods(helm):
    """The PodMonitor's selector and port names match what kuberl.job.render puts on worker pods."""
    from kuberl.api.contract import METRICS_PORT

    objects = helm.template("--set", "monitoring.podMonitor.enabled=true", "--set", "watchNamespaces={team-a}")
    monitor, = by_kind(objects, "PodMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberl"}
    roles, = spec["selector"]["matchExpressions"]
    assert roles["key"] == "kuberl.dev/role" and set(roles["values"]) == {"head", "trainer", "rollout"}
    endpoints = {e["port"]: e for e in spec["podMetricsEndpoints"]}
    assert endpoints["kuberl-metrics"]["honorLabels"] is True
    assert "metrics" in endpoints
    assert METRICS_PORT == 9400
    default = by_kind(helm.template("--set", "monitoring.podMonitor.enabled=true"), "PodMonitor")[0]
    assert default["spec"]["namespaceSelector"] == {"matchNames": ["kuberl-system"]}
    every_namespace = by_kind(helm.template("--set", "monitoring.podMonitor.enabled=true",
                                            "--set", "watchAllNamespaces=true"), "PodMonitor")[0]
    assert every_namespace["spec"]["namespaceSelector"] == {"any": True}


def test_pod_monitor_port_names_exist_on_rendered_pods():
    """Rendered RayJob pods carry the labels and named ports the PodMonitor selects."""
    from kuberl.job.render import render_manifest
    from tests.harness.harness import REPO_ROOT

    manifest = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    manifest["metadata"].setdefault("namespace", "team-a")
    ray_job, = (o for o in render_manifest(manifest) if o["kind"] == "RayJob")
    cluster_spec = ray_job["spec"]["rayClusterSpec"]
    templates = [cluster_spec["headGroupSpec"]["template"]] + [g["template"] for g in cluster_spec["workerGroupSpecs"]]
    for template in templates:
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kuberl" and labels["kuberl.dev/role"] in {"head", "trainer", "rollout"}
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {"kuberl-metrics", "metrics"} <= ports


def test_dashboards_can_be_turned_off_or_moved(helm):
    assert not by_kind(helm.template("--set", "dashboards.enabled=false"), "ConfigMap")
    moved = by_kind(helm.template("--set", "dashboards.namespace=monitoring",
                                  "--set", "dashboards.labels.grafana_dashboard=null",
                                  "--set", "dashboards.labels.team=ml"), "ConfigMap")
    assert {o["metadata"]["namespace"] for o in moved} == {"monitoring"}
    assert all(o["metadata"]["labels"]["team"] == "ml" for o in moved)


@pytest.mark.parametrize("setting, message", [
    ("monitoring.serviceMonitor.intervall=30s", "additional properties 'intervall' not allowed"),
    ("monitoring.service.port=0", "/monitoring/service/port"),
    ("operator.logLevel=LOUD", "/operator/logLevel"),
    ("monitoring.podMonitor.interval=soon", "/monitoring/podMonitor/interval"),
    ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("operatr.replicas=1", "additional properties 'operatr' not allowed"),
    ("watchAllNamespaces=maybe", "/watchAllNamespaces"),
    ("operator.gpuHourPrice=-1", "/operator/gpuHourPrice"),
    ("operator.gpuHourPrice=cheap", "/operator/gpuHourPrice"),
])
def test_schema_rejects_bad_values_naming_the_key(helm, setting, message):
    result = helm.run("template", "kuberl", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def _schema_keys(schema: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, sub in schema.get("properties", {}).items():
        keys.add(prefix + name)
        if sub.get("type") == "object" and "properties" in sub:
            keys |= _schema_keys(sub, f"{prefix}{name}.")
    return keys


def _value_keys(values: dict, schema: dict, prefix: str = "") -> set[str]:
    """Keys of values.yaml, descending only where the schema declares fixed properties (maps such
    as labels or resources.limits are free-form)."""
    keys = set()
    for name, value in values.items():
        keys.add(prefix + name)
        sub = schema.get("properties", {}).get(name, {})
        if isinstance(value, dict) and "properties" in sub:
            keys |= _value_keys(value, sub, f"{prefix}{name}.")
    return keys


def test_schema_covers_exactly_the_keys_of_values_yaml():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _value_keys(values, SCHEMA) == _schema_keys(SCHEMA)
    assert SCHEMA["additionalProperties"] is False


def _operator_grants(objects: list[dict]) -> dict[tuple[str, str], dict]:
    """(kind, namespace) -> the Role or ClusterRole holding the operator's rules (not discovery)."""
    return {(o["kind"], o["metadata"].get("namespace", "")): o for o in objects
            if o["kind"] in ("Role", "ClusterRole") and not o["metadata"]["name"].endswith("-discovery")}


def _args(objects: list[dict]) -> list[str]:
    deployment, = by_kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_default_scope_is_the_release_namespace(helm):
    """docs/security.md: by default the operator can create Roles, ServiceAccounts and RayJobs only
    in its own namespace, never cluster-wide (kube-system included)."""
    objects = helm.template()
    assert set(_operator_grants(objects)) == {("Role", "kuberl-system")}
    binding, = by_kind(objects, "RoleBinding")
    assert binding["metadata"]["namespace"] == "kuberl-system"
    assert "--namespace=kuberl-system" in _args(objects) and "--all-namespaces" not in _args(objects)
    discovery, = [o for o in by_kind(objects, "ClusterRole") if o["metadata"]["name"].endswith("-discovery")]
    assert {verb for rule in discovery["rules"] for verb in rule["verbs"]} == {"list", "watch"}


def test_listed_namespaces_and_the_all_namespaces_opt_in(helm):
    listed = helm.template("--set", "watchNamespaces={team-a,team-b}")
    assert set(_operator_grants(listed)) == {("Role", "team-a"), ("Role", "team-b")}
    assert [a for a in _args(listed) if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    everywhere = helm.template("--set", "watchAllNamespaces=true")
    assert set(_operator_grants(everywhere)) == {("ClusterRole", "")}
    assert "--all-namespaces" in _args(everywhere)
    result = helm.run("template", "kuberl", str(CHART), "--set", "watchAllNamespaces=true",
                      "--set", "watchNamespaces={team-a}", check=False)
    assert result.returncode != 0 and "leave watchNamespaces empty" in result.stderr


def test_operator_may_write_network_policies_and_never_read_secrets(helm):
    role, = _operator_grants(helm.template()).values()
    grants = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
              for group in rule["apiGroups"] for resource in rule["resources"]}
    assert grants[("networking.k8s.io", "networkpolicies")] == {"get", "create", "patch"}
    assert not any(resource == "secrets" for _, resource in grants)


def test_gpu_hour_price_reaches_the_operator_only_when_set(helm):
    assert not [a for a in _args(helm.template()) if a.startswith("--gpu-hour-price")]
    assert "--gpu-hour-price=2.5" in _args(helm.template("--set", "operator.gpuHourPrice=2.5"))
    assert "--gpu-hour-price=0" in _args(helm.template("--set", "operator.gpuHourPrice=0"))
