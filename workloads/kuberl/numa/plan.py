"""The pinning plan: a pure function from a discovered Topology to one Placement per CUDA
device of this process (local rank i drives CUDA device i).

Splitting rule (deterministic, identical in every process of the machine):
- The GPUs that share a node's CPUs are the GPUs the GPU source lists on that node (NVML: the
  container's GPUs; sysfs: every NVIDIA GPU), ordered by PCI address; CUDA_VISIBLE_DEVICES
  does not change a GPU's share, so processes that each see one GPU (Ray actors) agree
  without talking to each other.
- The node's CPUs that this process may use (affinity and cgroup cpuset) are grouped into
  physical cores (hyperthread siblings stay together), cores ordered by their lowest CPU.
- With C cores and G GPUs on the node, GPU k (in PCI order) takes the k-th contiguous block of
  cores; every block has C // G cores and the first C % G blocks one core more. With fewer
  cores than GPUs, GPU k shares core k % C.
- Memory is preferred on the GPU's node when that node has memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kuberl.numa.cpulist import format_cpulist
from kuberl.numa.topology import Topology


@dataclass(frozen=True)
class Placement:
    """Where one local rank should run. Empty ``cpus`` means: leave the affinity alone."""

    local_rank: int
    gpu_bdf: str | None
    node: int | None
    cpus: frozenset[int]
    memory_node: int | None
    reason: str

    @property
    def pinned(self) -> bool:
        return bool(self.cpus)


@dataclass(frozen=True)
class NumaPlan:
    placements: tuple[Placement, ...]  # index = local rank = CUDA device index
    noop_reason: str | None  # set when nothing is pinned, with the one reason why

    def for_rank(self, local_rank: int) -> Placement:
        if local_rank < len(self.placements):
            return self.placements[local_rank]
        return Placement(local_rank, None, None, frozenset(), None, self.noop_reason or "no GPU for this rank")


def split_cores(cpus: frozenset[int], core_of: Mapping[int, int], parts: int) -> list[frozenset[int]]:
    """Split ``cpus`` into ``parts`` contiguous blocks of whole cores (rule in the module doc)."""
    cores: dict[int, set[int]] = {}
    for cpu in cpus:
        cores.setdefault(core_of.get(cpu, cpu), set()).add(cpu)
    ordered = sorted((frozenset(group) for group in cores.values()), key=min)
    if not ordered:
        return [frozenset() for _ in range(parts)]
    if len(ordered) < parts:
        return [ordered[k % len(ordered)] for k in range(parts)]
    size, extra = divmod(len(ordered), parts)
    blocks, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        blocks.append(frozenset().union(*ordered[start:end]))
        start = end
    return blocks


def plan(topology: Topology) -> NumaPlan:
    """Compute the placement of every CUDA device of this process; pure (no I/O)."""
    if not topology.visible:
        return NumaPlan((), "no GPU is visible to this process")
    cpu_nodes = sorted(node for node, cpus in topology.node_cpus.items() if cpus)
    if len(cpu_nodes) < 2:
        return NumaPlan(
            tuple(
                Placement(rank, topology.gpus[i].bdf, topology.gpus[i].numa_node, frozenset(), None, "single NUMA node")
                for rank, i in enumerate(topology.visible)
            ),
            f"the machine has {len(cpu_nodes)} NUMA node(s) with CPUs: nothing to pin",
        )

    share: dict[int, frozenset[int]] = {}  # gpu index -> its CPUs
    for node in cpu_nodes:
        on_node = sorted((i for i, gpu in enumerate(topology.gpus) if gpu.numa_node == node), key=lambda i: topology.gpus[i].bdf)
        if not on_node:
            continue
        usable = topology.node_cpus[node] & topology.allowed_cpus
        for i, block in zip(on_node, split_cores(usable, topology.core_of, len(on_node))):
            share[i] = block

    placements = []
    for rank, i in enumerate(topology.visible):
        gpu = topology.gpus[i]
        if gpu.numa_node < 0:
            reason = f"firmware reports no NUMA node for GPU {gpu.bdf} (numa_node = -1)"
        elif gpu.numa_node not in topology.node_cpus:
            reason = f"GPU {gpu.bdf} reports node {gpu.numa_node}, which sys/devices/system/node does not list"
        elif not share.get(i):
            reason = (
                f"this process may use no CPU of node {gpu.numa_node} "
                f"(allowed: {format_cpulist(topology.allowed_cpus) or 'none'}); not pinning outside the container's CPUs"
            )
        else:
            memory_node = gpu.numa_node if gpu.numa_node in topology.memory_nodes else None
            placements.append(Placement(rank, gpu.bdf, gpu.numa_node, share[i], memory_node, "gpu-local"))
            continue
        placements.append(Placement(rank, gpu.bdf, gpu.numa_node if gpu.numa_node >= 0 else None, frozenset(), None, reason))

    noop = None
    if not any(p.pinned for p in placements):
        reasons = sorted({p.reason for p in placements})
        noop = reasons[0] if len(reasons) == 1 else "; ".join(reasons)
    return NumaPlan(tuple(placements), noop)
