"""Fixtures for the operator against the real control plane: the CRD, a namespace per test, and
the operator as a subprocess running with exactly the chart's RBAC (a ServiceAccount token)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from kuberl.common.ports import unclaimed_port

from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import wait_for

CRD_FILE = REPO_ROOT / "crds" / "rltrainingjobs.kuberl.dev.yaml"
CHART = REPO_ROOT / "charts" / "kuberl"
OPERATOR_NAMESPACE = "kuberl-system"
RELEASE = "kuberl"
OPERATOR_ACCOUNT = f"{RELEASE}-kuberl-operator"


@pytest.fixture(scope="session")
def kuberl_crd(k8s_cluster):
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    # Not `kubectl wait`: under load it reads the new CRD before its status has conditions and fails
    # (".status.conditions accessor error: <nil>") instead of waiting.
    wait_for("CRD rltrainingjobs.kuberl.dev Established", lambda: k8s_cluster.crd_established("rltrainingjobs.kuberl.dev"),
             k8s_cluster)
    k8s_cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)


@pytest.fixture
def namespace(k8s_cluster, kuberl_crd):
    name = f"op-{uuid.uuid4().hex[:8]}"
    k8s_cluster.kubectl("create", "namespace", name)
    wait_for(f"ServiceAccount {name}/default",
             lambda: k8s_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             k8s_cluster)
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def install_chart_rbac(cluster, watch_namespace: str) -> Path:
    """Render the chart's ServiceAccount and RBAC with the built helm, apply them, and return a
    kubeconfig holding a token of that ServiceAccount: the operator's exact identity."""
    rendered = cluster.helm("template", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                            "--set", f"watchNamespaces={{{watch_namespace}}}",
                            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml").stdout
    cluster.kubectl("apply", "-f", "-", input=rendered)
    return cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT)


class OperatorProcess:
    """``python -m kuberl_operator`` as a child process; ``kill()`` sends SIGKILL (a crash)."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path, restart_backoff: float,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.kubeconfig, self.namespace, self.log_path = kubeconfig, namespace, log
        self.restart_backoff, self.extra_args = restart_backoff, extra_args
        self.metrics_port, self.health_port = unclaimed_port(), unclaimed_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        env = dict(os.environ)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kuberl_operator", "--namespace", self.namespace,
             "--kubeconfig", str(self.kubeconfig), "--metrics-address", "127.0.0.1",
             "--metrics-port", str(self.metrics_port), "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
             "--restart-backoff", str(self.restart_backoff), "--resync", "5", *self.extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not self._healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"operator not healthy after 60 s:\n{self.tail()}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def operator(k8s_cluster, namespace, tmp_path):
    """The operator watching ``namespace`` with the chart's RBAC; its log is shown on failure."""
    kubeconfig = install_chart_rbac(k8s_cluster, namespace)
    proc = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log", restart_backoff=0.5).start()
    yield proc
    proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "operator" in item.funcargs:
        report.sections.append(("kuberl operator log", item.funcargs["operator"].tail()))


def example(name: str = "grpo-tiny-cpu", **spec) -> dict:
    manifest = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    manifest["metadata"] = {"name": name}
    manifest["spec"].update(spec)
    return manifest


def get(cluster, *args: str) -> dict | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None
