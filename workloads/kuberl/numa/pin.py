"""``pin_current_process``: the one call trainer and engine processes make at start-up when
``spec.numa.policy`` is "gpu-local". It discovers, plans, applies, and reports the decision in a
log line and in the Prometheus gauges ``kuberl_numa_node`` and ``kuberl_numa_cpus``
(labels role, rank; prometheus-client is optional).

Call it before starting threads and before the first CUDA allocation: the CPU affinity is set
on every existing thread, but the memory policy only on the calling thread and the threads it
starts afterwards.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from kuberl.numa.apply import prefer_memory_node, set_cpu_affinity
from kuberl.numa.cpulist import format_cpulist
from kuberl.numa.plan import Placement, plan
from kuberl.numa.topology import NumaError, discover

log = logging.getLogger("kuberl.numa")

POLICIES = ("gpu-local", "none")


@dataclass(frozen=True)
class PinDecision:
    role: str
    local_rank: int
    placement: Placement
    memory_policy: str  # "preferred node N", or "unchanged: <why>"
    source: str  # where the GPU list came from: nvml, torch or sysfs

    @property
    def pinned(self) -> bool:
        return self.placement.pinned

    def describe(self) -> str:
        p = self.placement
        if not p.pinned:
            gpu = f" gpu={p.gpu_bdf}" if p.gpu_bdf else ""
            return f"numa: role={self.role} rank={self.local_rank}{gpu} not pinned: {p.reason}"
        return (
            f"numa: role={self.role} rank={self.local_rank} gpu={p.gpu_bdf} node={p.node} "
            f"cpus={format_cpulist(p.cpus)} ({len(p.cpus)} CPUs) memory={self.memory_policy} source={self.source}"
        )


def pin_current_process(
    local_rank: int,
    policy: str,
    *,
    role: str = "trainer",
    root: str | os.PathLike[str] = "/",
    environ: Mapping[str, str] | None = None,
    registry: object | None = None,
) -> PinDecision:
    """Pin this process to the CPUs and memory of its GPU's NUMA node and return the decision.

    The process drives CUDA device ``local_rank``, or device 0 when it sees exactly one GPU
    (a Ray actor with its own CUDA_VISIBLE_DEVICES). ``registry``: a prometheus_client
    CollectorRegistry (default: the global one).
    """
    if policy not in POLICIES:
        raise NumaError(f"spec.numa.policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "none":
        decision = PinDecision(role, local_rank, _unpinned(local_rank, "spec.numa.policy is 'none'"), "unchanged", "-")
    else:
        decision = _pin(local_rank, role, root, environ)
    log.info(decision.describe())
    report_metrics(decision, registry)
    return decision


def _unpinned(local_rank: int, reason: str) -> Placement:
    return Placement(local_rank, None, None, frozenset(), None, reason)


def _pin(local_rank: int, role: str, root: str | os.PathLike[str], environ: Mapping[str, str] | None) -> PinDecision:
    topology = discover(root, environ)
    numa_plan = plan(topology)
    if not topology.visible:
        return PinDecision(role, local_rank, _unpinned(local_rank, numa_plan.noop_reason or "no GPU"), "unchanged", topology.source)
    device = 0 if len(topology.visible) == 1 else local_rank
    if not 0 <= device < len(topology.visible):
        env = os.environ if environ is None else environ
        raise NumaError(
            f"local_rank {local_rank} has no GPU: this process sees {len(topology.visible)} GPUs "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); local ranks must be 0..{len(topology.visible) - 1}"
        )
    placement = numa_plan.placements[device]
    memory_policy = "unchanged"
    if placement.pinned:
        set_cpu_affinity(placement.cpus)
        if placement.memory_node is not None:
            memory_policy = prefer_memory_node(placement.memory_node)[1]
        else:
            memory_policy = f"unchanged: node {placement.node} has no memory"
    return PinDecision(role, local_rank, placement, memory_policy, topology.source)


# Per registry, weakly: a registry id() can be reused once the registry is gone.
_gauges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def report_metrics(decision: PinDecision, registry: object | None = None) -> bool:
    """Set kuberl_numa_node (-1 when not pinned) and kuberl_numa_cpus (0 when not pinned);
    False when prometheus-client is not installed."""
    try:
        from prometheus_client import REGISTRY, Gauge
    except ImportError:
        return False
    registry = REGISTRY if registry is None else registry
    if registry not in _gauges:
        _gauges[registry] = (
            Gauge("kuberl_numa_node", "NUMA node this process is pinned to (-1: not pinned)", ["role", "rank"], registry=registry),
            Gauge("kuberl_numa_cpus", "CPUs this process is pinned to (0: not pinned)", ["role", "rank"], registry=registry),
        )
    node_gauge, cpus_gauge = _gauges[registry]
    labels = {"role": decision.role, "rank": str(decision.local_rank)}
    p = decision.placement
    node_gauge.labels(**labels).set(p.node if p.pinned and p.node is not None else -1)
    cpus_gauge.labels(**labels).set(len(p.cpus))
    return True
