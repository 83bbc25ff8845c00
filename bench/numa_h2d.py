"""Host-to-device copy bandwidth from pinned (page-locked) host memory, with the process pinned
to its GPU's NUMA node (kuberl.numa, policy gpu-local) against the same process unpinned, and,
on machines with several NUMA nodes, against the worst case: pinned to a remote node.

Each configuration runs in its own fresh process (affinity and memory policy are process and
thread state), and the configurations are interleaved over several rounds; each row reports
the best round's median. The last line is the headline ratio gpu-local / unpinned.

    PYTHONPATH=workloads python bench/numa_h2d.py [--size-gib 1] [--reps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def measure(config: str, size_gib: float, reps: int) -> dict:
    """Child: apply ``config``, then time ``reps`` host->device copies of one pinned buffer."""
    import torch

    from kuberl.numa import discover, format_cpulist, pin_current_process, plan, prefer_memory_node, set_cpu_affinity

    info: dict = {"config": config, "node": None, "cpus": "inherited", "memory": "default"}
    if config == "gpu-local":
        decision = pin_current_process(0, "gpu-local", role="bench")
        info.update(node=decision.placement.node if decision.pinned else None, memory=decision.memory_policy,
                    cpus=format_cpulist(decision.placement.cpus) if decision.pinned else f"not pinned: {decision.placement.reason}")
    elif config == "remote":
        topology = discover()
        local = plan(topology).for_rank(0).node
        remote = next(n for n, c in sorted(topology.node_cpus.items()) if c & topology.allowed_cpus and n != local)
        cpus = topology.node_cpus[remote] & topology.allowed_cpus
        set_cpu_affinity(cpus)
        info.update(node=remote, cpus=format_cpulist(cpus), memory=prefer_memory_node(remote)[1])

    n = int(size_gib * (1 << 30))
    # Random bytes, not zeros: the copy must move real data. Allocated after pinning so that the
    # pages come from the preferred node.
    host = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(2):  # warm-up: context, pinned-buffer registration
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(device[:4096].cpu(), host[:4096]) and torch.equal(device[-4096:].cpu(), host[-4096:])
    rates = [n / s / 1e9 for s in seconds]
    info.update(median_gbps=statistics.median(rates), min_gbps=min(rates), max_gbps=max(rates),
                bytes=n, reps=reps, gpu=torch.cuda.get_device_name(0))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all configurations")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(measure(args.child, args.size_gib, args.reps)))
        return 0

    from kuberl.numa import discover

    topology = discover()
    cpu_nodes = sorted(n for n, c in topology.node_cpus.items() if c & topology.allowed_cpus)
    configs = ["unpinned", "gpu-local"] + (["remote"] if len(cpu_nodes) > 1 else [])
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for config in configs:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", config, "--size-gib", str(args.size_gib), "--reps", str(args.reps)],
                capture_output=True, text=True, check=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if config not in best or result["median_gbps"] > best[config]["median_gbps"]:
                best[config] = result

    gpu = topology.gpus[topology.visible[0]] if topology.visible else None
    print(f"GPU {best['unpinned']['gpu']} at {gpu.bdf if gpu else '?'}, NUMA node {gpu.numa_node if gpu else '?'}; "
          f"{len(cpu_nodes)} NUMA node(s) with usable CPUs; {args.size_gib} GiB pinned buffer, {args.reps} copies, "
          f"best of {args.rounds} interleaved rounds")
    print(f"{'config':<10} {'node':>4} {'median GB/s':>12} {'min':>7} {'max':>7}  cpus / memory policy")
    for config in configs:
        r = best[config]
        print(f"{config:<10} {'-' if r['node'] is None else r['node']:>4} {r['median_gbps']:>12.2f} {r['min_gbps']:>7.2f} {r['max_gbps']:>7.2f}  {r['cpus']} / {r['memory']}")
    ratio = best["gpu-local"]["median_gbps"] / best["unpinned"]["median_gbps"]
    note = "" if len(cpu_nodes) > 1 else " (one NUMA node: pinning is a no-op, no difference expected)"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": best, "numa_nodes": len(cpu_nodes), "ratio_gpu_local_over_unpinned": ratio}, f, indent=2)
    print(f"headline: gpu-local / unpinned H2D bandwidth = {ratio:.3f}x{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
