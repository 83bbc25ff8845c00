"""Tier 4, `tests/e2e`: real nodes (containerd, kubelet) running our images.

The product as a user installs it, on the real-node cluster (tests/harness/nodes.py): the operator
`helm install`ed from its built image and running as a pod under the chart's own RBAC, an S3
server (moto's) that pods reach through a Service, the tiny model and data uploaded to it, and a
Secret holding its credentials. Jobs are examples/grpo-tiny-s3.yaml, applied with kubectl.

Timings the tests take (apply → first step, seconds per step against a local run, pod kill →
training again) are printed at the end of the session: docs/benchmarks.md quotes them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kuberl.api.contract import JOB_LABEL
from kuberl.common.ports import unclaimed_port

from tests.e2e.evidence import SUBMITTER_LABEL, PodLogs
from tests.harness.harness import REPO_ROOT, Cluster
from tests.harness.helpers import get_json, wait_for
from tests.harness.images import public_name
from tests.tiers import tier_marker

pytest_collection_modifyitems = tier_marker(__file__)

NAMESPACE = "e2e"
OPERATOR_NAMESPACE = "kuberl-system"
EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny-s3.yaml"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
TIMINGS: dict[str, str] = {}
# The images the product runs, imported into every node (tests/e2e/images loads them the same way).
PRODUCT_IMAGES = ("operator", "worker-cpu")


@dataclass
class Product:
    cluster: Cluster
    s3_host_env: dict[str, str]          # how this machine reaches the S3 server (local runs)
    s3_cluster_url: str                  # how pods reach it (a Service name)
    tiny: Path                           # the model and data uploaded to it
    evidence: PodLogs                    # every pod's log, kept for a failure's report
    jobs: list[str] = field(default_factory=list)

    def kubectl(self, *args: str, **kwargs):
        return self.cluster.kubectl(*args, **kwargs)

    def job(self, name: str) -> dict:
        return get_json(self.cluster, "rltj", name, "-n", NAMESPACE)

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def apply(self, manifest: dict) -> float:
        """`kubectl apply` a job; returns the time it was applied (time.monotonic)."""
        self.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(manifest))
        return time.monotonic()

    def wait_status(self, name: str, what: str, done, timeout: float, interval: float = 1.0) -> dict:
        """Poll the job's status until ``done(status)``; fails early when the job finished first."""
        def probe():
            status = self.status(name)
            if status.get("phase") in ("Failed", "Succeeded") and not done(status):
                raise AssertionError(f"job {name} ended ({status['phase']}) while waiting for {what}: "
                                     f"{json.dumps(status, indent=1)}\n{self.describe(name)}")
            return status if done(status) else None
        try:
            return wait_for(f"job {name}: {what}", probe, self.cluster, timeout=timeout, interval=interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe(name)}") from None

    def clear_jobs(self, timeout: float = 120) -> None:
        """Deletes every job in the namespace and all it runs, relying on no finalizer (the
        operator's, KubeRay's StopJob's) and no grace period: what a failed test left running
        goes, so that it does not starve the next test of the nodes' CPUs."""
        for kind in ("rltj", "rayjobs.ray.io", "rayclusters.ray.io"):
            for obj in get_json(self.cluster, kind, "-n", NAMESPACE)["items"]:
                self.kubectl("patch", kind, obj["metadata"]["name"], "-n", NAMESPACE, "--type=merge",
                             "-p", '{"metadata":{"finalizers":null}}', check=False)
            self.kubectl("delete", kind, "--all", "-n", NAMESPACE, "--wait=false", check=False)
        self.kubectl("delete", "jobs.batch", "--all", "-n", NAMESPACE, "--wait=false", check=False)
        selectors = (JOB_LABEL, SUBMITTER_LABEL)  # the jobs' pods, and KubeRay's submitter pods
        for selector in selectors:
            self.kubectl("delete", "pods", "-n", NAMESPACE, "-l", selector, "--grace-period=0", "--force",
                         "--wait=false", check=False)
        wait_for("the jobs' pods to go",
                 lambda: not any(get_json(self.cluster, "pods", "-n", NAMESPACE, "-l", s)["items"] for s in selectors),
                 self.cluster, timeout=timeout, interval=2)

    def describe(self, name: str) -> str:
        """What a person would look at when a job is stuck: its status, pods, and the logs that exist."""
        out = [self.kubectl("get", "rltj", name, "-n", NAMESPACE, "-o", "yaml", check=False).stdout,
               self.kubectl("get", "pods,rayjobs,jobs", "-n", NAMESPACE, "-o", "wide", check=False).stdout]
        for pod in get_json(self.cluster, "pods", "-n", NAMESPACE, "-l", f"kuberl.dev/job={name}")["items"]:
            for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
                log = self.kubectl("logs", pod["metadata"]["name"], "-c", c["name"], "-n", NAMESPACE, "--tail=30",
                                   check=False)
                out.append(f"--- {pod['metadata']['name']}/{c['name']}\n{log.stdout}{log.stderr}")
        for submitter in get_json(self.cluster, "pods", "-n", NAMESPACE)["items"]:
            if submitter["metadata"].get("labels", {}).get("batch.kubernetes.io/job-name", "").startswith(name):
                log = self.kubectl("logs", submitter["metadata"]["name"], "-n", NAMESPACE, "--tail=60", check=False)
                out.append(f"--- submitter {submitter['metadata']['name']}\n{log.stdout}{log.stderr}")
        return "\n".join(out)


