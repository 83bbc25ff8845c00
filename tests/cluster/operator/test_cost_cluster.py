"""Cost by role against the real control plane: the operator's status.cost for the pods KubeRay
made (KWOK nodes with 8 GPUs each report them running), checked against the pods themselves."""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime

import kubernetes
import pytest

from tests.cluster.operator.conftest import OperatorProcess, example, install_chart_rbac
from tests.cluster.operator.test_operator_cluster import JOB, job_status, owned, printed_row, wait_phase
from tests.harness.helpers import apply, wait_for

pytestmark = pytest.mark.cluster
PRICE = 3.0  # per GPU-hour
# Seconds the pods run before the comparison: under the ~31 s after which KubeRay fails a RayJob on
# KWOK (its submitter pod "completes" at once, the Ray job never does), which restarts the attempt.
LIFETIME = 20.0


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _first_start(pod: dict) -> datetime:
    status = pod["status"]
    return min(_time(detail["startedAt"])
               for cs in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
               for detail in (cs.get("state") or {}).values() if detail.get("startedAt"))


def _requests(pod: dict, kind: str, resource: str) -> float:
    values = [(c.get("resources") or {}).get(kind, {}).get(resource, "0") for c in pod["spec"]["containers"]]
    return sum(float(v[:-1]) / 1000 if v.endswith("m") else float(v) for v in values)


def test_gpu_seconds_per_role_match_the_pods_lifetimes_times_their_requests(k8s_cluster, namespace, tmp_path):
    operator = OperatorProcess(install_chart_rbac(k8s_cluster, namespace), namespace, tmp_path / "operator.log",
                               restart_backoff=0.5,
                               extra_args=("--cost-refresh", "2", "--gpu-hour-price", str(PRICE))).start()
    try:
        spec = example()["spec"]
        apply(k8s_cluster, example(trainer={**spec["trainer"], "gpusPerReplica": 2},
                                   rollout={**spec["rollout"], "gpusPerReplica": 1}), "-n", namespace)
        wait_phase(k8s_cluster, namespace, "Running")
        # The driver's step report (through the job's own identity, as the driver sends it).
        workload = k8s_cluster.client_for_service_account(namespace, f"{JOB}-workload")
        kubernetes.client.CustomObjectsApi(workload).patch_namespaced_custom_object_status(
            "kuberl.dev", "v1alpha1", namespace, "rltrainingjobs", JOB,
            {"status": {"progress": {"step": 1, "tokensPerSecond": 300.0, "gpuBusy": {"trainer": 0.6, "rollout": 0.3}}}})

        pods = owned(k8s_cluster, "pods", namespace)
        began = max(_first_start(p) for p in pods)
        cost = wait_for(f"status.cost written {LIFETIME:.0f} s into the pods' lives",
                        lambda: (c := job_status(k8s_cluster, namespace).get("cost") or {}).get("updatedTime")
                        and (_time(c["updatedTime"]) - began).total_seconds() >= LIFETIME and c,
                        k8s_cluster, timeout=LIFETIME + 60)
        updated = _time(cost["updatedTime"])
        now_pods = owned(k8s_cluster, "pods", namespace)
        assert {p["metadata"]["uid"] for p in now_pods} == {p["uid"] for p in cost["pods"]}, "the attempt restarted meanwhile"
        expected: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu": 0.0, "cpu": 0.0})
        for pod in now_pods:
            seconds = (updated - _first_start(pod)).total_seconds()
            role = expected[pod["metadata"]["labels"]["kuberl.dev/role"]]
            role["gpu"] += seconds * _requests(pod, "limits", "nvidia.com/gpu")
            role["cpu"] += seconds * _requests(pod, "requests", "cpu")
        assert set(expected) == {"head", "trainer", "rollout"}
        assert expected["trainer"]["gpu"] >= 2 * LIFETIME and expected["rollout"]["gpu"] >= LIFETIME
        for role, want in expected.items():
            got = cost["roles"][role]
            assert got["gpuSeconds"] == pytest.approx(want["gpu"], rel=0.05), role
            assert got["cpuSeconds"] == pytest.approx(want["cpu"], rel=0.05), role
        assert cost["gpuHours"] == pytest.approx(sum(r["gpu"] for r in expected.values()) / 3600, rel=0.05)
        assert cost["estimatedCost"] == round(cost["gpuHours"] * PRICE, 2)
        assert cost["tokensPerGpuHour"] == 300.0 * 3600 / 3  # 3 GPUs run: the trainer's 2 and the rollout's 1

        row = printed_row(k8s_cluster.kubectl("get", "rltj", JOB, "-n", namespace, "-o", "wide").stdout)
        assert float(row["GPU-HOURS"]) == pytest.approx(job_status(k8s_cluster, namespace)["cost"]["gpuHours"], abs=0.01)
        # The operator's cache has its own status write once the watch brought it back.
        metrics = wait_for("the cost metrics", lambda: "kuberl_job_gpu_busy_ratio{" in (m := operator.metrics()) and m,
                           k8s_cluster)
        line = re.search(rf'kuberl_job_gpu_seconds_total{{job_name="{JOB}",job_namespace="{namespace}",role="trainer"}} (\S+)',
                         metrics)
        assert line and float(line.group(1)) >= cost["roles"]["trainer"]["gpuSeconds"]
        assert f'kuberl_job_estimated_cost{{job_name="{JOB}",job_namespace="{namespace}"}}' in metrics
        assert f'kuberl_job_gpu_busy_ratio{{job_name="{JOB}",job_namespace="{namespace}",role="trainer"}} 0.6' in metrics
        assert f'kuberl_job_tokens_per_gpu_hour{{job_name="{JOB}",job_namespace="{namespace}"}}' in metrics

        # A restarted operator goes on from the totals in status: nothing lost, nothing counted twice.
        before = job_status(k8s_cluster, namespace)["cost"]
        operator.kill()
        operator.start()
        after = wait_for("status.cost written by the new operator",
                         lambda: (c := job_status(k8s_cluster, namespace)["cost"])["updatedTime"] != before["updatedTime"] and c,
                         k8s_cluster, timeout=60)
        grown = (_time(after["updatedTime"]) - _time(before["updatedTime"])).total_seconds()
        # (The pods may have been replaced meanwhile: see LIFETIME. A replacement holds the same GPUs.)
        for role, total in before["roles"].items():
            gpus = sum(_requests(p, "limits", "nvidia.com/gpu") for p in pods if p["metadata"]["labels"]["kuberl.dev/role"] == role)
            assert total["gpuSeconds"] <= after["roles"][role]["gpuSeconds"] <= total["gpuSeconds"] + (grown + 1) * gpus, role
    finally:
        operator.stop()
