"""Worker-side Prometheus metrics: what a training job exports on ``KUBERL_METRICS_PORT`` (9400).

Every series carries the labels ``job``, ``namespace``, ``role`` and ``rank`` (from the pod's
``KUBERL_JOB_NAME``/``KUBERL_NAMESPACE``/``KUBERL_ROLE`` env and the process rank), so the
PodMonitor scrapes them with ``honorLabels: true`` and the dashboards select on them. Units are
in the names (``_seconds``, ``_bytes``, ``_total``, ``_ratio``); docs/metrics.md lists them all.

The driver calls ``start_exporter()`` once and ``record_step(metrics)`` with its per-step dict;
rollout, checkpoint and staging code call ``record_rollout``/``record_checkpoint``/
``record_stage``. Those calls do nothing in a process that started no exporter (a local run), so
callers need not check. ``prometheus_client`` is imported only when an exporter is started, which
keeps ``import kuberl.common.metrics`` free for code paths that never export.
"""

from __future__ import annotations

import errno
import math
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from kuberl.api.contract import JOB_NAME_ENV, METRICS_PORT_ENV, NAMESPACE_ENV, ROLE_ENV

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

LABELS = ("job", "namespace", "role", "rank")

# Weight syncs take from milliseconds (tiny model, shared memory) to minutes (70B over the network).
SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The driver's per-step phases (its ``<phase>_seconds`` metrics), as the ``phase`` label of
# kuberl_train_phase_duration_seconds: where a step's time goes. Weight sync has its own family.
# checkpoint_wait is part of update: its wait for the last checkpoint to finish reading the state.
STEP_PHASES = ("generate", "reward", "logprobs", "update", "sleep", "wake", "checkpoint_stall", "checkpoint_wait")
STEP_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A recovery: seconds locally (a new trainer group on the same Ray), minutes when a pod is replaced.
RECOVERY_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200)

# kuberl_recoveries_total's kind -> the step's (count, seconds) keys: a rollout engine lost (the step
# completed on the engines left), its replacement joined (seconds since the loss), a new trainer
# group (the first step after it), a live resize of spec.rollout.replicas (seconds to its new size).
RECOVERY_METRICS = {
    "engine": ("engines_lost", None),
    "engine_replaced": ("engine_replacements", "engine_replacement_seconds"),
    "trainer": ("trainer_recoveries", "trainer_recovery_seconds"),
    "resize": ("rollout_resizes", "rollout_resize_seconds"),
}

# record_step keys -> gauge attribute; the values are the latest step's.
STEP_GAUGES = {
    "step": "step",
    "reward_mean": "reward_mean",
    "kl": "kl",
    "loss": "loss",
    "pg_loss": "pg_loss",
    "grad_norm": "grad_norm",
    "tokens_per_second": "tokens_per_second",
    "mfu": "mfu",
    "clip_frac": "clip_ratio",
}


@dataclass(frozen=True)
class Identity:
    """The label values every series of this process carries."""

    job: str
    namespace: str
    role: str
    rank: str

    @classmethod
    def from_env(cls, job: str | None = None, namespace: str | None = None, role: str | None = None,
                 rank: int | str | None = None) -> "Identity":
        env = os.environ
        return cls(job=job or env.get(JOB_NAME_ENV, ""),
                   namespace=namespace or env.get(NAMESPACE_ENV, ""),
                   role=role or env.get(ROLE_ENV, ""),
                   rank=str(rank if rank is not None else env.get("RANK", "0")))


