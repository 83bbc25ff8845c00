"""The accounting of GPU- and CPU-seconds by role (kuberl_operator.cost): pods shaped as the API
server returns them, through ``pod_usage`` (what the operator's pod index keeps) and ``account``."""

from __future__ import annotations

from datetime import timedelta

from kuberl.api.types import Cost
from kuberl_operator.cost import account, pod_usage
from kuberl_operator.observed import format_time

from tests.unit.operator.factories import NOW

HOUR = 3600.0


def at(seconds: float) -> str:
    """A timestamp ``seconds`` after NOW (negative: before)."""
    return format_time(NOW + timedelta(seconds=seconds))


def usage(uid: str, role: str, *, started: float | None, finished: float | None = None, gpus: int = 0,
          cpu: str = "1", phase: str | None = None, restarted_at: float | None = None, deleted: float | None = None) -> dict:
    """``pod_usage`` of a one-container pod started ``started`` s after NOW (None: Pending), over at
    ``finished``; ``restarted_at``: the container restarted then (lastState holds the run before)."""
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    spec = {"containers": [{"name": "ray", "resources": {"requests": {"cpu": cpu, **limits}, "limits": limits}}],
            "initContainers": [{"name": "stage-model", "resources": {"requests": {"cpu": "100m"}}}]}
    status: dict = {"phase": phase or ("Pending" if started is None else "Running" if finished is None else "Succeeded")}
    if started is not None:
        status["initContainerStatuses"] = [{"name": "stage-model", "state": {"terminated": {
            "startedAt": at(started), "finishedAt": at(started + 1), "exitCode": 0}}}]
        if finished is not None:
            state = {"terminated": {"startedAt": at(started + 1), "finishedAt": at(finished), "exitCode": 0}}
        else:
            state = {"running": {"startedAt": at(restarted_at if restarted_at is not None else started + 1)}}
        cs = {"name": "ray", "state": state}
        if restarted_at is not None:
            cs["lastState"] = {"terminated": {"startedAt": at(restarted_at - 60), "finishedAt": at(restarted_at - 5)}}
        status["containerStatuses"] = [cs]
    meta = {"uid": uid, "labels": {"kuberl.dev/role": role}, **({"deletionTimestamp": at(deleted)} if deleted else {})}
    return pod_usage(meta, spec, status)


def run(previous, usages, seconds: float, **kwargs) -> dict:
    return account(previous, usages, NOW + timedelta(seconds=seconds), refresh_seconds=kwargs.pop("refresh", 0), **kwargs)


def gpu(cost: dict, role: str) -> float:
    return cost["roles"][role]["gpuSeconds"]


def test_running_pods_count_gpu_limits_and_cpu_requests_to_now_and_pending_pods_nothing():
    pods = [usage("t", "trainer", started=0, gpus=2, cpu="500m"), usage("r", "rollout", started=100, gpus=1),
            usage("p", "rollout", started=None, gpus=4)]
    cost = run(None, pods, HOUR)
    assert gpu(cost, "trainer") == 2 * HOUR and cost["roles"]["trainer"]["cpuSeconds"] == 0.5 * HOUR
    assert gpu(cost, "rollout") == HOUR - 100, "the Pending pod costs nothing"
    assert cost["gpuHours"] == round((3 * HOUR - 100) / HOUR, 4)
    assert {p["uid"] for p in cost["pods"]} == {"t", "r"}
    Cost.model_validate(cost)  # the wire form is the API type's


def test_a_terminated_pod_counts_to_its_end_and_then_stops_growing():
    done = usage("t", "trainer", started=0, finished=600, gpus=1)
    first = run(None, [done], 700)
    assert gpu(first, "trainer") == 600
    assert run(first, [done], 5 * HOUR) is first, "nothing grows: no status write"


