"""What the operator should do for one RLTrainingJob, as a pure function of what it observed.

Level-triggered: the same observation always gives the same plan, so running it twice, or after
a crash half-way, converges instead of duplicating. Names are deterministic (``<job>``, then
``<job>-r<n>`` per restart) and the attempt number only grows: it is the larger of
``status.restarts`` and the newest owned RayJob's ``kuberl.dev/attempt`` annotation, so a stale
cached status can never make the operator delete the attempt that is running.

Spec changes: ``suspend``, ``backoffLimit``, ``ttlSecondsAfterFinished`` and ``rollout.replicas``
apply to a running job; any other change is refused (reported, not applied). The spec in effect is
the one stored in the job's ConfigMap when the current attempt was created, with ``rollout.replicas``
written there again when it changes; restarts render from it too.

A live resize of ``rollout.replicas`` (``rollout_scale``): a scale-up raises the RayCluster's rollout
group at once (the driver's new engines wait in Ray's queue for the pods); a scale-down waits for the
driver, which retires engines at a step boundary and names the pods its live engines run in
(status.rollout), then lowers the group with other rollout pods in ``workersToDelete`` (KubeRay
would otherwise delete any pod, maybe the one with the only live engine).
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
from kuberl.api.contract import CONFIG_FILE, PLAN_FILE, ROLE_LABEL, ROLLOUT_GROUP, ray_job_name
from kuberl.job.render import render
from kuberl_operator import observed as o
from kuberl_operator.cost import account
from kuberl_operator.status import (FINISHED_PHASES, ROLLOUT_SCALED, SUSPENDED, compute_status,
                                    current_workload_error, finished_status)

# camelCase spec fields (dotted paths) that may change while a job exists.
MUTABLE_FIELDS = ("suspend", "backoffLimit", "ttlSecondsAfterFinished", "rollout.replicas")


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
    # How long a scale-down of the rollout group waits for the driver to retire engines before the
    # RolloutScaled condition says it is stuck. The driver does so at its next step boundary, so
    # this is one step's time with room to spare: as long as a suspend waits for a step's checkpoint.
    scale_down_timeout_seconds: float = 600.0
    # How often a running job's growing status.cost is written (one status write per job each time;
    # pods coming, starting, ending or going are written at once).
    cost_refresh_seconds: float = 300.0
    # Price of one GPU-hour (chart value cost.gpuHourPrice): status.cost.estimatedCost; None: no estimate.
    gpu_hour_price: float | None = None


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
    # (RayCluster name, JSON patch) resizing its rollout worker group.
    scale_cluster: tuple[str, list[dict[str, Any]]] | None = None
    # (Kueue Workload name, spec.active): how a job with a queue is suspended and resumed.
    workload_active: tuple[str, bool] | None = None


def current_attempt(job: t.RLTrainingJob, observed: o.Observed) -> int:
    restarts = job.status.restarts if job.status else 0
    return max([restarts, *(o.attempt_of(rj) for rj in observed.ray_jobs.values())])


def accepted_spec(job: t.RLTrainingJob, observed: o.Observed) -> dict[str, Any] | None:
    """The spec the current attempt was created with (from its ConfigMap), if there is one. Shared
    between calls: read it, never change it."""
    cm = observed.config_map
    if not cm or CONFIG_FILE not in (cm.get("data") or {}):
        return None
    return _config_spec(cm["data"][CONFIG_FILE])


@functools.lru_cache(maxsize=1024)
def _config_spec(config: str) -> dict[str, Any] | None:
    """The spec in a ConfigMap's config file, parsed once per text: a reconcile reads it up to three
    times (refused changes, the spec in effect, a live resize), and a running job's ConfigMap
    changes only with its spec in effect."""
    return (yaml.load(config, Loader=plans.YAML_LOADER) or {}).get("spec")


def written_plan(observed: o.Observed) -> plans.RunPlan | None:
    """The run plan in the job's ConfigMap (the one its newest attempt was created with), if any."""
    data = (observed.config_map or {}).get("data") or {}
    return _read_plan(data[PLAN_FILE]) if PLAN_FILE in data else None


@functools.lru_cache(maxsize=1024)
def _read_plan(text: str) -> plans.RunPlan:
    """A ConfigMap's plan, parsed once per text (a frozen model, safe to share): every reconcile
    of a job reads it, and parsing it was a tenth of the operator's CPU (bench/operator_scale.py)."""
    return plans.read(text)


def _spec_dict(job: t.RLTrainingJob) -> dict[str, Any]:
    return job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)