class WorkerMetrics:
    """The metric families of one worker process; its series carry the process's ``Identity``.

    A series appears with the first record of its kind, never before: a rollout process exports
    no ``kuberl_train_*`` zeros that would drag a dashboard's average down, and a driver that
    computes no MFU exports no MFU. From its first step on, the step counters exist (at 0), so a
    dashboard shows "0 skipped steps", not "No data".
    """

    def __init__(self, identity: Identity, registry: "CollectorRegistry") -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.identity = identity
        self.values = tuple(getattr(identity, name) for name in LABELS)
        labels = list(LABELS)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str):
            # prometheus-client appends the _total suffix itself.
            return Counter(name.removesuffix("_total"), doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.step = gauge("kuberl_train_step", "Last completed training step")
        self.reward_mean = gauge("kuberl_train_reward_mean", "Mean reward of the last step's rollouts")
        self.kl = gauge("kuberl_train_kl", "KL divergence to the reference policy, last step")
        self.loss = gauge("kuberl_train_loss", "Total loss, last step")
        self.pg_loss = gauge("kuberl_train_pg_loss", "Policy-gradient part of the loss, last step")
        self.grad_norm = gauge("kuberl_train_grad_norm", "Gradient norm before clipping, last step")
        self.tokens_per_second = gauge("kuberl_train_tokens_per_second",
                                       "Prompt+response tokens trained per second, last step")
        self.mfu = gauge("kuberl_train_mfu_ratio", "Model FLOPs utilisation (0-1), last step")
        self.clip_ratio = gauge("kuberl_train_clip_ratio", "Share of trained tokens the PPO clip bound, last step")
        self.validation_reward = gauge("kuberl_train_validation_reward", "Mean reward on the validation set, last validation")
        self.validation_pass = gauge("kuberl_train_validation_pass_ratio",
                                     "pass@n on the validation set (n = validation.n), last validation")
        self.steps = counter("kuberl_train_steps_total", "Training steps completed")
        self.skipped_steps = counter("kuberl_train_skipped_steps_total",
                                     "Steps whose optimizer update was skipped (non-finite gradients)")
        self.step_duration = histogram("kuberl_train_step_duration_seconds", "Wall time of one training step",
                                       STEP_BUCKETS)
        self.phase_duration = Histogram("kuberl_train_phase_duration_seconds",
                                        "Wall time of one phase of a training step (label phase)",
                                        [*labels, "phase"], buckets=STEP_BUCKETS, registry=registry)
        self.rollout_tokens = counter("kuberl_rollout_tokens_total", "Tokens generated by rollout engines")
        self.rollout_seconds = counter("kuberl_rollout_seconds_total", "Seconds spent generating rollouts")
        self.sync_duration = histogram("kuberl_sync_duration_seconds",
                                       "Time to push trainer weights to the rollout engines", SYNC_BUCKETS)
        self.sync_bytes = counter("kuberl_sync_bytes_total", "Weight bytes pushed to the rollout engines")
        self.checkpoint_last_duration = gauge("kuberl_checkpoint_last_duration_seconds",
                                              "Time the last checkpoint save took")
        self.checkpoint_last_bytes = gauge("kuberl_checkpoint_last_bytes", "Size of the last checkpoint")
        self.checkpoint_bytes = counter("kuberl_checkpoint_bytes_total", "Checkpoint bytes written")
        self.checkpoints = counter("kuberl_checkpoint_saves_total", "Checkpoints saved")
        self.stage_bytes = counter("kuberl_stage_bytes_total", "Bytes staged (downloaded) into the pod")
        self.stage_seconds = counter("kuberl_stage_seconds_total", "Seconds spent staging")
        self.recoveries = Counter("kuberl_recoveries", "Failures the job recovered from without a restart (label kind)",
                                  [*labels, "kind"], registry=registry)
        self.recovery_duration = Histogram("kuberl_recovery_duration_seconds",
                                           "Time from a failure to training again (label kind)",
                                           [*labels, "kind"], buckets=RECOVERY_BUCKETS, registry=registry)

    def _mine(self, family):
        """This process's series of ``family`` (created at 0 on first use)."""
        return family.labels(*self.values)

    def record_step(self, metrics: Mapping[str, Any]) -> None:
        """Export one step's dict from the driver. Keys it does not know are ignored (the driver's
        dict carries more than we export); absent or non-finite values (a skipped step's NaN grad
        norm) leave their gauge at the last value."""
        for key, attr in STEP_GAUGES.items():
            value = metrics.get(key)
            if value is not None and math.isfinite(float(value)):
                self._mine(getattr(self, attr)).set(float(value))
        self._mine(self.steps).inc()
        self._mine(self.skipped_steps).inc(int(metrics.get("skipped") or 0))
        if metrics.get("step_seconds") is not None:
            self._mine(self.step_duration).observe(float(metrics["step_seconds"]))
        for phase in STEP_PHASES:
            if metrics.get(f"{phase}_seconds") is not None:
                self.phase_duration.labels(*self.values, phase).observe(float(metrics[f"{phase}_seconds"]))
        for kind, (count, seconds) in RECOVERY_METRICS.items():
            if metrics.get(count):
                self.recoveries.labels(*self.values, kind).inc(float(metrics[count]))
                if seconds is not None and metrics.get(seconds) is not None:
                    self.recovery_duration.labels(*self.values, kind).observe(float(metrics[seconds]))
        if metrics.get("weight_sync_seconds") is not None:
            self._mine(self.sync_duration).observe(float(metrics["weight_sync_seconds"]))
            self._mine(self.sync_bytes).inc(float(metrics.get("weight_sync_bytes") or 0))

    def record_validation(self, metrics: Mapping[str, Any]) -> None:
        """``val/reward`` and, when validation samples n > 1, ``val/pass@<n>``."""
        self._mine(self.validation_reward).set(float(metrics["val/reward"]))
        for key, value in metrics.items():
            if key.startswith("val/pass@"):
                self._mine(self.validation_pass).set(float(value))

    def record_rollout(self, tokens: int, seconds: float) -> None:
        self._mine(self.rollout_tokens).inc(tokens)
        self._mine(self.rollout_seconds).inc(seconds)

    def record_checkpoint(self, seconds: float, nbytes: int) -> None:
        self._mine(self.checkpoint_last_duration).set(seconds)
        self._mine(self.checkpoint_last_bytes).set(nbytes)
        self._mine(self.checkpoint_bytes).inc(nbytes)
        self._mine(self.checkpoints).inc()

    def record_stage(self, nbytes: int, seconds: float) -> None:
        self._mine(self.stage_bytes).inc(nbytes)
        self._mine(self.stage_seconds).inc(seconds)


_lock = threading.Lock()
_exporter: WorkerMetrics | None = None


def start_exporter(port: int | None = None, *, addr: str = "0.0.0.0", job: str | None = None,
                   namespace: str | None = None, role: str | None = None, rank: int | str | None = None,
                   registry: "CollectorRegistry | None" = None) -> WorkerMetrics:
    """Serve /metrics on ``port`` (default ``KUBERL_METRICS_PORT``) and make this process's
    ``record_*`` calls export. Idempotent: a second call returns the running exporter.

    The default registry is the process-wide one, so metrics other modules register there
    (``kuberl_numa_*``) are served too.
    """
    global _exporter
    with _lock:
        if _exporter is not None:
            return _exporter
        from prometheus_client import REGISTRY, start_http_server

        if port is None:
            raw = os.environ.get(METRICS_PORT_ENV)
            if not raw:
                raise ValueError("kuberl.common.metrics.start_exporter: no port given and KUBERL_METRICS_PORT is unset")
            try:
                port = int(raw)
            except ValueError:
                raise ValueError(f"KUBERL_METRICS_PORT={raw!r} is not a port number") from None
        registry = registry or REGISTRY
        # Bind first: a port taken by another process of the pod must leave the registry unchanged.
        start_http_server(port, addr=addr, registry=registry)
        metrics = WorkerMetrics(Identity.from_env(job, namespace, role, rank), registry)
        _exporter = metrics
        return metrics


def start_pod_exporter(role: str, rank: int | str = 0) -> WorkerMetrics | None:
    """In a kuberl pod (``KUBERL_METRICS_PORT`` set by the renderer): serve this process's metrics
    on the pod's port. The first process of a pod to ask gets the port; later ones (other ranks
    and engines of the same pod) get None and keep recording nowhere. Outside a pod: None."""
    if not os.environ.get(METRICS_PORT_ENV):
        return None
    try:
        return start_exporter(role=role, rank=rank)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return None
        raise


def record_step(metrics: Mapping[str, Any]) -> None:
    if _exporter is not None:
        _exporter.record_step(metrics)


def record_validation(metrics: Mapping[str, Any]) -> None:
    if _exporter is not None:
        _exporter.record_validation(metrics)


def record_rollout(tokens: int, seconds: float) -> None:
    if _exporter is not None:
        _exporter.record_rollout(tokens, seconds)


def record_checkpoint(seconds: float, nbytes: int) -> None:
    if _exporter is not None:
        _exporter.record_checkpoint(seconds, nbytes)


def record_stage(nbytes: int, seconds: float) -> None:
    if _exporter is not None:
        _exporter.record_stage(nbytes, seconds)
