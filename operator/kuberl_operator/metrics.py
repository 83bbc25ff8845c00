"""The operator's Prometheus metrics, served on :8080/metrics by prometheus-client."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
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


class Metrics:
    def __init__(self, phases: Callable[[], Iterable[str | None]], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(JobsByPhase(phases))
        self.reconcile_duration = Histogram(
            "kuberl_operator_reconcile_duration_seconds", "Time to reconcile one RLTrainingJob",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry)
        self.reconcile_errors = Counter(
            "kuberl_operator_reconcile_errors", "Reconciles that failed, by reason (HTTP status or exception)",
            ["reason"], registry=self.registry)
        self.restarts = Counter(
            "kuberl_operator_restarts", "RayJobs recreated from a checkpoint after a failure", registry=self.registry)