def _with_mutable(spec: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``spec`` whose MUTABLE_FIELDS are ``source``'s (absent where it has none)."""
    spec = copy.deepcopy(spec)
    for path in MUTABLE_FIELDS:
        *parents, key = path.split(".")
        src, dst = source, spec
        for parent in parents:
            src, dst = (src or {}).get(parent), dst.setdefault(parent, {})
        if src is not None and key in src:
            dst[key] = src[key]
        else:
            dst.pop(key, None)
    return spec


def refused_changes(job: t.RLTrainingJob, observed: o.Observed) -> list[str]:
    """Top-level spec fields that differ from the spec in effect in more than MUTABLE_FIELDS."""
    accepted = accepted_spec(job, observed)
    if accepted is None:
        return []
    given = _spec_dict(job)
    accepted = _with_mutable(accepted, given)
    return sorted(k for k in set(given) | set(accepted) if given.get(k) != accepted.get(k))


def effective_job(job: t.RLTrainingJob, observed: o.Observed) -> t.RLTrainingJob:
    """``job`` with the spec in effect plus the mutable fields as given now."""
    accepted = accepted_spec(job, observed)
    if accepted is None:
        return job
    spec = _with_mutable(accepted, _spec_dict(job))
    return job.model_copy(update={"spec": t.RLTrainingJobSpec.model_validate(spec)})


def rollout_group(ray_cluster: dict[str, Any] | None) -> tuple[int, int] | None:
    """(index, replicas) of the rollout worker group in the RayCluster's spec, if it has one."""
    groups = ((ray_cluster or {}).get("spec") or {}).get("workerGroupSpecs") or []
    return next(((i, g.get("replicas", 0)) for i, g in enumerate(groups) if g.get("groupName") == ROLLOUT_GROUP),
                None)


def rollout_scale(job: t.RLTrainingJob, attempt: int, ray_cluster: dict[str, Any] | None,
                  pods: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The JSON patch that brings the running RayCluster's rollout group to spec.rollout.replicas,
    if it is not there: a scale-up at once; a scale-down once this attempt's driver reports
    (status.rollout) that it applied the new replicas, which it does at its next step boundary,
    naming the pods its live engines run in: the group's other pods go, as ``workersToDelete``
    (in name order; should fewer than that be free of engines, KubeRay picks the rest)."""
    group = rollout_group(ray_cluster)
    wanted = job.spec.rollout.replicas
    if job.spec.rollout.colocate or group is None or group[1] == wanted:
        return None
    index, replicas = group
    to_delete: list[str] = []
    if wanted < replicas:
        reported = job.status.rollout if job.status else None
        if reported is None or reported.attempt != attempt or reported.replicas != wanted:
            return None
        # Only this group's pods: KubeRay deletes any pod of the cluster named here, head included.
        rollout_pods = sorted(p["metadata"]["name"] for p in pods
                              if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == ROLLOUT_GROUP)
        to_delete = [pod for pod in rollout_pods if pod not in reported.engine_pods][:replicas - wanted]
    at = f"/spec/workerGroupSpecs/{index}"
    patch = [{"op": "test", "path": f"{at}/groupName", "value": ROLLOUT_GROUP},
             *({"op": "replace", "path": f"{at}/{key}", "value": wanted}
               for key in ("minReplicas", "maxReplicas", "replicas")),
             {"op": "add", "path": f"{at}/scaleStrategy", "value": {"workersToDelete": to_delete}}]
    return patch


# The RolloutScaled condition's reason once a scale-down has waited past its bound.
DRIVER_NOT_REPORTING = "DriverNotReporting"


def scale_down_wait(job: t.RLTrainingJob, attempt: int, ray_cluster: dict[str, Any] | None, now: datetime,
                    settings: Settings) -> tuple[str, str, float | None] | None:
    """While a scale-down of the running RayCluster's rollout group waits for the driver's report
    (``rollout_scale``): the RolloutScaled condition's reason and message, and the seconds left
    before the bound (None once past it: then the message names the cause and what to do). The
    wait began when the condition turned False. None when no scale-down waits."""
    group = rollout_group(ray_cluster)
    wanted = job.spec.rollout.replicas
    if job.spec.rollout.colocate or group is None or group[1] <= wanted:
        return None
    replicas = group[1]
    status = job.status
    since = next((c.last_transition_time for c in (status.conditions if status else [])
                  if c.type == ROLLOUT_SCALED and c.status == "False"), now)
    left = settings.scale_down_timeout_seconds - (now - since).total_seconds()
    if left > 0:
        return ("WaitingForDriver",
                f"spec.rollout.replicas {replicas} -> {wanted}: waiting for the driver to retire engines at its next "
                f"step boundary and report the pods they run in (status.rollout), at most "
                f"{settings.scale_down_timeout_seconds:.0f} s", left)
    reported = status.rollout if status else None
    seen = (f"status.rollout says attempt {reported.attempt}, replicas {reported.replicas}" if reported
            else "status.rollout is empty")
    return (DRIVER_NOT_REPORTING,
            f"spec.rollout.replicas {replicas} -> {wanted}: the driver of attempt {attempt} has not reported retiring "
            f"engines within {settings.scale_down_timeout_seconds:.0f} s ({seen}), so the RayCluster keeps "
            f"{replicas} rollout pods. The driver applies the change at a step boundary: if progress.step does not "
            f"advance, read the driver's log (kubectl logs on the head pod); set spec.rollout.replicas back to "
            f"{replicas} to withdraw the change. A restart (the next attempt) runs with {wanted}", None)


def desired_objects(job: t.RLTrainingJob, observed: o.Observed, attempt: int | None = None, *,
                    effective: t.RLTrainingJob | None = None, plan: plans.RunPlan | None = None) -> list[dict[str, Any]]:
    """The objects of ``attempt`` (default: the current one), rendered from the spec in effect
    (``effective``, if the caller has it) and ``plan``, the attempt's run plan (built here if not
    given: a reconcile builds it once and passes it to the status too).

    A restart resumes from the newest complete checkpoint under spec.checkpoint.uri, decided by
    the spec alone (``kuberl.job.plan.resume``): status.lastCheckpoint is the workload's to write and
    never steers what the next attempt mounts or restores. The RayJob is created suspended when
    the job is, and when it has a Kueue queue: Kueue admits it by unsuspending it (as Kueue's own
    webhook would suspend it; created suspended, no Ray cluster starts before admission even
    where that webhook is missing).
    """
    if attempt is None:
        attempt = current_attempt(job, observed)
    objects = render(effective or effective_job(job, observed), attempt=attempt, plan=plan)
    if job.spec.suspend or job.spec.scheduling.queue_name:
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


# status.recoveries' kinds (wire names) -> the Event the operator posts for a new one.
RECOVERY_EVENTS = {
    "trainer": ("Warning", "TrainerRecovered", "a trainer rank was lost; a new trainer group restored the newest "
                "checkpoint in the same Ray cluster"),
    "engineLost": ("Warning", "EngineLost", "a rollout engine was lost; its requests went to the engines left"),
    "engineReplaced": ("Normal", "EngineReplaced", "a replacement rollout engine joined with the current weights"),
    "resize": ("Normal", "Resized", "the rollout pool reached spec.rollout.replicas"),
}


def recovery_events(status: t.RLTrainingJobStatus | None) -> tuple[list[Event], dict[str, int]]:
    """An Event for each kind of recovery the driver counted (status.recoveries) since the
    operator last posted one (status.recoveryEvents), and the counts posted after these."""
    recoveries = status.recoveries.model_dump(by_alias=True, exclude_none=True) if status and status.recoveries else {}
    posted = dict(status.recovery_events) if status else {}
    events = []
    for kind, recovery in recoveries.items():
        new = recovery.get("count", 0) - posted.get(kind, 0)
        if new <= 0:
            continue
        type_, reason, what = RECOVERY_EVENTS[kind]
        seconds = recovery.get("lastSeconds")
        took = f"; the last took {seconds:.1f} s" if seconds is not None else ""
        events.append(Event(type_, reason, f"{what} ({new} new, {recovery['count']} in all{took})"))
        posted[kind] = recovery["count"]
    return events, posted


def with_cost(status: dict[str, Any], job: t.RLTrainingJob, observed: o.Observed, now: datetime,
              settings: Settings) -> dict[str, Any]:
    """``status`` with ``cost`` brought up to date from every pod the job has (``cost.account``)."""
    old = job.status.cost.model_dump(mode="json", by_alias=True, exclude_none=True) if job.status and job.status.cost else None
    progress = job.status.progress if job.status else None
    new = account(old, observed.usages, now, refresh_seconds=settings.cost_refresh_seconds,
                  gpu_hour_price=settings.gpu_hour_price,
                  tokens_per_second=progress.tokens_per_second if progress else None)
    return {**status, "cost": new} if new else status


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
        # Still accounted: the pods of a finished job run until KubeRay has deleted them.
        plan = Plan(status=with_cost(finished_status(job), job, observed, now, settings))
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
    workload_active = None
    queue = job.spec.scheduling.queue_name
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
    elif queue and not o.failed(ray_job) and not o.succeeded(ray_job):
        # Kueue owns the RayJob's suspend flag (it would undo ours): a suspend deactivates the
        # Workload, after the driver's checkpoint as without a queue, and a resume activates it.
        workload = observed.workload
        if workload is not None and o.workload_active(workload) == job.spec.suspend:
            suspend_wait = checkpoint_before_suspend(job, ray_job, now, settings) \
                if job.spec.suspend and not (ray_job.get("spec") or {}).get("suspend") else None
            if suspend_wait:
                requeue = settings.suspend_poll_seconds
            else:
                workload_active = (workload["metadata"]["name"], not job.spec.suspend)
                events.append(Event("Normal", "Suspending" if job.spec.suspend else "Resuming",
                                    f"setting spec.active={str(not job.spec.suspend).lower()} on Kueue "
                                    f"Workload {workload['metadata']['name']}"))
    elif bool((ray_job.get("spec") or {}).get("suspend")) != job.spec.suspend and not o.failed(ray_job) \
            and not o.succeeded(ray_job):
        suspend_wait = checkpoint_before_suspend(job, ray_job, now, settings) if job.spec.suspend else None
        if suspend_wait:
            requeue = settings.suspend_poll_seconds
        else:
            suspend = (name, job.spec.suspend)
            events.append(Event("Normal", "Suspending" if job.spec.suspend else "Resuming",
                                f"setting spec.suspend={str(job.spec.suspend).lower()} on RayJob {name}"))
    scale_cluster = None
    scale_down = None
    if ray_job is not None and o.deployment_status(ray_job) == o.DEPLOYMENT_RUNNING and not job.spec.suspend:
        patch = rollout_scale(job, attempt, observed.ray_cluster, observed.pods)
        if patch is None and (scale_down := scale_down_wait(job, attempt, observed.ray_cluster, now, settings)):
            reason, message, left = scale_down
            if left is not None:  # look again when the bound is reached, not only at the next resync
                requeue = left if requeue is None else min(requeue, left)
            elif not any(c.type == ROLLOUT_SCALED and c.reason == reason
                         for c in (job.status.conditions if job.status else [])):
                events.append(Event("Warning", reason, message))
        if patch is not None:
            cluster_name = observed.ray_cluster["metadata"]["name"]
            scale_cluster = (cluster_name, patch)
            group_replicas = rollout_group(observed.ray_cluster)[1]
            freed = patch[-1]["value"]["workersToDelete"]
            events.append(Event("Normal", "Resizing",
                                f"rollout.replicas {group_replicas} -> {job.spec.rollout.replicas}: RayCluster "
                                f"{cluster_name}'s rollout group scaled"
                                + (f", deleting pods without a live engine: {', '.join(freed)}" if freed else "")))
    accepted = accepted_spec(job, observed) if ray_job is not None else None
    if accepted is not None and (accepted.get("rollout") or {}).get("replicas") != job.spec.rollout.replicas:
        # The spec in effect takes the new replicas, so that a restart runs with them.
        in_effect = plans.for_cluster(effective(), attempt)  # the status describes the plan written now
        objects = render(effective(), attempt=attempt, plan=in_effect)
        plan_apply += [obj for obj in objects if obj["kind"] == "ConfigMap"]
    if refused and "SpecChangeRefused" not in {c.type for c in (job.status.conditions if job.status else [])
                                              if c.status == "True"}:
        events.append(Event("Warning", "SpecChangeRefused",
                            ", ".join(f"spec.{f}" for f in refused) + " cannot change while the job exists"))

    cluster = observed.ray_cluster if ray_job is not None else None
    pods = observed.pods if ray_job is not None else []
    status = compute_status(job, in_effect or plans.for_cluster(effective(), attempt), ray_job, cluster, pods, now,
                            attempt=status_attempt, refused=refused,
                            restart_in=restart_in, suspend_wait=suspend_wait,
                            scale_down_wait=scale_down[:2] if scale_down else None,
                            queue=o.queue_state(queue, observed.workload) if queue and ray_job is not None else None)
    recovered, posted = recovery_events(job.status)
    events += recovered
    if posted:
        status["recoveryEvents"] = posted
    status = with_cost(status, job, observed, now, settings)
    plan = Plan(status=status, apply=plan_apply, suspend=suspend, delete_ray_jobs=delete, events=events,
                requeue_after=requeue, scale_cluster=scale_cluster, workload_active=workload_active)
    if status.get("phase") != old_phase:
        plan.events.append(Event("Warning" if status["phase"] == "Failed" else "Normal", status["phase"],
                                 status.get("message", "")))
    if status["phase"] in FINISHED_PHASES and job.spec.ttl_seconds_after_finished is not None:
        plan.requeue_after = float(job.spec.ttl_seconds_after_finished)
    return plan
