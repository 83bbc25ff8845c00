"""NUMA pinning of GPU processes from the machine's real topology (see docs/numa.md).

discover() reads the topology (sysfs, cgroup cpuset, NVML or torch), plan() splits each node's
CPUs among its GPUs (pure), pin_current_process() applies and reports the decision. Imports
need neither torch, Ray nor prometheus-client.
"""

from kuberl.numa.apply import prefer_memory_node, reset_memory_policy, set_cpu_affinity
from kuberl.numa.cpulist import CpuListError, format_cpulist, parse_cpulist
from kuberl.numa.pin import POLICIES, PinDecision, pin_current_process
from kuberl.numa.plan import NumaPlan, Placement, plan, split_cores
from kuberl.numa.topology import Gpu, NumaError, Topology, discover, resolve_visible

__all__ = [
    "POLICIES",
    "CpuListError",
    "Gpu",
    "NumaError",
    "NumaPlan",
    "PinDecision",
    "Placement",
    "Topology",
    "discover",
    "format_cpulist",
    "parse_cpulist",
    "pin_current_process",
    "plan",
    "prefer_memory_node",
    "reset_memory_policy",
    "resolve_visible",
    "set_cpu_affinity",
    "split_cores",
]
