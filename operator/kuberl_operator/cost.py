"""What a job has cost, by role: GPU-seconds and CPU-seconds of every pod it ever ran.

A pod's lifetime runs from its first container's start (init containers count: the pod holds its
GPUs while it stages the model) to its last container's end once the pod is over, or to now while
it lasts; a pod that never started a container (Pending, unschedulable) costs nothing. It is
billed its GPU limits (Kubernetes requires GPU requests to equal them) and CPU requests, taken the
way the scheduler takes them: the larger of the containers' sum and the largest init container.

The running totals live in ``status.cost`` so that an operator restart loses nothing:
``pods`` holds every pod the job has now (by uid) with what it has cost so far, and a pod that is
gone (deleted on a failure, a resize, the end of an attempt) moves into ``settled`` once. A pod's
cost is recomputed from its own timestamps, never added to, so a reconcile that runs twice cannot
count it twice; and it is never lowered (the larger of the new figure and the recorded one), so a
clock behind the kubelet's, or a container restart that hides the pod's first start, cannot make
it shrink or go negative.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kubernetes.utils import parse_quantity

from kuberl.api.contract import ROLE_LABEL
from kuberl_operator.observed import format_time, parse_time

GPU_RESOURCE = "nvidia.com/gpu"
FINISHED_POD_PHASES = ("Succeeded", "Failed")


def _amount(container: dict[str, Any], kind: str, resource: str) -> float:
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    return float(parse_quantity(value)) if value is not None else 0.0


def _effective(spec: dict[str, Any], kind: str, resource: str) -> float:
    running = sum(_amount(c, kind, resource) for c in spec.get("containers") or [])
    init = max((_amount(c, kind, resource) for c in spec.get("initContainers") or []), default=0.0)
    return max(running, init)


def pod_usage(meta: dict[str, Any], spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """The little the accounting needs of a pod (kept in the operator's pod index instead of the
    pod's spec): its role, what it holds, its first container start, once over its last end, and
    whether its deletion was asked for."""
    starts, ends = [], []
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            for detail in state.values():
                if (detail or {}).get("startedAt"):
                    starts.append(detail["startedAt"])
                if (detail or {}).get("finishedAt"):
                    ends.append(detail["finishedAt"])
    start = min(starts, key=parse_time) if starts else None
    end = None
    if start and status.get("phase") in FINISHED_POD_PHASES:
        end = max(ends, key=parse_time) if ends else start
    return {"uid": meta.get("uid"), "role": (meta.get("labels") or {}).get(ROLE_LABEL, "unknown"),
            "gpus": _effective(spec, "limits", GPU_RESOURCE), "cpus": _effective(spec, "requests", "cpu"),
            "start": start, "end": end, "deleting": bool(meta.get("deletionTimestamp"))}


def _add(totals: dict[str, dict[str, float]], role: str, gpu: float, cpu: float) -> None:
    total = totals.setdefault(role, {"gpuSeconds": 0.0, "cpuSeconds": 0.0})
    total["gpuSeconds"] = round(total["gpuSeconds"] + gpu, 1)
    total["cpuSeconds"] = round(total["cpuSeconds"] + cpu, 1)


def account(previous: dict[str, Any] | None, usages: list[dict[str, Any]], now: datetime, *,
            refresh_seconds: float, gpu_hour_price: float | None = None,
            tokens_per_second: float | None = None) -> dict[str, Any]:
    """The job's ``status.cost`` (wire form) from the one recorded before, the pods it has now
    (``pod_usage`` of each) and the time; empty while no pod of the job has run.

    Between pods coming, starting, ending, being deleted or going, the running pods' growing
    figures are written at most every ``refresh_seconds`` (``previous`` comes back as it was), so a
    running job costs the API server one status write per that interval, not one per reconcile. A
    pod whose deletion was asked for is written at once: what it cost until then is kept even if
    it is gone before the operator sees it end.
    """
    previous = previous or {}
    before = {pod["uid"]: pod for pod in previous.get("pods") or []}
    settled = {role: dict(v) for role, v in (previous.get("settled") or {}).items()}
    pods: dict[str, dict[str, Any]] = {}
    gpus_now = 0.0
    for usage in usages:
        if usage["start"] is None:
            continue  # no container has run: Pending pods cost nothing
        old = before.get(usage["uid"]) or {}
        start = min(filter(None, (parse_time(usage["start"]), parse_time(old.get("start")))))
        end = parse_time(usage["end"]) if usage["end"] else now
        seconds = max(0.0, (end - start).total_seconds())
        pods[usage["uid"]] = {
            "uid": usage["uid"], "role": usage["role"], "start": format_time(start), "ended": usage["end"] is not None,
            "deleting": usage["deleting"],
            "gpuSeconds": max(round(seconds * usage["gpus"], 1), old.get("gpuSeconds", 0.0)),
            "cpuSeconds": max(round(seconds * usage["cpus"], 1), old.get("cpuSeconds", 0.0)),
        }
        if usage["end"] is None:
            gpus_now += usage["gpus"]
    present = {u["uid"] for u in usages}
    for uid, gone in before.items():
        if uid not in present:
            _add(settled, gone["role"], gone["gpuSeconds"], gone["cpuSeconds"])
    same_pods = {u: (p["start"], p["ended"], p["deleting"]) for u, p in pods.items()} == {
        u: (p.get("start"), p.get("ended"), p.get("deleting", False)) for u, p in before.items()}
    updated = parse_time(previous.get("updatedTime"))
    fresh = updated is not None and (now - updated).total_seconds() < refresh_seconds
    priced = ("estimatedCost" in previous) == (gpu_hour_price is not None)
    if (not pods and not previous) or (same_pods and priced and (fresh or all(p["ended"] for p in pods.values()))):
        return previous

    roles: dict[str, dict[str, float]] = {role: dict(v) for role, v in settled.items()}
    for pod in pods.values():
        _add(roles, pod["role"], pod["gpuSeconds"], pod["cpuSeconds"])
    gpu_hours = round(sum(r["gpuSeconds"] for r in roles.values()) / 3600, 4)
    out: dict[str, Any] = {"roles": roles, "settled": settled, "pods": list(pods.values()), "gpuHours": gpu_hours,
                           "updatedTime": format_time(now)}
    if gpu_hour_price is not None:
        out["estimatedCost"] = round(gpu_hours * gpu_hour_price, 2)
    if tokens_per_second is not None and gpus_now > 0:
        out["tokensPerGpuHour"] = round(tokens_per_second * 3600 / gpus_now, 1)
    return out
