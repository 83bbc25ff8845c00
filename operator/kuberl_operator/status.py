"""The RLTrainingJob status as a pure function of what the operator observed.

The result is a merge patch of only the operator's fields: ``progress`` and ``lastCheckpoint``
belong to the workload (it patches them through its per-job ServiceAccount) and are never
written here.

Conditions follow Kubernetes conventions; reasons are CamelCase, messages are sentences a person
can act on, and ``lastTransitionTime`` changes only when a condition's status changes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kuberl.api import types as t
from kuberl.job.plan import RunPlan
from kuberl.api.contract import ray_job_name
from kuberl_operator import observed as o

STAGED = "Staged"
CLUSTER_READY = "ClusterReady"
RUNNING = "Running"
CHECKPOINTED = "Checkpointed"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"
SPEC_CHANGE_REFUSED = "SpecChangeRefused"
ROLLOUT_SCALED = "RolloutScaled"
# Jobs with spec.scheduling.queueName only: whether Kueue admitted the current attempt, or what it waits for.
ADMITTED = "Admitted"
CONDITION_TYPES = (STAGED, CLUSTER_READY, RUNNING, CHECKPOINTED, SUCCEEDED, FAILED, SUSPENDED, SPEC_CHANGE_REFUSED,
                   ROLLOUT_SCALED, ADMITTED)

FINISHED_PHASES = ("Succeeded", "Failed")
# Fields of status the operator owns (camelCase, as on the wire).
OPERATOR_FIELDS = ("phase", "conditions", "observedGeneration", "rayJobName", "rayClusterName",
                   "dashboardURL", "restarts", "message", "startTime", "completionTime", "cost")


def _condition(type_: str, status: bool | None, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": {True: "True", False: "False", None: "Unknown"}[status],
            "reason": reason, "message": message}


def _init_failure(pods: list[dict[str, Any]]) -> str | None:
    """The first failed init container, in words: "init container stage-model failed: <why>"."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            state = cs.get("state") or {}
            last = cs.get("lastState") or {}
            terminated = state.get("terminated") or last.get("terminated")
            if terminated and terminated.get("exitCode", 0) != 0:
                why = (terminated.get("message") or "").strip() or terminated.get("reason") or "error"
                return (f"init container {cs['name']} failed in pod {pod['metadata']['name']} "
                        f"(exit code {terminated.get('exitCode')}): {why}")
    return None


# kubelet's waiting reasons for a container that cannot start until someone fixes its pod's spec
# or what it names: a missing Secret or ConfigMap, an image that cannot be had.
CANNOT_START = {
    "CreateContainerConfigError": "ContainerConfigError",
    "CreateContainerError": "ContainerConfigError",
    "ErrImagePull": "ImageUnavailable",
    "ImagePullBackOff": "ImageUnavailable",
    "ErrImageNeverPull": "ImageUnavailable",
    "InvalidImageName": "ImageUnavailable",
}


# What the reconcile reads of a RayJob's status (``observed``, ``compute_status``, the restart's
# failure time): the operator's RayJob index keeps these only. The rest (rayClusterStatus, a copy
# of the RayCluster's, which KubeRay rewrites as its pods come) changed in most RayJob events.
RAY_JOB_STATUS_FIELDS = ("jobDeploymentStatus", "jobStatus", "reason", "message", "jobId", "rayClusterName",
                         "dashboardURL", "startTime", "endTime")


def indexed_ray_job_status(status: dict[str, Any]) -> dict[str, Any]:
    """What the operator's RayJob index keeps of a RayJob's status (``RAY_JOB_STATUS_FIELDS``)."""
    return {k: status[k] for k in RAY_JOB_STATUS_FIELDS if k in status}


