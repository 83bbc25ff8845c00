"""The driver reports progress through the job's own ServiceAccount (as rendered by kuberl render)
to the real API server, and that identity can patch only its own job's status."""

import json
import urllib.error

import pytest
import yaml

from kuberl.driver.report import KubernetesStatusReporter, gpu_busy
from tests.harness.helpers import wait_for
from kuberl.job.render import render_manifest
from tests.unit.api.bad_manifests import minimal_manifest

pytestmark = pytest.mark.cluster


def _apply(cluster, objects):
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def _create_job(cluster, name, namespace):
    manifest = minimal_manifest(name)
    manifest["metadata"]["namespace"] = namespace
    _apply(cluster, [manifest])
    uid = cluster.kubectl("get", "rltj", name, "-n", namespace, "-o", "jsonpath={.metadata.uid}").stdout
    manifest["metadata"]["uid"] = uid
    return manifest


@pytest.fixture(scope="module")
def crd(k8s_cluster):
    from kuberl.api.crd import CRD_PATHS

    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD_PATHS[0]))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "crd/rltrainingjobs.kuberl.dev", "--timeout=60s")
    return k8s_cluster


def test_workload_identity_patches_its_own_status_only(crd, tmp_path):
    cluster, ns = crd, "report-test"
    cluster.kubectl("create", "namespace", ns)
    mine = _create_job(cluster, "mine", ns)
    _create_job(cluster, "other", ns)
    # Only the workload identity (ServiceAccount, Role, RoleBinding) of "mine".
    identity = [o for o in render_manifest(mine) if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    _apply(cluster, identity)
    token = tmp_path / "token"
    token.write_text(cluster.kubectl("create", "token", "mine-workload", "-n", ns).stdout.strip())

    # What the operator writes first (as an admin here): the policy must let the driver's patches
    # through beside it.
    operator_status = {"phase": "Running", "restarts": 1, "message": "training",
                       "cost": {"gpuHours": 2.0, "roles": {"trainer": {"gpuSeconds": 7200.0, "cpuSeconds": 0.0}}}}
    cluster.kubectl("patch", "rltj", "mine", "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": operator_status}))
    reporter = KubernetesStatusReporter(cluster.server, ns, "mine", token, cluster.ca.pair.cert)
    reporter.progress(3, 20, 0.25, 123.0)
    reporter.checkpoint("s3://ckpt/mine/step-000000003", 3)
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert status["progress"]["step"] == 3 and status["progress"]["totalSteps"] == 20
    assert status["progress"]["reward"] == 0.25
    assert status["lastCheckpoint"]["uri"] == "s3://ckpt/mine/step-000000003"
    assert status["progress"]["heldForSuspend"] is False
    # Holding for a suspend, and training on: the rest of progress stays.
    reporter.held_for_suspend(True)
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert status["progress"]["heldForSuspend"] is True and status["progress"]["step"] == 3
    reporter.progress(4, 20, 0.5, 120.0, gpu_busy({"step_seconds": 10.0, "logprobs_seconds": 1.0,
                                                    "update_seconds": 5.0, "generate_seconds": 3.0}))
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert status["progress"]["heldForSuspend"] is False and status["progress"]["step"] == 4
    assert status["progress"]["gpuBusy"] == {"trainer": 0.6, "rollout": 0.3}, "the CRD's schema keeps it"
    reporter.progress(3, 20, 0.25, 123.0)
    printed = cluster.kubectl("get", "rltj", "mine", "-n", ns).stdout
    assert "0.25" in printed and " 3 " in printed
    # What the driver does, once it has done it for 2 s, in status and `kubectl get`'s Activity
    # column; cleared when it ends (kuberl.driver.report.ActivityBoard).
    progress = lambda: json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)[  # noqa: E731
        "status"]["progress"]
    reporter.activity("generate")
    wait_for("the activity shown", lambda: progress().get("activity") == "generate", cluster, timeout=30,
             interval=0.2)
    assert progress()["activitySince"].endswith("Z") and progress()["step"] == 3
    header, row = cluster.kubectl("get", "rltj", "mine", "-n", ns).stdout.splitlines()
    assert row.split()[header.split().index("ACTIVITY")] == "generate"
    reporter.activity(None)
    wait_for("the activity cleared", lambda: "activity" not in progress(), cluster, timeout=30, interval=0.2)
    assert "activitySince" not in progress()
    # An error in the job's own input, as the CRD's schema takes it.
    from kuberl.common.reward_values import RewardError
    from kuberl.driver.report import user_errors_reported

    with pytest.raises(RewardError), user_errors_reported(reporter, attempt=0):
        raise RewardError("spec.reward.function failed: TypeError('not a list')")
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert status["workloadError"]["reason"] == "RewardFunctionFailed" and status["workloadError"]["attempt"] == 0
    assert status["workloadError"]["message"] == "spec.reward.function failed: TypeError('not a list')"

    # It reads its own job's spec.suspend (to checkpoint before a suspend).
    assert reporter.suspend_requested() is False
    cluster.kubectl("patch", "rltj", "mine", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    assert reporter.suspend_requested() is True

    # It reads spec.rollout.replicas (a live resize), reports its pool, and counts recoveries on
    # from the count in status (a later attempt's driver starts with none of its own).
    assert reporter.rollout_replicas() == 1
    cluster.kubectl("patch", "rltj", "mine", "-n", ns, "--type=merge", "-p", '{"spec":{"rollout":{"replicas":3}}}')
    assert reporter.rollout_replicas() == 3
    reporter.rollout(0, 3, ["mine-rollout-a"])
    reporter.recovered("trainer", 12.5)
    KubernetesStatusReporter(cluster.server, ns, "mine", token, cluster.ca.pair.cert).recovered("engine_lost", None, 2)
    KubernetesStatusReporter(cluster.server, ns, "mine", token, cluster.ca.pair.cert).recovered("trainer", 20.0)
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert status["rollout"] == {"attempt": 0, "replicas": 3, "enginePods": ["mine-rollout-a"]}
    assert (status["recoveries"]["trainer"]["count"], status["recoveries"]["trainer"]["lastSeconds"]) == (2, 20.0)
    assert status["recoveries"]["engineLost"]["count"] == 2 and "lastSeconds" not in status["recoveries"]["engineLost"]

    # Nor the operator's fields of its own job's status (the ValidatingAdmissionPolicy installed
    # with the CRD): code in the job's pods cannot reset its restart budget, hide its cost, or
    # declare itself done. Each refusal names the field.
    forged = {"restarts": 0, "cost": {"gpuHours": 0.0}, "phase": "Succeeded",
              "conditions": [{"type": "Succeeded", "status": "True", "reason": "Completed", "message": "",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}],
              "completionTime": "2026-01-01T00:00:00Z"}
    for field, value in forged.items():
        with pytest.raises(urllib.error.HTTPError) as info:
            reporter._send({field: value, "progress": {"step": 99}})
        body = info.value.read().decode()
        assert info.value.code == 403 and f"status.{field} is the kuberl operator's" in body, (field, body)
    status = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"]
    assert {k: status[k] for k in operator_status} == operator_status and status["progress"]["step"] == 3
    # An admin (the operator's identity is another one) is not held to it.
    cluster.kubectl("patch", "rltj", "mine", "-n", ns, "--subresource=status", "--type=merge",
                    "-p", '{"status":{"restarts":2}}')

    # The same token cannot touch another job's status, nor the job's spec.
    other = KubernetesStatusReporter(cluster.server, ns, "other", token, cluster.ca.pair.cert)
    with pytest.raises(urllib.error.HTTPError) as info:
        other._send({"progress": {"step": 1}})
    assert info.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as info:
        other._request(other.job_url)
    assert info.value.code == 403
    denied = cluster.kubectl("auth", "can-i", "patch", "rltrainingjobs/mine", "-n", ns,
                             f"--as=system:serviceaccount:{ns}:mine-workload", check=False).stdout.strip()
    assert denied == "no"


def test_workload_error_has_the_pods_secret_values_redacted(crd, tmp_path, monkeypatch):
    """User error text (a reward function's exception) carries what the driver's environment holds
    from the job's Secrets: the tracker key, an MLflow URI with a password. The status stored on
    the real API server, which everyone who may read the job reads, has none of it; nor has the
    exception the driver goes on to raise (its last line reaches status through KubeRay)."""
    from kuberl.common.reward_values import RewardError
    from kuberl.driver.report import REDACTED, user_errors_reported

    cluster, ns = crd, "redact-test"
    cluster.kubectl("create", "namespace", ns)
    mine = _create_job(cluster, "mine", ns)
    _apply(cluster, [o for o in render_manifest(mine) if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")])
    token = tmp_path / "token"
    token.write_text(cluster.kubectl("create", "token", "mine-workload", "-n", ns).stdout.strip())
    key, password = "0123456789abcdef0123456789abcdef01234567", "hunter22-mlflow"
    monkeypatch.setenv("WANDB_API_KEY", key)  # as envFrom the tracking Secret sets it in the head
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)

    reporter = KubernetesStatusReporter(cluster.server, ns, "mine", token, cluster.ca.pair.cert)
    with pytest.raises(RewardError) as raised, user_errors_reported(reporter, attempt=0):
        raise RewardError(f"spec.reward.function failed: HTTPError('401 for https://judge.example/?key={key}', "
                          f"'https://bob:{password}@mlflow.example/api')")
    message = json.loads(cluster.kubectl("get", "rltj", "mine", "-n", ns, "-o", "json").stdout)["status"][
        "workloadError"]["message"]
    assert message == (f"spec.reward.function failed: HTTPError('401 for https://judge.example/?key={REDACTED}', "
                       f"'https://{REDACTED}@mlflow.example/api')")
    assert str(raised.value) == message
