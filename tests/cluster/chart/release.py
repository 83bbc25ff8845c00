"""`helm install` of charts/kuberl into the real test API server, with the operator run locally
under the chart's ServiceAccount (see operator_process), watching one fresh namespace."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.shared.helm import CHART
from tests.cluster.chart.operator_process import OperatorProcess
from tests.harness.helpers import wait_for


@dataclass
class Release:
    name: str
    namespace: str          # where the chart is installed
    watched: str            # the namespace the operator reconciles
    notes: str
    operator: OperatorProcess


def install(cluster, tmp: Path, *helm_args: str) -> Release:
    suffix = uuid.uuid4().hex[:6]
    name, namespace, watched = f"kr-{suffix}", f"kuberl-{suffix}", f"jobs-{suffix}"
    cluster.kubectl("create", "namespace", watched)
    wait_for(f"ServiceAccount {watched}/default",
             lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", watched, check=False).returncode == 0,
             cluster)
    # --wait is not used: the operator Deployment's pod never becomes ready without a container runtime.
    result = cluster.helm("install", name, str(CHART), "--namespace", namespace, "--create-namespace",
                          "--set", f"watchNamespaces={{{watched}}}", *helm_args)
    deployment = json.loads(cluster.kubectl("get", "deployment", f"{name}-kuberl-operator", "-n", namespace,
                                            "-o", "json").stdout)
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = cluster.service_account_kubeconfig(namespace, account)
    operator = OperatorProcess(deployment, kubeconfig, tmp / "operator.log").start()
    return Release(name, namespace, watched, result.stdout, operator)


def uninstall(cluster, release: Release) -> None:
    release.operator.stop()
    cluster.helm("uninstall", release.name, "--namespace", release.namespace, check=False)
    cluster.kubectl("delete", "namespace", release.watched, release.namespace, "--wait=false", check=False)
