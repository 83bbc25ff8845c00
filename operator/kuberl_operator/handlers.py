"""kopf wiring: watches feed in-memory indices, every change of a job, or of what its reconcile
reads of something it owns, triggers one reconcile of that job, and the reconcile runs the pure
plan from ``reconcile``.

- kopf indices (label ``kuberl.dev/job``) hold the RayJobs, RayClusters, ConfigMaps and pods of
  every job; kopf fills them from their watch streams before any handler runs, so a restarted
  operator never mistakes "not listed yet" for "missing" and creates a duplicate.
- ``kopf.on.event`` handlers (RLTrainingJob creation, update, resumption after an operator restart
  and deletion all arrive as events; so do changes of owned objects) trigger a reconcile of the
  owning job through the work queue (``workqueue``: one reconcile per job at a time, coalesced
  triggers, the resync, a plan's ``requeue_after`` and our own status writes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kuberl.api import types as t
from kuberl.api.contract import JOB_LABEL
from kuberl_operator import observed as o
from kuberl_operator.cost import pod_usage
from kuberl_operator.invalid import checked_plan
from kuberl_operator.kube import Kube
from kuberl_operator.metrics import Metrics
from kuberl_operator.reconcile import Event, Plan, Settings, next_action
from kuberl_operator.status import indexed_pod_status, indexed_ray_job_status, status_changed
from kuberl_operator.workqueue import Key, WorkQueue

log = logging.getLogger("kuberl_operator")


def _plain(value: Any) -> Any:
    """A detached plain copy of a kopf body (kopf's bodies are live mapping views)."""
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _slim_meta(meta: Any) -> dict[str, Any]:
    return {k: _plain(meta[k]) for k in ("name", "labels", "annotations", "ownerReferences", "uid") if k in meta}


# What the indices keep of each owned object (index entries): only what the reconcile reads (not a
# RayJob's or pod's whole spec), so memory stays proportional to jobs, not to the size of their
# clusters, and a watch event that changes none of it triggers no reconcile (``entry_changed``).

def ray_job_entry(meta: Any, spec: Any, status: Any) -> dict[str, Any]:
    return {"metadata": _slim_meta(meta), "spec": {"suspend": spec.get("suspend", False)},
            "status": _plain(indexed_ray_job_status(status))}


def ray_cluster_entry(meta: Any, spec: Any, status: Any) -> dict[str, Any]:
    groups = [{"groupName": g.get("groupName"), "replicas": g.get("replicas")}
              for g in spec.get("workerGroupSpecs") or []]  # a live resize compares them
    return {"metadata": _slim_meta(meta), "spec": {"workerGroupSpecs": groups}, "status": {"state": status.get("state")}}


def pod_entry(meta: Any, spec: Any, status: Any) -> dict[str, Any]:
    # The pod's usage, not its spec: the accounting (kuberl_operator.cost) needs a few numbers.
    return {"metadata": _slim_meta(meta), "status": _plain(indexed_pod_status(status)),
            "usage": pod_usage(meta, spec, status)}


ENTRIES = {"rayjobs": ray_job_entry, "rayclusters": ray_cluster_entry, "pods": pod_entry}


def _owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


class Controller:
    """Reconciles jobs; shared by every handler through kopf's ``memo``."""

    def __init__(self, kube: Kube, settings: Settings, metrics: Metrics) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.indices: dict[str, Any] = {}
        self.queue = WorkQueue(self._reconcile_key, lambda: list(self.indices.get("jobs_by_key") or []),
                               settings.resync_seconds)

    # -- what the watches hold --------------------------------------------------------------

    def job_phases(self) -> list[str | None]:
        jobs = self.indices.get("jobs_by_key")
        if jobs is None:
            return []
        return [((body.get("status") or {}).get("phase")) for key in list(jobs) for body in jobs.get(key, [])]

    def job_statuses(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(namespace, name, status) of every job that has one (the cost metrics read them)."""
        jobs = self.indices.get("jobs_by_key")
        if jobs is None:
            return []
        return [(ns, name, status) for (ns, name) in list(jobs) for body in jobs.get((ns, name), [])
                if (status := body.get("status"))]

    def _one(self, index: str, key: Key) -> dict[str, Any] | None:
        store = self.indices[index].get(key, [])
        return next(iter(store), None)

    def observe(self, job: t.RLTrainingJob) -> o.Observed:
        key = (job.metadata.namespace, job.metadata.name)
        uid = job.metadata.uid
        ray_jobs = {rj["metadata"]["name"]: rj for rj in self.indices["ray_jobs_by_job"].get(key, [])
                    if _owned_by(rj, uid)}
        config_map = next((cm for cm in self.indices["config_maps_by_job"].get(key, []) if _owned_by(cm, uid)), None)
        clusters = {rc["metadata"]["name"]: rc for rc in self.indices["ray_clusters_by_job"].get(key, [])}
        pods = list(self.indices["pods_by_job"].get(key, []))
        usages = [p["usage"] for p in pods]
        # The current attempt's cluster and pods only: earlier attempts' pods may still be terminating.
        current = max(ray_jobs.values(), key=o.attempt_of, default=None)
        cluster_name = ((current or {}).get("status") or {}).get("rayClusterName")
        cluster = clusters.get(cluster_name) if cluster_name else None
        pods = [p for p in pods if cluster_name and p["metadata"].get("labels", {}).get("ray.io/cluster") == cluster_name]
        workload = None
        if current is not None and job.spec.scheduling.queue_name:
            owner = (job.metadata.namespace, current["metadata"]["name"])
            # By the RayJob's uid too: a lingering Workload of a deleted RayJob of the same name (the job
            # deleted and made again) is not this one's.
            workload = next((w for w in self.indices["workloads_by_ray_job"].get(owner, [])
                             if w["owner_uid"] == current["metadata"].get("uid")), None)
        return o.Observed(ray_jobs=ray_jobs, config_map=config_map, ray_cluster=cluster, pods=pods, usages=usages,
                          workload=workload)

    async def _reconcile_key(self, key: Key) -> float | None:
        """``WorkQueue``'s reconcile: the job's newest copy, reconciled in a worker thread."""
        body = self._one("jobs_by_key", key)
        if body is None:
            self.queue.forget(key)
            return None
        return await asyncio.to_thread(self.reconcile, self.queue.state.latest(key, body))

    # -- one reconcile (runs in a worker thread: the kubernetes client blocks) -----------------

    def reconcile(self, body: dict[str, Any]) -> float | None:
        began = time.perf_counter()
        meta = body.get("metadata", {})
        try:
            job = t.RLTrainingJob.model_validate({k: v for k, v in body.items() if k in ("apiVersion", "kind", "metadata", "spec", "status")})
        except ValidationError as err:
            # The API server validated the spec; this is a status written by something else.
            self.metrics.reconcile_errors.labels("InvalidObject").inc()
            kopf.event(body, type="Warning", reason="InvalidObject", message=f"cannot read the job: {err}")
            return self.settings.resync_seconds
        try:
            plan = checked_plan(job, lambda: self.observe(job), datetime.now(timezone.utc), self.settings)
            self.execute(job, body, plan)
            return plan.requeue_after
        except ApiException as err:
            self.metrics.reconcile_errors.labels(str(err.status)).inc()
            log.warning("reconcile %s/%s: HTTP %s %s", meta.get("namespace"), meta.get("name"), err.status,
                        (err.body or err.reason or "")[:500])
            return min(self.settings.restart_backoff_seconds, 5.0)
        except Exception as err:  # a bug must not stop the other jobs; it is counted and retried
            self.metrics.reconcile_errors.labels(type(err).__name__).inc()
            log.exception("reconcile %s/%s failed", meta.get("namespace"), meta.get("name"))
            return self.settings.resync_seconds
        finally:
            self.metrics.reconcile_duration.observe(time.perf_counter() - began)

    def execute(self, job: t.RLTrainingJob, body: dict[str, Any], plan: Plan) -> None:
        ns, name = job.metadata.namespace, job.metadata.name
        if plan.delete_job:
            self.kube.delete(t.KIND, ns, name)
            self._post(body, plan.events)
            return
        # Status first: a restart is recorded (restarts += 1) before its RayJob exists, so a crash in
        # between resumes the same attempt instead of starting another.
        if status_changed(body.get("status"), plan.status):
            written = self.kube.merge_patch(t.KIND, ns, name, {"status": plan.status}, subresource="status")
            written["metadata"].pop("managedFields", None)
            self.queue.state.record_write((ns, name), written)
        events = plan.events
        for obj in plan.apply:
            if obj["kind"] != "RayJob":
                self.kube.apply(obj)
            elif not self.kube.create(obj):
                # Already there (the watch had not shown it yet): adopted, not created again.
                events = [e for e in events if e.reason != "Creating"]
        if plan.scale_cluster is not None:
            self.kube.json_patch("RayCluster", ns, *plan.scale_cluster)
        if plan.suspend is not None:
            ray_job, suspend = plan.suspend
            self.kube.merge_patch("RayJob", ns, ray_job, {"spec": {"suspend": suspend}})
        if plan.workload_active is not None:
            workload, active = plan.workload_active
            self.kube.merge_patch("Workload", ns, workload, {"spec": {"active": active}})
        for ray_job in plan.delete_ray_jobs:
            self.kube.delete("RayJob", ns, ray_job)
        if any(e.reason == "Restarting" for e in events):
            self.metrics.restarts.inc()
        self._post(body, events)

    @staticmethod
    def _post(body: dict[str, Any], events: list[Event]) -> None:
        for event in events:
            # The API server counts an event message's limit (1024) in bytes.
            message = event.message.encode()[:1024].decode(errors="ignore")
            kopf.event(body, type=event.type, reason=event.reason, message=message)


class NoDiffBase(kopf.DiffBaseStorage):
    """kuberl reacts to events only (no on.create/on.update handlers), so kopf's change detection
    is never used; its default diff base deep-copies every object on every watch event, which was
    the operator's largest CPU cost (bench/operator_scale.py). Nothing is stored on objects."""

    def build(self, *, body, extra_fields=None):
        return {}

    def fetch(self, *, body):
        return None

    def store(self, *, body, patch, essence):
        return None


def register(registry: kopf.OperatorRegistry) -> None:
    """Add kuberl's handlers to ``registry``; they find the Controller in ``memo.controller``."""
    owned = {"labels": {JOB_LABEL: kopf.PRESENT}, "registry": registry}

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        # A registry of our own gets none of kopf's default login handlers: in a pod the
        # ServiceAccount token, elsewhere $KUBECONFIG.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    # Every handler here is ``async`` though none awaits: kopf runs a sync handler in its thread
    # pool, one thread hop (submit, wake-up, GIL hand-over, call_soon_threadsafe) per watch event
    # and handler; that hop cost more CPU than the handlers' own work (bench/operator_scale.py).
    @kopf.index(t.GROUP, t.VERSION, t.PLURAL, id="jobs_by_key", registry=registry)
    async def jobs_by_key(namespace, name, body, **_):
        job = _plain(body)
        job["metadata"].pop("managedFields", None)
        return {(namespace, name): job}

    @kopf.index("ray.io", "v1", "rayjobs", id="ray_jobs_by_job", **owned)
    async def ray_jobs_by_job(namespace, labels, meta, spec, status, **_):
        return {(namespace, labels[JOB_LABEL]): ray_job_entry(meta, spec, status)}

    @kopf.index("ray.io", "v1", "rayclusters", id="ray_clusters_by_job", **owned)
    async def ray_clusters_by_job(namespace, labels, meta, spec, status, **_):
        return {(namespace, labels[JOB_LABEL]): ray_cluster_entry(meta, spec, status)}

    # Kueue's Workloads carry none of the job's labels: they are found by their owner, the RayJob.
    # Without Kueue's CRD kopf has nothing to watch, and the index stays empty.
    @kopf.index("kueue.x-k8s.io", "v1beta2", "workloads", id="workloads_by_ray_job", registry=registry)
    async def workloads_by_ray_job(namespace, meta, spec, status, **_):
        owners = [ref for ref in meta.get("ownerReferences") or []
                  if ref.get("kind") == "RayJob" and ref.get("apiVersion", "").startswith("ray.io/") and ref.get("controller")]
        return {(namespace, ref["name"]): {"metadata": {"name": meta["name"]}, "owner_uid": ref.get("uid"),
                                           "spec": {"active": spec.get("active", True)},
                                           "status": {"conditions": _plain(status.get("conditions") or [])}}
                for ref in owners}

    @kopf.index("v1", "configmaps", id="config_maps_by_job", **owned)
    async def config_maps_by_job(namespace, labels, meta, body, **_):
        return {(namespace, labels[JOB_LABEL]): {"metadata": _slim_meta(meta), "data": _plain(body.get("data", {}))}}

    @kopf.index("v1", "pods", id="pods_by_job", **owned)
    async def pods_by_job(namespace, labels, meta, spec, status, **_):
        return {(namespace, labels[JOB_LABEL]): pod_entry(meta, spec, status)}

    def _capture(memo, kwargs) -> Controller:
        controller: Controller = memo.controller
        if not controller.indices:
            # kopf hands its live indices to handlers only; the resync loop and the requeue timers
            # keep the same objects.
            controller.indices = {k: kwargs[k] for k in ("jobs_by_key", "ray_jobs_by_job", "ray_clusters_by_job",
                                                         "config_maps_by_job", "pods_by_job",
                                                         "workloads_by_ray_job")}
        controller.queue.adopt_context()
        return controller

    @kopf.on.event(t.GROUP, t.VERSION, t.PLURAL, id="job_changed", registry=registry)
    async def job_changed(namespace, name, type, body, memo, **kwargs):
        controller = _capture(memo, kwargs)
        if type == "DELETED":
            controller.queue.forget((namespace, name))
            return
        if controller.queue.state.is_echo((namespace, name), body):
            return
        await controller.queue.trigger((namespace, name))

    @kopf.on.event("kueue.x-k8s.io", "v1beta2", "workloads", id="workloads_changed", registry=registry)
    async def workload_changed(namespace, meta, memo, **kwargs):
        # Admitted, or why not: the job owning the Workload's RayJob reconciles (its condition).
        controller = _capture(memo, kwargs)
        owners = {ref["name"] for ref in meta.get("ownerReferences") or [] if ref.get("kind") == "RayJob"}
        for (ns, job), ray_jobs in list(controller.indices["ray_jobs_by_job"].items()):
            if ns == namespace and any(rj["metadata"]["name"] in owners for rj in ray_jobs):
                await controller.queue.trigger((ns, job))

    for group_version_plural in (("ray.io", "v1", "rayjobs"), ("ray.io", "v1", "rayclusters"), ("v1", "pods")):
        @kopf.on.event(*group_version_plural, id=f"{group_version_plural[-1]}_changed", **owned)
        async def owned_changed(type, namespace, labels, meta, spec, status, uid, resource, memo, **kwargs):
            controller = _capture(memo, kwargs)
            entry = ENTRIES[resource.plural](meta, spec, status)
            key = (namespace, labels[JOB_LABEL])
            if controller.queue.state.entry_changed(key, (resource.plural, uid), entry, gone=type == "DELETED"):
                await controller.queue.trigger(key)
