"""Discovery + plan on synthetic sysfs trees copied from real machines' layouts; every test
asserts the exact CPU set of each local rank."""

from __future__ import annotations

import pytest

from kuberl.numa import NumaError, discover, format_cpulist, parse_cpulist, plan
from tests.unit.numa.fixtures.machines import amd_4node, cloud_vm_no_numa, grace_hopper, hgx_h100_2socket

HGX_SHARES = [
    "0-13,112-125", "14-27,126-139", "28-41,140-153", "42-55,154-167",
    "56-69,168-181", "70-83,182-195", "84-97,196-209", "98-111,210-223",
]


def cpus_by_rank(root, environ=None, affinity=None) -> list[str]:
    numa_plan = plan(discover(root, environ or {}, affinity))
    return [format_cpulist(p.cpus) for p in numa_plan.placements]


def test_hgx_h100_two_sockets_four_gpus_per_node(tmp_path):
    root = hgx_h100_2socket().write(tmp_path)
    topology = discover(root, {})
    assert topology.source == "sysfs"
    # 8 GPUs: the NVSwitches (NVIDIA, bridge class), NICs and the BMC VGA are not GPUs.
    assert [g.numa_node for g in topology.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    numa_plan = plan(topology)
    assert numa_plan.noop_reason is None
    assert [format_cpulist(p.cpus) for p in numa_plan.placements] == HGX_SHARES
    assert [p.memory_node for p in numa_plan.placements] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Whole cores: no two GPUs share a physical core (hyperthread siblings stay together).
    for p in numa_plan.placements:
        assert all((cpu + 112 in p.cpus) for cpu in p.cpus if cpu < 112)


def test_amd_four_nodes_two_gpus_per_node(tmp_path):
    root = amd_4node().write(tmp_path)
    assert cpus_by_rank(root) == [
        "0-15,128-143", "16-31,144-159", "32-47,160-175", "48-63,176-191",
        "64-79,192-207", "80-95,208-223", "96-111,224-239", "112-127,240-255",
    ]


def test_numa_node_minus_one_is_a_noop(tmp_path):
    root = cloud_vm_no_numa().write(tmp_path)
    numa_plan = plan(discover(root, {}))
    assert [p.pinned for p in numa_plan.placements] == [False, False]
    assert numa_plan.noop_reason == (
        "firmware reports no NUMA node for GPU 0000:00:04.0 (numa_node = -1); "
        "firmware reports no NUMA node for GPU 0000:00:05.0 (numa_node = -1)"
    )
    assert all(p.cpus == frozenset() and p.memory_node is None for p in numa_plan.placements)


def test_single_cpu_node_with_gpu_memory_nodes_is_a_noop(tmp_path):
    root = grace_hopper().write(tmp_path)
    numa_plan = plan(discover(root, {}))
    assert numa_plan.noop_reason == "the machine has 1 NUMA node(s) with CPUs: nothing to pin"
    assert [p.cpus for p in numa_plan.placements] == [frozenset()]


def test_container_cpuset_v2_owning_half_of_node0(tmp_path):
    machine = hgx_h100_2socket()
    machine.cgroup_v2_cpus = "28-55,140-167"
    root = machine.write(tmp_path)
    numa_plan = plan(discover(root, {}))
    assert [format_cpulist(p.cpus) for p in numa_plan.placements[:4]] == [
        "28-34,140-146", "35-41,147-153", "42-48,154-160", "49-55,161-167",
    ]
    # The container owns no CPU of node 1: its GPUs stay unpinned rather than pinned elsewhere.
    for p in numa_plan.placements[4:]:
        assert not p.pinned
        assert "may use no CPU of node 1" in p.reason


def test_container_cpuset_v1_uneven_split_gives_remainder_to_first_gpus(tmp_path):
    machine = hgx_h100_2socket()
    machine.cgroup_v1_cpus = "20-29"  # 10 cores without their siblings, 4 GPUs on node 0
    root = machine.write(tmp_path)
    assert cpus_by_rank(root)[:4] == ["20-22", "23-25", "26-27", "28-29"]


def test_nested_cgroup_v2_path_from_proc_self_cgroup(tmp_path):
    machine = hgx_h100_2socket()
    machine.proc_self_cgroup = "0::/kubepods.slice/pod1234/ctr"
    machine.cgroup_v2_cpus = "0-223"  # the root cgroup: everything
    root = machine.write(tmp_path)
    (root / "sys/fs/cgroup/kubepods.slice/pod1234/ctr").mkdir(parents=True)
    (root / "sys/fs/cgroup/kubepods.slice/pod1234/ctr/cpuset.cpus.effective").write_text("56-69,168-181\n")
    shares = cpus_by_rank(root)
    assert shares[:4] == ["", "", "", ""]
    # 14 cores on node 1 for 4 GPUs: 4, 4, 3, 3 cores.
    assert shares[4:] == ["56-59,168-171", "60-63,172-175", "64-66,176-178", "67-69,179-181"]


def test_sched_affinity_restricts_like_the_cpuset(tmp_path):
    root = hgx_h100_2socket().write(tmp_path)
    affinity = parse_cpulist("0-7,112-119")
    assert cpus_by_rank(root, affinity=affinity)[:4] == ["0-1,112-113", "2-3,114-115", "4-5,116-117", "6-7,118-119"]


def test_cuda_visible_devices_reordering(tmp_path):
    root = hgx_h100_2socket().write(tmp_path)
    # Local rank 0 drives physical GPU 5, rank 1 GPU 1, rank 2 GPU 4: each keeps its own share.
    assert cpus_by_rank(root, {"CUDA_VISIBLE_DEVICES": "5,1,4"}) == [HGX_SHARES[5], HGX_SHARES[1], HGX_SHARES[4]]


def test_cuda_visible_devices_uuids_and_prefixes(tmp_path):
    machine = hgx_h100_2socket()
    root = machine.write(tmp_path)
    cvd = f"{machine.uuid(7)},{machine.uuid(0)[:12]}"
    numa_plan = plan(discover(root, {"CUDA_VISIBLE_DEVICES": cvd}))
    assert [p.gpu_bdf for p in numa_plan.placements] == ["0000:db:00.0", "0000:19:00.0"]
    assert [format_cpulist(p.cpus) for p in numa_plan.placements] == [HGX_SHARES[7], HGX_SHARES[0]]


def test_one_visible_gpu_keeps_its_share_of_the_node(tmp_path):
    """A Ray actor sees one GPU; it still gets only its GPU's block, not the whole node."""
    root = hgx_h100_2socket().write(tmp_path)
    assert cpus_by_rank(root, {"CUDA_VISIBLE_DEVICES": "6"}) == [HGX_SHARES[6]]


@pytest.mark.parametrize("cvd", ["", "-1"])
def test_no_visible_gpu_is_a_noop(tmp_path, cvd):
    root = hgx_h100_2socket().write(tmp_path)
    numa_plan = plan(discover(root, {"CUDA_VISIBLE_DEVICES": cvd}))
    assert numa_plan.placements == ()
    assert numa_plan.noop_reason == "no GPU is visible to this process"


@pytest.mark.parametrize(
    ("cvd", "message"),
    [
        ("8", "index 8 but this machine lists 8 GPU(s)"),
        ("GPU-ffff", "matches 0 GPU(s)"),
        ("MIG-1234", "MIG instances are not supported"),
        ("1,1", "listed twice"),
    ],
)
def test_bad_cuda_visible_devices_names_the_variable(tmp_path, cvd, message):
    root = hgx_h100_2socket().write(tmp_path)
    with pytest.raises(NumaError, match="CUDA_VISIBLE_DEVICES") as info:
        discover(root, {"CUDA_VISIBLE_DEVICES": cvd})
    assert message in str(info.value)


def test_torch_devices_are_placed_among_all_pci_gpus(tmp_path):
    """Without NVML, torch lists only CUDA_VISIBLE_DEVICES' GPUs; aligned with the PCI bus, a
    process that sees GPUs 6 and 2 still gets their blocks, not whole nodes."""
    from kuberl.numa.topology import align_cuda_to_pci, gpus_from_sysfs

    machine = hgx_h100_2socket()
    pci = gpus_from_sysfs(machine.write(tmp_path))
    cuda = [("0000:cb:00.0", machine.uuid(6)), ("0000:4c:00.0", None)]
    listed, visible = align_cuda_to_pci(cuda, pci)
    assert listed == pci and visible == (6, 2)
    # A device the PCI listing lacks: torch's own list, in CUDA order.
    alone = [("0001:00:00.0", None)]
    assert align_cuda_to_pci(alone, pci) == (alone, (0,))