def indexed_pod_status(status: dict[str, Any]) -> dict[str, Any]:
    """What the operator's pod index keeps of a pod's status: what ``status_of`` reads (phase,
    conditions, init containers for staging and their failures, and each main container's
    waiting state for ``_cannot_start``), not the rest (image digests, container IDs, times)."""
    kept = {k: status[k] for k in ("phase", "conditions", "initContainerStatuses") if k in status}
    waiting = [{"name": cs["name"], "state": {"waiting": cs["state"]["waiting"]}}
               for cs in status.get("containerStatuses") or [] if (cs.get("state") or {}).get("waiting")]
    if waiting:
        kept["containerStatuses"] = waiting
    return kept


def _cannot_start(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) for the first container kubelet cannot start, e.g. ("ContainerConfigError",
    'container ray-head in pod x cannot start: CreateContainerConfigError: secret "s3" not found')."""
    for pod in pods:
        status = pod.get("status") or {}
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in CANNOT_START:
                why = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
                return (CANNOT_START[waiting["reason"]],
                        f"container {cs['name']} in pod {pod['metadata']['name']} cannot start: {why}")
    return None


def _staging(pods: list[dict[str, Any]]) -> str | None:
    """Which init container is still copying, if any."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if not (cs.get("state") or {}).get("terminated"):
                return f"init container {cs['name']} in pod {pod['metadata']['name']} is staging"
    return None


def _unscheduled(pods: list[dict[str, Any]]) -> str | None:
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return f"pod {pod['metadata']['name']} cannot be scheduled: {cond.get('message') or cond.get('reason')}"
    return None


def _running_pods(pods: list[dict[str, Any]]) -> int:
    return sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Running")


def _merge_conditions(old: list[dict[str, Any]], new: list[dict[str, str]], now: datetime,
                      generation: int | None) -> list[dict[str, Any]]:
    """Keep lastTransitionTime where the status did not change."""
    previous = {c.get("type"): c for c in old}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        changed = before is None or before.get("status") != cond["status"]
        merged = dict(cond)
        merged["lastTransitionTime"] = o.format_time(now) if changed else before["lastTransitionTime"]
        if generation is not None:
            merged["observedGeneration"] = generation
        out.append(merged)
    return out


def finished_status(job: t.RLTrainingJob) -> dict[str, Any]:
    """A finished job's status stays as it is: its objects may be gone (TTL, KubeRay's shutdown),
    and its spec may not even render (a job failed for an invalid field)."""
    old = job.status.model_dump(mode="json", by_alias=True, exclude_none=True) if job.status else {}
    return {k: v for k, v in old.items() if k in OPERATOR_FIELDS}


def current_workload_error(job: t.RLTrainingJob, attempt: int) -> t.WorkloadError | None:
    """The driver's report that the job's own input is at fault, if the current attempt made it
    (an older attempt's report says nothing about this one's input)."""
    error = job.status.workload_error if job.status else None
    return error if error is not None and error.attempt == attempt else None


