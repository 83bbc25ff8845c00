"""What the operator should do for one RLTrainingJob, as a pure function of what it observed.

Level-triggered: the same observation always gives the same plan, so running it twice, or after
a crash half-way, converges instead of duplicating. Names are deterministic (``<job>``, then
``<job>-r<n>`` per restart) and the attempt number only grows: it is the larger of
``status.restarts`` and the newest owned RayJob's ``kuberl.dev/attempt`` annotation, so a stale
cached status can never make the operator delete the attempt that is running.

Spec changes: ``suspend``, ``backoffLimit`` and ``ttlSecondsAfterFinished`` apply to a running job;
any other change is refused (reported, not applied). The spec in effect is the one stored in the
job's ConfigMap when the current attempt was created; restarts render from it too.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import yaml

from kuberl.job import plan as plans
from kuberl.api import types as t
from kuberl.api.contract import CONFIG_FILE, PLAN_FILE, ray_job_name
from kuberl.job.render import render
from kuberl_operator import observed as o
from kuberl_operator.status import (FINISHED_PHASES, SUSPENDED, compute_status, current_workload_error,
                                    finished_status)

# camelCase spec fields that may change while a job exists.
MUTABLE_FIELDS = ("suspend", "backoffLimit", "ttlSecondsAfterFinished")


@dataclass(frozen=True)
class Settings:
    """Knobs of the reconcile loop; tests shrink the backoff to keep runs short."""

    restart_backoff_seconds: float = 10.0
    restart_backoff_max_seconds: float = 300.0
    resync_seconds: float = 60.0
    # How long a suspend waits for the driver's checkpoint before it takes the cluster anyway.
    suspend_checkpoint_timeout_seconds: float = 600.0
    # How often to look again while it waits.
    suspend_poll_seconds: float = 2.0


@dataclass
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Plan:
    """Writes to make, in this order: status, objects to apply, RayJob suspend flag, deletions."""

    status: dict[str, Any]
    apply: list[dict[str, Any]] = field(default_factory=list)
    suspend: tuple[str, bool] | None = None
    delete_ray_jobs: list[str] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    events: list[Event] = field(default_factory=list)


def current_attempt(job: t.RLTrainingJob, observed: o.Observed) -> int:
    restarts = job.status.restarts if job.status else 0
    return max([restarts, *(o.attempt_of(rj) for rj in observed.ray_jobs.values())])


def accepted_spec(job: t.RLTrainingJob, observed: o.Observed) -> dict[str, Any] | None:
    """The spec the current attempt was created with (from its ConfigMap), if there is one."""
    cm = observed.config_map
    if not cm or CONFIG_FILE not in (cm.get("data") or {}):
        return None
    return (yaml.load(cm["data"][CONFIG_FILE], Loader=plans.YAML_LOADER) or {}).get("spec")


def written_plan(observed: o.Observed) -> plans.RunPlan | None:
    """The run plan in the job's ConfigMap (the one its newest attempt was created with), if any."""
    data = (observed.config_map or {}).get("data") or {}
    return plans.read(data[PLAN_FILE]) if PLAN_FILE in data else None


def _spec_dict(job: t.RLTrainingJob) -> dict[str, Any]:
    return job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)


def refused_changes(job: t.RLTrainingJob, observed: o.Observed) -> list[str]:
    """Top-level spec fields that differ from the spec in effect and may not change."""
    accepted = accepted_spec(job, observed)
    if accepted is None:
        return []
    given = _spec_dict(job)
    keys = (set(given) | set(accepted)) - set(MUTABLE_FIELDS)
    return sorted(k for k in keys if given.get(k) != accepted.get(k))


def effective_job(job: t.RLTrainingJob, observed: o.Observed) -> t.RLTrainingJob:
    """``job`` with the spec in effect plus the mutable fields as given now."""
    accepted = accepted_spec(job, observed)
    if accepted is None:
        return job
    spec = copy.deepcopy(accepted)
    given = _spec_dict(job)
    for key in MUTABLE_FIELDS:
        if key in given:
            spec[key] = given[key]
        else:
            spec.pop(key, None)
    return job.model_copy(update={"spec": t.RLTrainingJobSpec.model_validate(spec)})


