"""A job the operator cannot run as written ends Failed, with the field named, once.

The API server's schema and CEL rules refuse bad manifests up front; a job stored before a rule
existed (or under an older CRD) still reaches the operator. Rendering it would fail on every
reconcile, forever and silently; instead the job goes to phase Failed with a Failed condition and
one Warning event that name the field and the fix. Failed is final (``next_action`` leaves
finished jobs alone), so nothing retries it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from kuberl.api import types as t
from kuberl.api.validate import ManifestError, pod_errors, uri_errors
from kuberl.api.uri import URIError
from kuberl_operator.observed import Observed, format_time
from kuberl_operator.reconcile import Event, Plan, Settings, next_action
from kuberl_operator.status import FAILED, FINISHED_PHASES

REASON = "InvalidSpec"


def job_problems(job: t.RLTrainingJob) -> list[str]:
    """Why ``job`` cannot be rendered ("field: what is wrong" lines); none for a finished job."""
    if job.status and job.status.phase in FINISHED_PHASES:
        return []
    return uri_errors(job) + pod_errors(job)


def failed_plan(job: t.RLTrainingJob, problems: list[str], now: datetime) -> Plan:
    """Phase Failed, a Failed=True condition and one Warning event, all naming the problems."""
    message = (f"the job cannot run as written: {'; '.join(problems)}. Fix the field, then delete and "
               f"recreate the job")[:32768]
    current = job.status.model_dump(mode="json", by_alias=True, exclude_none=True) if job.status else {}
    condition = {"type": FAILED, "status": "True", "reason": REASON, "message": message,
                 "lastTransitionTime": format_time(now)}
    if job.metadata.generation is not None:
        condition["observedGeneration"] = job.metadata.generation
    status = {
        "phase": "Failed",
        "message": message,
        "conditions": [c for c in current.get("conditions", []) if c.get("type") != FAILED] + [condition],
        "completionTime": format_time(now),
    }
    if job.metadata.generation is not None:
        status["observedGeneration"] = job.metadata.generation
    return Plan(status=status, events=[Event("Warning", REASON, message)])


def checked_plan(job: t.RLTrainingJob, observe: Callable[[], Observed], now: datetime, settings: Settings) -> Plan:
    """``next_action`` for a job that can run; ``failed_plan`` for one that cannot, whether the
    checks above say so or rendering does (a field they missed: still final, never retried)."""
    problems = job_problems(job)
    if problems:
        return failed_plan(job, problems, now)
    try:
        return next_action(job, observe(), now, settings)
    except (ManifestError, URIError) as err:
        return failed_plan(job, [str(err)], now)