def example(name: str | None = None, **spec_changes) -> dict:
    """examples/grpo-tiny-s3.yaml, renamed, with top-level spec fields replaced."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    if name:
        manifest["metadata"]["name"] = name
        checkpoint = manifest["spec"]["checkpoint"]
        checkpoint["uri"] = checkpoint["uri"].rsplit("/", 1)[0] + "/" + name
    manifest["spec"].update(spec_changes)
    return manifest


def condition(status: dict, type_: str) -> dict:
    """The job status's condition of that type ({} if it has none)."""
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def record_timing(what: str, value: str) -> None:
    TIMINGS[what] = value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's report names the kept evidence (tests/e2e/evidence.py) and ends with the
    driver's log, taken before anything is deleted. Then the jobs the test left running go: the
    package's other tests share the nodes' CPUs, and a job running on would starve the next test's
    pods (a failed preemption test's job kept a resize test's second pod Pending, 2026-11-29)."""
    outcome = yield
    report = outcome.get_result()
    product = getattr(item, "funcargs", {}).get("product")
    if report.failed and call.when == "call" and product is not None:
        report.sections.append(("kuberl e2e evidence", product.evidence.keep(item.name)))
        try:
            product.clear_jobs()
        except Exception as exc:  # the report says so; the next test's own wait then names what it lacks
            report.sections.append(("kuberl e2e cleanup", f"clearing the failed test's jobs: {exc}"))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("kuberl in pods: timings (docs/benchmarks.md)")
        for what, value in TIMINGS.items():
            terminalreporter.write_line(f"{what:56s} {value}")


def _upload_tiny(s3, root: Path) -> None:
    """What the manifest's URIs name: s3://kuberl-models/tiny and s3://kuberl-data/repeat_letter.jsonl."""
    from kuberl.driver.tiny import make_all

    make_all(root)
    manifest = yaml.safe_load(EXAMPLE.read_text())["spec"]
    for uri in (manifest["model"]["uri"], manifest["data"]["uri"], manifest["checkpoint"]["uri"]):
        s3.create_bucket(Bucket=uri.removeprefix("s3://").split("/", 1)[0])
    bucket, prefix = manifest["model"]["uri"].removeprefix("s3://").split("/", 1)
    for path in sorted((root / "model").rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root / 'model')}")
    bucket, key = manifest["data"]["uri"].removeprefix("s3://").split("/", 1)
    s3.upload_file(str(root / "data" / "repeat_letter.jsonl"), bucket, key)


@pytest.fixture(scope="package")
def product(real_cluster, tmp_path_factory):
    import boto3

    cluster = real_cluster
    cluster.load_images(PRODUCT_IMAGES)
    port = unclaimed_port()
    url = cluster.serve_in_network("s3", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)],
                                   port, NAMESPACE)
    host_env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    s3 = boto3.client("s3", endpoint_url=host_env["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    tiny = tmp_path_factory.mktemp("tiny")
    _upload_tiny(s3, tiny)
    cluster.kubectl("create", "secret", "generic", "s3", "-n", NAMESPACE,
                    *(f"--from-literal={k}={v}" for k, v in S3_CREDENTIALS.items()),
                    f"--from-literal=AWS_ENDPOINT_URL_S3={url}")

    cluster.helm("install", "kuberl", str(REPO_ROOT / "charts" / "kuberl"), "-n", OPERATOR_NAMESPACE,
                 "--create-namespace", "--set", f"watchNamespaces={{{NAMESPACE}}}",
                 "--set", "operator.restartBackoffSeconds=5", "--set", "operator.resyncSeconds=10",
                 "--wait", "--timeout", "5m")
    pod, = get_json(cluster, "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=kuberl")["items"]
    assert pod["spec"]["containers"][0]["image"] == public_name("operator")
    assert pod["spec"]["nodeName"].startswith("real-node-")
    evidence = PodLogs(cluster, NAMESPACE, tmp_path_factory.mktemp("evidence")).start()
    product = Product(cluster, host_env, url, tiny, evidence)
    yield product
    # Whatever a failed test left running goes, so that later tests on this cluster get its CPUs.
    cluster.kubectl("delete", "rltj", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=180s", check=False)
    product.clear_jobs()  # and what a stuck finalizer kept
    # The operator's log belongs with the cluster's when a test failed.
    log = cluster.kubectl("logs", pod["metadata"]["name"], "-n", OPERATOR_NAMESPACE, check=False).stdout
    (cluster.log_dir / "kuberl-operator-pod.log").write_text(log)
    restarts = [c["restartCount"] for c in get_json(cluster, "pod", pod["metadata"]["name"], "-n",
                                                      OPERATOR_NAMESPACE)["status"]["containerStatuses"]]
    cluster.helm("uninstall", "kuberl", "-n", OPERATOR_NAMESPACE, "--wait", check=False)
    evidence.stop()
    # Under the chart's own RBAC it was never refused anything, and it never crashed.
    assert "Forbidden" not in log and restarts == [0], (restarts, log[-5000:])