def test_a_replaced_pod_is_settled_once_and_its_replacement_counted_beside_it():
    old = usage("old", "rollout", started=0, gpus=1)
    cost = run(None, [old], 300)
    # The pod goes (a failure, a resize) before the operator saw it end; a new one starts.
    new = usage("new", "rollout", started=400, gpus=1)
    cost = run(cost, [new], 1000)
    assert cost["settled"] == {"rollout": {"gpuSeconds": 300.0, "cpuSeconds": 300.0}}
    assert gpu(cost, "rollout") == 300 + 600
    again = run(cost, [new], 1000)
    assert gpu(again, "rollout") == 900 and again["settled"] == cost["settled"], "the gone pod is settled once"


def test_a_pod_being_deleted_is_written_at_once_so_it_is_settled_to_its_deletion():
    pod = usage("r", "rollout", started=0, gpus=1)
    cost = run(None, [pod], 10, refresh=300)
    deleting = run(cost, [usage("r", "rollout", started=0, gpus=1, deleted=100)], 100, refresh=300)
    assert gpu(deleting, "rollout") == 100, "not held back by the refresh interval"
    assert run(deleting, [], 120, refresh=300)["settled"]["rollout"]["gpuSeconds"] == 100


def test_an_operator_restart_loses_nothing_the_status_kept():
    cost = run(None, [usage("gone", "head", started=0, cpu="2")], 100)
    cost = run(cost, [usage("t", "trainer", started=50, gpus=8)], 150)
    # A new operator reads status.cost back through the API type (the API server's copy).
    stored = Cost.model_validate(cost).model_dump(mode="json", by_alias=True, exclude_none=True)
    after = run(stored, [usage("t", "trainer", started=50, gpus=8)], 250)
    assert after["roles"]["head"] == {"gpuSeconds": 0.0, "cpuSeconds": 200.0}
    assert gpu(after, "trainer") == 8 * 200


def test_a_container_restart_hiding_the_first_start_does_not_lower_the_pod():
    first = run(None, [usage("t", "trainer", started=0, gpus=1)], 1000)
    # Two restarts later kubelet's statuses start at 900: the pod still runs since 0.
    restarted = usage("t", "trainer", started=800, restarted_at=900, gpus=1)
    later = run(first, [restarted], 2000)
    assert gpu(later, "trainer") == 2000, "counted from the first start the status kept"


def test_clock_skew_never_makes_a_cost_negative_or_smaller():
    ahead = usage("t", "trainer", started=600, gpus=1)  # the kubelet's clock is ahead of ours
    cost = run(None, [ahead], 0)
    assert gpu(cost, "trainer") == 0
    grown = run(cost, [ahead], 1200)
    assert gpu(grown, "trainer") == 600
    behind = run(grown, [ahead], 900)  # our clock steps back
    assert gpu(behind, "trainer") == 600


def test_a_running_job_writes_its_growing_cost_once_per_refresh_but_pod_changes_at_once():
    pod = usage("t", "trainer", started=0, gpus=1)
    cost = run(None, [pod], 10, refresh=300)
    assert run(cost, [pod], 200, refresh=300) is cost
    assert gpu(run(cost, [pod], 400, refresh=300), "trainer") == 400
    added = run(cost, [pod, usage("r", "rollout", started=100, gpus=1)], 200, refresh=300)
    assert gpu(added, "rollout") == 100
    assert run({}, [usage("p", "rollout", started=None, gpus=1)], 10) == {}, "no pod has run: no cost yet"


def test_price_and_tokens_per_gpu_hour():
    pods = [usage("t", "trainer", started=0, gpus=2), usage("r", "rollout", started=0, gpus=2),
            usage("done", "rollout", started=0, finished=10, gpus=4)]
    cost = run(None, pods, HOUR, gpu_hour_price=2.5, tokens_per_second=1000.0)
    assert cost["gpuHours"] == round(4 + 40 / HOUR, 4) and cost["estimatedCost"] == round(cost["gpuHours"] * 2.5, 2)
    assert cost["tokensPerGpuHour"] == 1000 * HOUR / 4, "the GPUs running now, not the finished pod's"
    assert "estimatedCost" not in run(None, pods, HOUR)
