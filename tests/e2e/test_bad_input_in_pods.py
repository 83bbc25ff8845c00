"""Bad input that only shows at run time, each in a job of its own (examples/grpo-tiny-s3.yaml with
one thing wrong): each ends, within a bounded time, in a phase and a condition whose reason and
message name the cause; none hangs silently, and the operator survives them all."""

from __future__ import annotations

import time

import pytest

from tests.harness.helpers import get_json
from tests.e2e.conftest import NAMESPACE, OPERATOR_NAMESPACE, condition, example

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes, pytest.mark.slow]

# The jobs that never train ask for next to nothing, so that they all fit beside each other.
SMALL = {"cpu": "10m", "memory": "1Gi", "cpuLimit": "none"}
BOUND_S = 240


def _small(name: str, **spec) -> dict:
    """One trainer pod: KubeRay gives every worker pod an init container requesting 200m CPU."""
    manifest = example(name, **spec)
    manifest["spec"]["trainer"]["replicas"] = 1
    for role in ("head", "trainer", "rollout"):
        manifest["spec"][role]["resources"] = dict(SMALL)
    return manifest


def _upload_broken_data(product) -> str:
    import boto3

    env = product.s3_host_env
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    s3.put_object(Bucket="kuberl-data", Key="broken.jsonl",
                  Body=b'{"prompt": "Write the letter b.", "answer": "b"}\n{"prompt": "Write the letter\n')
    return "s3://kuberl-data/broken.jsonl"


def test_each_run_time_error_ends_in_a_condition_naming_its_cause(product):
    broken = _upload_broken_data(product)
    base = example()
    cases = {
        # name: (manifest, condition type, reason, what the message must contain)
        "no-secret": (_small("no-secret", model={**base["spec"]["model"], "credentials": {"name": "absent"}}),
                      "ClusterReady", "ContainerConfigError", 'secret "absent" not found'),
        "no-image": (_small("no-image", image="ghcr.io/kuberl/worker-cpu:0.0.0-absent"),
                     "ClusterReady", "ImageUnavailable", "ghcr.io/kuberl/worker-cpu:0.0.0-absent"),
        "no-model": (_small("no-model", model={**base["spec"]["model"], "uri": "s3://kuberl-models/nothing-here"}),
                     "Staged", "StageFailed", "s3://kuberl-models/nothing-here"),
        "bad-data": (_small("bad-data", data={**base["spec"]["data"], "uri": broken}),
                     "Staged", "StageFailed", "broken.jsonl:2: not valid JSON"),
    }
    began = time.monotonic()
    for manifest, *_ in cases.values():
        product.apply(manifest)
    for name, (_, type_, reason, cause) in cases.items():
        left = BOUND_S - (time.monotonic() - began)
        status = product.wait_status(name, f"condition {type_} {reason}",
                                     lambda s, t=type_, r=reason: condition(s, t).get("reason") == r, max(left, 1))
        cond = condition(status, type_)
        assert cond["status"] == "False" and cause in cond["message"], cond
        assert cause in status["message"], status["message"]
    product.kubectl("delete", "rltj", *cases, "-n", NAMESPACE, "--wait=true", "--timeout=120s")

    # A reward function that raises (json.loads called with the list of samples): the driver names
    # it in status.workloadError and the operator fails the job at once, with no restart.
    applied = product.apply(example("bad-reward", reward={"function": "json:loads"}, backoffLimit=3))
    status = product.wait_status("bad-reward", "Failed", lambda s: s.get("phase") == "Failed", 600)
    failed = condition(status, "Failed")
    assert failed["reason"] == "RewardFunctionFailed", failed
    assert "TypeError" in failed["message"] and "JSON object must be str" in failed["message"], failed
    assert status["restarts"] == 0
    print(f"bad reward -> Failed in {time.monotonic() - applied:.0f} s")
    product.kubectl("delete", "rltj", "bad-reward", "-n", NAMESPACE, "--wait=true", "--timeout=120s")

    operator, = get_json(product.cluster, "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=kuberl")["items"]
    assert operator["status"]["phase"] == "Running"
    assert all(c["restartCount"] == 0 for c in operator["status"]["containerStatuses"]), operator["status"]