def compute_status(job: t.RLTrainingJob, plan: RunPlan, ray_job: dict[str, Any] | None,
                   ray_cluster: dict[str, Any] | None, pods: list[dict[str, Any]], now: datetime, *, attempt: int = 0,
                   refused: list[str] = (), restart_in: float | None = None,
                   suspend_wait: str | None = None, scale_down_wait: tuple[str, str] | None = None,
                   queue: tuple[bool, str, str] | None = None) -> dict[str, Any]:
    """The operator's part of ``job.status`` (a merge patch), from the current attempt's RayJob,
    its RayCluster and pods.

    ``plan`` is the attempt's run plan (how many pods make the cluster); ``attempt`` is the attempt being run (status.restarts after a restart was decided);
    ``refused`` names spec fields whose change was refused; ``restart_in`` is set while the failed
    attempt waits for its backoff before the next one is created; ``suspend_wait`` says what a
    suspend waits for before the cluster goes (the driver's checkpoint); ``scale_down_wait`` is the
    (reason, message) of a scale-down of the rollout group waiting for the driver
    (``kuberl_operator.reconcile.scale_down_wait``); ``queue`` is Kueue's word on the attempt
    (``observed.queue_state``) for a job with a queue: not admitted, the job is Pending, not failed.
    """
    spec = job.spec
    current = job.status or t.RLTrainingJobStatus()
    old = current.model_dump(mode="json", by_alias=True, exclude_none=True)
    conditions: list[dict[str, str]] = []
    rj_status = (ray_job or {}).get("status") or {}
    cluster_state = ((ray_cluster or {}).get("status") or {}).get("state") or ""
    expected_pods = plan.layout.expected_pods
    running_pods = _running_pods(pods)
    message = ""

    if old.get("phase") in FINISHED_PHASES:
        return finished_status(job)

    # --- what the attempt is doing --------------------------------------------------------
    workload_error = current_workload_error(job, attempt)
    init_failure = _init_failure(pods)
    cannot_start = _cannot_start(pods)
    if o.succeeded(ray_job):
        phase, message = "Succeeded", f"training finished ({spec.algorithm.total_steps} steps)"
        conditions.append(_condition(SUCCEEDED, True, "Completed", message))
    elif workload_error is not None:
        phase = "Failed"
        message = (f"{workload_error.message} (reported by the training driver of attempt {attempt}; "
                   f"not restarted: the same input would fail again)")
        conditions.append(_condition(FAILED, True, workload_error.reason, message))
    elif o.validation_failed(ray_job):
        phase = "Failed"
        message = f"KubeRay rejected RayJob {ray_job['metadata']['name']}: {o.failure_reason(ray_job)}"
        conditions.append(_condition(FAILED, True, "RayJobInvalid", message))
    elif o.failed(ray_job) and restart_in is None and not spec.suspend:
        phase = "Failed"
        message = (f"RayJob {ray_job['metadata']['name']} failed: {o.failure_reason(ray_job)}; "
                   f"no restarts left (backoffLimit {spec.backoff_limit}, restarts {attempt})")
        conditions.append(_condition(FAILED, True, "BackoffLimitExceeded", message))
    elif o.failed(ray_job) and not spec.suspend:
        phase = "Starting"
        message = (f"RayJob {ray_job['metadata']['name']} failed: {o.failure_reason(ray_job)}; "
                   f"restart {attempt + 1} of {spec.backoff_limit} from the last checkpoint in {restart_in:.0f} s")
        conditions.append(_condition(RUNNING, False, "Restarting", message))
    elif spec.suspend:
        done = o.deployment_status(ray_job) == o.DEPLOYMENT_SUSPENDED or ray_job is None or o.failed(ray_job)
        phase = "Suspended"
        if done:
            reason, message = "Suspended", ("suspended: the Ray cluster is gone; set spec.suspend to false to "
                                            "resume from the newest checkpoint")
        elif suspend_wait:
            reason, message = "Checkpointing", suspend_wait
        else:
            reason, message = "Suspending", "suspending: KubeRay is deleting the Ray cluster"
        conditions.append(_condition(SUSPENDED, True, reason, message))
    elif ray_job is None:
        phase, message = "Pending", f"creating RayJob {ray_job_name(job.metadata.name, attempt)}"
    elif queue is not None and not queue[0]:
        # Kueue holds the RayJob suspended (queued, or evicted: preempted); it resumes when admitted.
        phase, message = "Pending", queue[2]
    elif init_failure:
        phase, message = "Staging", init_failure
        conditions.append(_condition(STAGED, False, "StageFailed", init_failure))
    elif cannot_start:
        phase, message = "Starting", cannot_start[1]
    elif o.deployment_status(ray_job) == o.DEPLOYMENT_RUNNING:
        phase, message = "Running", f"training (attempt {attempt})"
        conditions.append(_condition(RUNNING, True, "RayJobRunning",
                                     f"the Ray job {rj_status.get('jobId', '')} is running".replace("  ", " ")))
    elif (staging := _staging(pods)) is not None:
        phase, message = "Staging", staging
        conditions.append(_condition(STAGED, False, "Staging", staging))
    else:
        phase = "Starting"
        message = _unscheduled(pods) or f"waiting for the Ray cluster: {running_pods}/{expected_pods} pods running"

    # --- conditions every phase reports -------------------------------------------------
    types = {c["type"] for c in conditions}
    if STAGED not in types:
        if not pods:
            conditions.append(_condition(STAGED, None, "NoPods", "no Ray pods yet"))
        elif (staging := _staging(pods)) is not None:
            conditions.append(_condition(STAGED, False, "Staging", staging))
        else:
            conditions.append(_condition(STAGED, True, "Staged", "model, data and checkpoint are in every pod"))
    if cluster_state == "ready":
        conditions.append(_condition(CLUSTER_READY, True, "RayClusterReady",
                                     f"RayCluster {ray_cluster['metadata']['name']}: {running_pods} pods running"))
    elif cannot_start:
        conditions.append(_condition(CLUSTER_READY, False, cannot_start[0], cannot_start[1]))
    else:
        why = _unscheduled(pods) or (f"RayCluster {ray_cluster['metadata']['name']} is "
                                     f"{cluster_state or 'starting'}: {running_pods}/{expected_pods} pods running"
                                     if ray_cluster else "no RayCluster yet")
        conditions.append(_condition(CLUSTER_READY, False, "RayClusterNotReady", why))
    if RUNNING not in types:
        conditions.append(_condition(RUNNING, False, phase, message))
    if current.last_checkpoint:
        ckpt = current.last_checkpoint
        conditions.append(_condition(CHECKPOINTED, True, "CheckpointSaved", f"step {ckpt.step} at {ckpt.uri}"))
    else:
        conditions.append(_condition(CHECKPOINTED, False, "NoCheckpoint", "no complete checkpoint yet"))
    if SUCCEEDED not in types:
        conditions.append(_condition(SUCCEEDED, False, phase, "the job has not finished"))
    if FAILED not in types:
        conditions.append(_condition(FAILED, False, phase, "the job has not failed"))
    if SUSPENDED not in types:
        conditions.append(_condition(SUSPENDED, False, "NotSuspended", "spec.suspend is false"))
    if queue is not None:
        conditions.append(_condition(ADMITTED, queue[0], queue[1], queue[2]))
    if refused:
        fields = ", ".join(f"spec.{f}" for f in refused)
        conditions.append(_condition(SPEC_CHANGE_REFUSED, True, "ImmutableWhileRunning",
                                     f"{fields} cannot change while the job exists; the job keeps running "
                                     f"with the previous values. Revert the change, or delete and recreate "
                                     f"the job to use the new ones"))
    else:
        conditions.append(_condition(SPEC_CHANGE_REFUSED, False, "NoChange", "the spec in effect is the spec given"))
    if scale_down_wait is not None:
        conditions.append(_condition(ROLLOUT_SCALED, False, *scale_down_wait))
    else:
        conditions.append(_condition(ROLLOUT_SCALED, True, "NoScaleDownPending",
                                     "no scale-down of the rollout group waits for the driver"))

    out: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "conditions": _merge_conditions(old.get("conditions", []), conditions, now, job.metadata.generation),
        "restarts": attempt,
        "rayJobName": ray_job["metadata"]["name"] if ray_job else ray_job_name(job.metadata.name, attempt),
    }
    if job.metadata.generation is not None:
        out["observedGeneration"] = job.metadata.generation
    cluster_name = rj_status.get("rayClusterName") or old.get("rayClusterName")
    if cluster_name:
        out["rayClusterName"] = cluster_name
    if rj_status.get("dashboardURL"):
        out["dashboardURL"] = "http://" + rj_status["dashboardURL"].removeprefix("http://")
    elif old.get("dashboardURL"):
        out["dashboardURL"] = old["dashboardURL"]
    start = old.get("startTime")
    if not start and phase == "Running":
        start = rj_status.get("startTime") or o.format_time(now)
    if start:
        out["startTime"] = start
    if phase in FINISHED_PHASES:
        out["completionTime"] = rj_status.get("endTime") or o.format_time(now)
    return out


def status_changed(job_status: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether writing ``patch`` would change anything (the watch echoes our own writes back)."""
    current = job_status or {}
    return any(current.get(k) != v for k, v in patch.items())
