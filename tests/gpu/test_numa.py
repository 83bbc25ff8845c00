"""kuberl.numa on a real GPU machine: discovery agrees with CUDA and sysfs, and pinning does
what the machine's layout calls for (a no-op on one NUMA node, the GPU's node otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kuberl.numa import discover, format_cpulist, plan

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


def test_discovery_agrees_with_cuda_and_sysfs():
    topology = discover()
    assert len(topology.visible) == torch.cuda.device_count()
    for device, index in enumerate(topology.visible):
        gpu = topology.gpus[index]
        props = torch.cuda.get_device_properties(device)
        if hasattr(props, "pci_bus_id"):
            assert int(gpu.bdf.split(":")[1], 16) == props.pci_bus_id
        numa_file = Path("/sys/bus/pci/devices") / gpu.bdf / "numa_node"
        expected = int(numa_file.read_text()) if numa_file.exists() else -1
        assert gpu.numa_node == expected
        print(f"layout: cuda:{device} {gpu.bdf} node={gpu.numa_node} source={topology.source} "
              f"nodes={ {n: format_cpulist(c) for n, c in sorted(topology.node_cpus.items())} } "
              f"allowed={format_cpulist(topology.allowed_cpus)}")


def test_pinning_follows_the_layout():
    topology = discover()
    numa_plan = plan(topology)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'workloads'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = textwrap.dedent(
        """
        import json, os
        from kuberl.numa import pin_current_process
        before = sorted(os.sched_getaffinity(0))
        d = pin_current_process(0, "gpu-local", role="trainer")
        print(json.dumps({"before": before, "after": sorted(os.sched_getaffinity(0)), "line": d.describe(),
                          "pinned": d.pinned, "cpus": sorted(d.placement.cpus)}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result["line"])
    cpu_nodes = [n for n, cpus in topology.node_cpus.items() if cpus]
    gpu = topology.gpus[topology.visible[0]]
    if len(cpu_nodes) < 2 or gpu.numa_node < 0:
        assert numa_plan.noop_reason is not None
        assert not result["pinned"]
        assert result["after"] == result["before"]
    else:
        node_cpus = topology.node_cpus[gpu.numa_node] & topology.allowed_cpus
        assert result["pinned"]
        assert set(result["cpus"]) <= node_cpus
        assert result["after"] == result["cpus"]


def test_nvml_and_torch_list_the_same_pci_addresses():
    from kuberl.numa.topology import gpus_from_nvml, gpus_from_torch

    nvml, cuda = gpus_from_nvml(), gpus_from_torch()
    if nvml is None or cuda is None:
        pytest.skip(f"needs both NVML ({nvml is not None}) and torch PCI ids ({cuda is not None})")
    # torch lists CUDA_VISIBLE_DEVICES' GPUs; with it unset, the same set as NVML.
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert sorted(bdf for bdf, _ in cuda) == sorted(bdf for bdf, _ in nvml)
    assert {uuid for _, uuid in cuda} <= {uuid for _, uuid in nvml}