def desired_objects(job: t.RLTrainingJob, observed: o.Observed, attempt: int | None = None, *,
                    effective: t.RLTrainingJob | None = None, plan: plans.RunPlan | None = None) -> list[dict[str, Any]]:
    """The objects of ``attempt`` (default: the current one), rendered from the spec in effect
    (``effective``, if the caller has it) and ``plan``, the attempt's run plan (built here if not
    given: a reconcile builds it once and passes it to the status too).

    A restart resumes from the newest complete checkpoint under spec.checkpoint.uri, decided by
    the spec alone (``kuberl.job.plan.resume``): status.lastCheckpoint is the workload's to write and
    never steers what the next attempt mounts or restores. The RayJob is created suspended when
    the job is.
    """
    if attempt is None:
        attempt = current_attempt(job, observed)
    objects = render(effective or effective_job(job, observed), attempt=attempt, plan=plan)
    if job.spec.suspend:
        objects[-1]["spec"]["suspend"] = True
    return objects


def backoff_seconds(settings: Settings, attempt: int) -> float:
    """Wait before restart ``attempt + 1``: base * 2^attempt, capped."""
    return min(settings.restart_backoff_seconds * (2 ** attempt), settings.restart_backoff_max_seconds)


def _failed_at(ray_job: dict[str, Any], job: t.RLTrainingJob) -> datetime | None:
    end = o.parse_time((ray_job.get("status") or {}).get("endTime"))
    if end:
        return end
    # KubeRay leaves endTime empty when the submitter failed before Ray reported; the
    # Running=False/Restarting condition records when the operator first saw the failure.
    for cond in (job.status.conditions if job.status else []):
        if cond.type == "Running" and cond.reason == "Restarting":
            return cond.last_transition_time
    return None


def checkpoint_before_suspend(job: t.RLTrainingJob, ray_job: dict[str, Any], now: datetime,
                              settings: Settings) -> str | None:
    """While spec.suspend waits for the driver to checkpoint its last step, what it waits for;
    None once the cluster may go. KubeRay deletes a suspended RayJob's cluster without stopping
    its Ray job, so the driver (which reads spec.suspend after every step) saves first and then
    holds; the operator suspends the RayJob once the driver says it holds
    (status.progress.heldForSuspend) and status.lastCheckpoint has caught up with
    status.progress. Checkpoint and progress alone would not do: a suspend that lands mid-step
    finds both at the previous step while the driver is still training the next. It does not
    wait without a checkpoint.uri, without a running Ray job, before the first step, or past the
    timeout."""
    status = job.status
    progress = status.progress if status else None
    if not job.spec.checkpoint.uri or o.deployment_status(ray_job) != o.DEPLOYMENT_RUNNING or progress is None:
        return None
    saved = status.last_checkpoint.step if status.last_checkpoint else 0
    if progress.held_for_suspend and saved >= progress.step:
        return None
    since = next((c.last_transition_time for c in status.conditions
                  if c.type == SUSPENDED and c.status == "True"), now)
    if (now - since).total_seconds() >= settings.suspend_checkpoint_timeout_seconds:
        return None
    doing = (f"checkpoint step {progress.step}" if progress.held_for_suspend
             else f"end the step in flight (step {progress.step} is its last reported), checkpoint it and hold")
    return (f"suspending: waiting for the driver to {doing} before the Ray cluster is deleted "
            f"(at most {settings.suspend_checkpoint_timeout_seconds:.0f} s)")


