"""The real machine: discovery on "/", and applying affinity and memory policy in real
subprocesses (so the test process keeps its own affinity)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kuberl.numa import NumaError, Placement, discover, pin_current_process, plan
from kuberl.numa.apply import load_libnuma, prefer_memory_node
from kuberl.numa.pin import PinDecision, report_metrics
from tests.unit.numa.fixtures.machines import Machine

REPO = Path(__file__).resolve().parents[3]


def run_python(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter with kuberl importable; it prints one JSON line."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": f"{REPO / 'workloads'}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True, env=full_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_real_machine_discovery_without_gpu_is_a_noop(caplog):
    topology = discover()
    if topology.visible:
        pytest.skip("this machine has GPUs: tests/gpu/test_numa.py covers it")
    assert plan(topology).noop_reason == "no GPU is visible to this process"
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="kuberl.numa"):
        decision = pin_current_process(0, "gpu-local", role="trainer", registry=CollectorRegistry())
    assert not decision.pinned
    assert os.sched_getaffinity(0) == before
    assert [r.getMessage() for r in caplog.records] == ["numa: role=trainer rank=0 not pinned: no GPU is visible to this process"]


def test_policy_is_validated():
    with pytest.raises(NumaError, match="spec.numa.policy must be one of gpu-local, none; got 'local'"):
        pin_current_process(0, "local")


def test_policy_none_changes_nothing_and_reports():
    registry = CollectorRegistry()
    decision = pin_current_process(3, "none", role="engine", registry=registry)
    assert not decision.pinned and decision.placement.reason == "spec.numa.policy is 'none'"
    assert registry.get_sample_value("kuberl_numa_node", {"role": "engine", "rank": "3"}) == -1
    assert registry.get_sample_value("kuberl_numa_cpus", {"role": "engine", "rank": "3"}) == 0


def test_metrics_of_a_pinned_decision():
    registry = CollectorRegistry()
    placement = Placement(2, "0000:9b:00.0", 1, frozenset(range(56, 70)) | frozenset(range(168, 182)), 1, "gpu-local")
    assert report_metrics(PinDecision("trainer", 2, placement, "preferred node 1", "nvml"), registry)
    assert registry.get_sample_value("kuberl_numa_node", {"role": "trainer", "rank": "2"}) == 1
    assert registry.get_sample_value("kuberl_numa_cpus", {"role": "trainer", "rank": "2"}) == 28


def test_affinity_applies_to_threads_started_before():
    if 0 not in os.sched_getaffinity(0):
        pytest.skip("CPU 0 is not ours")
    result = run_python(
        """
        import json, os, threading
        from kuberl.numa import set_cpu_affinity
        stop = threading.Event()
        workers = [threading.Thread(target=stop.wait) for _ in range(3)]
        for w in workers: w.start()
        pinned = set_cpu_affinity({0})
        masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
        stop.set()
        print(json.dumps({"pinned": pinned, "masks": masks}))
        """
    )
    assert result["pinned"] >= 4
    assert all(mask == [0] for mask in result["masks"].values())


def test_preferred_memory_node_through_libnuma_integer_api():
    if load_libnuma() is None:
        pytest.skip("libnuma.so.1 is not installed here")
    result = run_python(
        """
        import json
        from kuberl.numa.apply import memory_policy_mode, prefer_memory_node, reset_memory_policy
        applied, what = prefer_memory_node(0)
        mode = memory_policy_mode()
        reset_memory_policy()
        print(json.dumps({"applied": applied, "what": what, "mode": mode, "after_reset": memory_policy_mode()}))
        """
    )
    if result["applied"]:
        assert result == {"applied": True, "what": "preferred node 0", "mode": 1, "after_reset": 4}
    else:  # a kernel that refuses set_mempolicy: reported, not raised
        assert result["what"].startswith("unchanged: the kernel refused set_mempolicy")
    assert prefer_memory_node(10_000)[1].startswith("unchanged: node 10000 outside libnuma's 0..")


def test_pin_end_to_end_on_a_fixture_sized_like_this_box(tmp_path):
    """Two one-CPU nodes, the GPU on node 1: the subprocess really ends up on CPU 1."""
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    root = Machine(nodes={0: "0", 1: "1"}, gpus=[("0000:17:00.0", 0), ("0000:b1:00.0", 1)]).write(tmp_path)
    result = run_python(
        f"""
        import json, os
        from kuberl.numa import pin_current_process
        d = pin_current_process(0, "gpu-local", role="engine", root={str(root)!r})
        print(json.dumps({{"cpus": sorted(os.sched_getaffinity(0)), "node": d.placement.node,
                           "memory": d.memory_policy, "line": d.describe()}}))
        """,
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    assert result["cpus"] == [1]
    assert result["node"] == 1
    assert result["line"].startswith("numa: role=engine rank=0 gpu=0000:b1:00.0 node=1 cpus=1 (1 CPUs) memory=")


def test_local_rank_out_of_range_names_cuda_visible_devices(tmp_path):
    root = Machine(nodes={0: "0", 1: "1"}, gpus=[("0000:17:00.0", 0), ("0000:b1:00.0", 1)]).write(tmp_path)
    with pytest.raises(NumaError, match=r"local_rank 2 has no GPU: this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=None\)"):
        pin_current_process(2, "gpu-local", root=root, environ={}, registry=CollectorRegistry())


def test_imports_and_runs_without_torch_ray_or_prometheus():
    result = run_python(
        """
        import json, sys
        for name in ("torch", "ray", "vllm", "prometheus_client", "pynvml"):
            sys.modules[name] = None  # makes `import name` raise ImportError
        from kuberl.numa import pin_current_process
        from kuberl.numa.pin import report_metrics
        d = pin_current_process(0, "gpu-local")
        print(json.dumps({"reported": report_metrics(d), "pinned": d.pinned}))
        """
    )
    assert result == {"reported": False, "pinned": False}
