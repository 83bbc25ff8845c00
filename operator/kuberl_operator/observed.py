"""What the operator saw of one RLTrainingJob's world, and how to read KubeRay's RayJob states.

Everything here is plain data taken from watch caches; the reconcile and status functions are
pure functions of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kuberl.api.contract import ATTEMPT_ANNOTATION

# KubeRay's RayJob status.jobDeploymentStatus values (ray-operator/apis/ray/v1/rayjob_types.go).
DEPLOYMENT_FAILED = "Failed"
DEPLOYMENT_COMPLETE = "Complete"
DEPLOYMENT_RUNNING = "Running"
DEPLOYMENT_SUSPENDING = "Suspending"
DEPLOYMENT_SUSPENDED = "Suspended"
DEPLOYMENT_VALIDATION_FAILED = "ValidationFailed"
# status.jobStatus (the Ray job inside the cluster).
JOB_SUCCEEDED = "SUCCEEDED"
JOB_FAILED = "FAILED"


@dataclass
class Observed:
    """Objects that belong to one job (label kuberl.dev/job, owned by its uid)."""

    ray_jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_map: dict[str, Any] | None = None
    ray_cluster: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    # ``cost.pod_usage`` of every pod with the job's label, of every attempt (the accounting's input).
    usages: list[dict[str, Any]] = field(default_factory=list)
    # The Kueue Workload of the current attempt's RayJob (spec.scheduling.queueName), once Kueue made it.
    workload: dict[str, Any] | None = None


def attempt_of(ray_job: dict[str, Any]) -> int:
    """The attempt a RayJob belongs to, from the annotation the renderer sets."""
    value = (ray_job.get("metadata", {}).get("annotations") or {}).get(ATTEMPT_ANNOTATION, "0")
    try:
        return int(value)
    except ValueError:
        return 0


def deployment_status(ray_job: dict[str, Any] | None) -> str:
    return ((ray_job or {}).get("status") or {}).get("jobDeploymentStatus") or ""


def job_status(ray_job: dict[str, Any] | None) -> str:
    return ((ray_job or {}).get("status") or {}).get("jobStatus") or ""


def succeeded(ray_job: dict[str, Any] | None) -> bool:
    return deployment_status(ray_job) == DEPLOYMENT_COMPLETE and job_status(ray_job) == JOB_SUCCEEDED


def validation_failed(ray_job: dict[str, Any] | None) -> bool:
    return deployment_status(ray_job) == DEPLOYMENT_VALIDATION_FAILED


def failed(ray_job: dict[str, Any] | None) -> bool:
    """The attempt is over without success: Ray job FAILED/STOPPED, or KubeRay gave up on it."""
    if ray_job is None:
        return False
    dep = deployment_status(ray_job)
    return dep == DEPLOYMENT_FAILED or job_status(ray_job) == JOB_FAILED or (
        dep == DEPLOYMENT_COMPLETE and job_status(ray_job) != JOB_SUCCEEDED)


# The longest failure reason the operator repeats (status, conditions, events).
FAILURE_REASON_CHARS = 512
# A line of a Python log that names an exception: "RuntimeError: ...", "kuberl.x.RewardError: ...".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b[^:\s]*:")


def _summary(message: str) -> str:
    """KubeRay's message for a failed Ray job ends with up to 20,000 characters of the driver's
    log: its first line, and the log's last exception raised by the driver itself (Ray prefixes
    its actors' lines with "(ActorName pid=...)")."""
    first, _, log = message.partition("\n")
    first = first.split(", last available logs")[0]
    raised = [line.strip() for line in log.splitlines() if _EXCEPTION_LINE.match(line.strip())]
    text = f"{first}; last error: {raised[-1]}" if raised else first
    return text if len(text) <= FAILURE_REASON_CHARS else text[:FAILURE_REASON_CHARS - 1] + "…"


def failure_reason(ray_job: dict[str, Any]) -> str:
    """KubeRay's words for why the attempt failed, e.g. "AppFailed: exit code 1", short enough to
    repeat in status and events."""
    status = ray_job.get("status") or {}
    reason = status.get("reason") or job_status(ray_job) or deployment_status(ray_job)
    message = _summary(status.get("message") or "")
    return f"{reason}: {message}" if message else reason


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


# Kueue's Workload conditions (kueue.x-k8s.io/v1beta2): quota reserved in a ClusterQueue, then
# admitted (every admission check passed), or evicted (preempted, deactivated...) since.
WORKLOAD_QUOTA_RESERVED = "QuotaReserved"
WORKLOAD_ADMITTED = "Admitted"
WORKLOAD_EVICTED = "Evicted"


def _workload_condition(workload: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in ((workload or {}).get("status") or {}).get("conditions") or [] if c.get("type") == type_),
                None)


def workload_active(workload: dict[str, Any] | None) -> bool:
    """Kueue's spec.active (absent means active): false once deactivated, which evicts the job."""
    return ((workload or {}).get("spec") or {}).get("active", True) is not False


def queue_state(queue: str, workload: dict[str, Any] | None) -> tuple[bool, str, str]:
    """(admitted, reason, message) of a job in Kueue LocalQueue ``queue``, from its Workload's
    conditions: what it waits for in Kueue's own words (e.g. "insufficient unused quota for
    nvidia.com/gpu in flavor gpu, 1 more needed")."""
    if workload is None:
        return False, "NoWorkload", (f"waiting for Kueue to create the Workload in LocalQueue {queue} (is Kueue "
                                     f"running with its RayJob integration, and does the LocalQueue exist?)")
    name = workload["metadata"]["name"]
    admitted = _workload_condition(workload, WORKLOAD_ADMITTED)
    if admitted is not None and admitted.get("status") == "True":
        return True, "Admitted", f"admitted by Kueue from LocalQueue {queue} (Workload {name})"
    evicted = _workload_condition(workload, WORKLOAD_EVICTED)
    if evicted is not None and evicted.get("status") == "True":
        return False, f"Evicted{evicted.get('reason', '')}", (
            f"evicted by Kueue from LocalQueue {queue} (Workload {name}): {evicted.get('message', '')}; it resumes "
            f"from its newest checkpoint when admitted again")
    reserved = _workload_condition(workload, WORKLOAD_QUOTA_RESERVED)
    if reserved is not None and reserved.get("status") == "True":
        return False, "AdmissionChecks", (f"quota reserved in LocalQueue {queue} (Workload {name}); waiting for "
                                          f"its admission checks: {admitted.get('message', '') if admitted else ''}")
    why = (reserved or {}).get("message") or "not considered by Kueue yet"
    return False, (reserved or {}).get("reason") or "Queued", f"queued in LocalQueue {queue} (Workload {name}): {why}"