def next_action(job: t.RLTrainingJob, observed: o.Observed, now: datetime, settings: Settings) -> Plan:
    """Everything to do for ``job`` now: status to write, objects to create, what to delete."""
    attempt = current_attempt(job, observed)
    name = ray_job_name(job.metadata.name, attempt)
    ray_job = observed.ray_jobs.get(name)
    stale = sorted(n for n, rj in observed.ray_jobs.items() if n != name and o.attempt_of(rj) < attempt)
    refused = refused_changes(job, observed)
    old_status = job.status.model_dump(mode="json", by_alias=True, exclude_none=True) if job.status else {}
    old_phase = old_status.get("phase")

    if old_phase in FINISHED_PHASES:
        plan = Plan(status=finished_status(job))
        ttl = job.spec.ttl_seconds_after_finished
        finished = job.status.completion_time if job.status else None
        if ttl is not None and finished is not None:
            left = (finished - now).total_seconds() + ttl
            if left <= 0:
                plan.delete_job = True
                plan.events.append(Event("Normal", "Expired", f"deleting the job {ttl} s after it finished"))
            else:
                plan.requeue_after = left
        return plan

    restart_in = None
    plan_apply: list[dict[str, Any]] = []
    delete = list(stale)
    events: list[Event] = []
    requeue = None
    status_attempt = attempt
    suspend = None
    suspend_wait = None
    # Built once per reconcile, and only when needed: the spec in effect, and the run plans of the
    # attempt the status describes (the ConfigMap's, else the spec's) and of the attempt to create.
    effective = functools.cache(lambda: effective_job(job, observed))
    in_effect = written_plan(observed)

    if ray_job is None:
        run_plan = plans.for_cluster(effective(), attempt)
        in_effect = in_effect or run_plan
        plan_apply = desired_objects(job, observed, attempt, effective=effective(), plan=run_plan)
        events.append(Event("Normal", "Creating", f"creating RayJob {name} (attempt {attempt})"))
    elif o.failed(ray_job) and not o.validation_failed(ray_job) and not job.spec.suspend \
            and current_workload_error(job, attempt) is None:
        if attempt < job.spec.backoff_limit:
            wait = backoff_seconds(settings, attempt)
            failed_at = _failed_at(ray_job, job) or now
            left = (failed_at - now).total_seconds() + wait
            if left > 0:
                restart_in, requeue = left, left
            else:
                status_attempt = attempt + 1
                plan_apply = desired_objects(job, observed, status_attempt, effective=effective(),
                                             plan=plans.for_cluster(effective(), status_attempt))
                delete.append(name)
                ray_job = None
                events.append(Event("Warning", "Restarting",
                                    f"RayJob {name} failed: {o.failure_reason(observed.ray_jobs[name])}; "
                                    f"starting {ray_job_name(job.metadata.name, status_attempt)} "
                                    f"(restart {status_attempt} of {job.spec.backoff_limit}) from the last checkpoint"))
    elif bool((ray_job.get("spec") or {}).get("suspend")) != job.spec.suspend and not o.failed(ray_job) \
            and not o.succeeded(ray_job):
        suspend_wait = checkpoint_before_suspend(job, ray_job, now, settings) if job.spec.suspend else None
        if suspend_wait:
            requeue = settings.suspend_poll_seconds
        else:
            suspend = (name, job.spec.suspend)
            events.append(Event("Normal", "Suspending" if job.spec.suspend else "Resuming",
                                f"setting spec.suspend={str(job.spec.suspend).lower()} on RayJob {name}"))
    if refused and "SpecChangeRefused" not in {c.type for c in (job.status.conditions if job.status else [])
                                              if c.status == "True"}:
        events.append(Event("Warning", "SpecChangeRefused",
                            ", ".join(f"spec.{f}" for f in refused) + " cannot change while the job exists"))

    cluster = observed.ray_cluster if ray_job is not None else None
    pods = observed.pods if ray_job is not None else []
    status = compute_status(job, in_effect or plans.for_cluster(effective(), attempt), ray_job, cluster, pods, now,
                            attempt=status_attempt, refused=refused,
                            restart_in=restart_in, suspend_wait=suspend_wait)
    plan = Plan(status=status, apply=plan_apply, suspend=suspend, delete_ray_jobs=delete, events=events,
                requeue_after=requeue)
    if status.get("phase") != old_phase:
        plan.events.append(Event("Warning" if status["phase"] == "Failed" else "Normal", status["phase"],
                                 status.get("message", "")))
    if status["phase"] in FINISHED_PHASES and job.spec.ttl_seconds_after_finished is not None:
        plan.requeue_after = float(job.spec.ttl_seconds_after_finished)
    return plan
