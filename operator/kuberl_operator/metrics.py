"""The operator's Prometheus metrics, served on :8080/metrics by prometheus-client."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PHASES = ("Pending", "Staging", "Starting", "Running", "Suspended", "Succeeded", "Failed")


class JobsByPhase(Collector):
    """``kuberl_operator_jobs{phase}`` counted at scrape time from the operator's job cache, so
    it is never out of step with what the operator sees (deleted jobs simply stop counting)."""

    def __init__(self, phases: Callable[[], Iterable[str | None]]) -> None:
        self.phases = phases

    def collect(self):
        counts = Tally(p or "Pending" for p in self.phases())
        family = GaugeMetricFamily("kuberl_operator_jobs", "RLTrainingJobs by status.phase", labels=["phase"])
        for phase in sorted(set(PHASES) | set(counts)):
            family.add_metric([phase], counts.get(phase, 0))
        yield family


class JobCosts(Collector):
    """Each job's status.cost at scrape time, from the operator's job cache (deleted jobs drop out):
    ``kuberl_job_gpu_seconds_total`` and ``kuberl_job_cpu_seconds_total`` by role, the estimated
    cost and tokens per GPU-hour where status has them, and the driver's status.progress.gpuBusy
    (``kuberl_job_gpu_busy_ratio`` by role). The job is named by ``job_namespace`` and
    ``job_name``: Prometheus sets ``job`` and ``namespace`` on every series of the operator's
    scrape target (its own), which would rename labels of those names."""

    def __init__(self, statuses: Callable[[], Iterable[tuple[str, str, dict]]]) -> None:
        self.statuses = statuses

    def collect(self):
        job = ["job_namespace", "job_name"]
        gpu = CounterMetricFamily("kuberl_job_gpu_seconds", "GPU-seconds of the job's pods (limits x lifetime)",
                                  labels=[*job, "role"])
        cpu = CounterMetricFamily("kuberl_job_cpu_seconds", "CPU-seconds of the job's pods (requests x lifetime)",
                                  labels=[*job, "role"])
        price = GaugeMetricFamily("kuberl_job_estimated_cost", "GPU-hours x the operator's --gpu-hour-price", labels=job)
        tokens = GaugeMetricFamily("kuberl_job_tokens_per_gpu_hour", "Tokens per GPU-hour at the job's last step",
                                   labels=job)
        busy = GaugeMetricFamily("kuberl_job_gpu_busy_ratio", "Share of the last step's wall time a role's GPUs "
                                 "were busy (status.progress.gpuBusy)", labels=[*job, "role"])
        for namespace, name, status in self.statuses():
            cost = status.get("cost") or {}
            for role, share in ((status.get("progress") or {}).get("gpuBusy") or {}).items():
                busy.add_metric([namespace, name, role], share)
            for role, total in (cost.get("roles") or {}).items():
                gpu.add_metric([namespace, name, role], total.get("gpuSeconds", 0))
                cpu.add_metric([namespace, name, role], total.get("cpuSeconds", 0))
            if cost.get("estimatedCost") is not None:
                price.add_metric([namespace, name], cost["estimatedCost"])
            if cost.get("tokensPerGpuHour") is not None:
                tokens.add_metric([namespace, name], cost["tokensPerGpuHour"])
        yield from (gpu, cpu, price, tokens, busy)


class Metrics:
    def __init__(self, phases: Callable[[], Iterable[str | None]], registry: CollectorRegistry | None = None,
                 statuses: Callable[[], Iterable[tuple[str, str, dict]]] = tuple) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(JobsByPhase(phases))
        self.registry.register(JobCosts(statuses))
        self.reconcile_duration = Histogram(
            "kuberl_operator_reconcile_duration_seconds", "Time to reconcile one RLTrainingJob",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry)
        self.reconcile_errors = Counter(
            "kuberl_operator_reconcile_errors", "Reconciles that failed, by reason (HTTP status or exception)",
            ["reason"], registry=self.registry)
        self.restarts = Counter(
            "kuberl_operator_restarts", "RayJobs recreated from a checkpoint after a failure", registry=self.registry)
