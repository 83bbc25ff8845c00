"""Discovery: which GPUs this process can see, which NUMA node each sits on, and which CPUs
of that node the process may use. Everything is read from the machine (sysfs, cgroup, NVML);
nothing is assumed about GPU counts or how GPUs spread over sockets.

``root`` is where the machine's filesystem is mounted ("/" on a real machine, a fixture tree
in tests). NVML and torch describe the real machine only, so they are consulted only when
``root`` is "/"; a fixture root is read through sysfs alone.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kuberl.numa.cpulist import parse_cpulist

log = logging.getLogger("kuberl.numa")

NVIDIA_VENDOR = "0x10de"
# PCI class codes of GPUs: VGA display controller and 3D controller. NVSwitches and bridges
# also carry NVIDIA's vendor id but other classes (0x0680..), so the class check matters.
GPU_CLASSES = ("0x0300", "0x0302")

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_NODE_DIR = re.compile(r"^node(\d+)$")


class NumaError(RuntimeError):
    """The topology cannot be read consistently; the message says what and how to fix it."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as the machine lists it."""

    bdf: str  # PCI address, normalised to "dddd:bb:dd.f" in lower case
    uuid: str | None  # "GPU-..." when the source knows it
    numa_node: int  # -1 when the firmware does not say


@dataclass(frozen=True)
class Topology:
    """What discovery found. ``gpus`` is every GPU the GPU source lists (the GPUs that share a
    node's CPUs); ``visible[i]`` is the index in ``gpus`` of CUDA device ``i`` of this process."""

    gpus: tuple[Gpu, ...]
    visible: tuple[int, ...]
    node_cpus: Mapping[int, frozenset[int]]
    allowed_cpus: frozenset[int]
    core_of: Mapping[int, int] = field(default_factory=dict)
    memory_nodes: frozenset[int] = frozenset()
    source: str = "sysfs"


def normalise_bdf(raw: str) -> str:
    """"00000000:18:00.0" (NVML) or "0000:18:00.0" (sysfs) -> "0000:18:00.0"."""
    match = _BDF.match(raw.strip())
    if not match:
        raise NumaError(f"PCI address {raw!r} is not of the form 'dddd:bb:dd.f'")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None


# --- GPU sources -------------------------------------------------------------------------


def gpus_from_nvml() -> list[tuple[str, str | None]] | None:
    """(bdf, uuid) of every GPU NVML lists, in NVML's (PCI bus) order; None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable: %s", exc)
        return None
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            found.append((
                normalise_bdf(bus_id.decode() if isinstance(bus_id, bytes) else bus_id),
                uuid.decode() if isinstance(uuid, bytes) else uuid,
            ))
        return found
    finally:
        pynvml.nvmlShutdown()


def gpus_from_torch() -> list[tuple[str, str | None]] | None:
    """(bdf, uuid) of each CUDA device torch sees, in CUDA order (CUDA_VISIBLE_DEVICES already
    applied); None without torch, CUDA, or a torch that does not report PCI ids."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        if not hasattr(props, "pci_bus_id"):
            return None
        uuid = str(props.uuid) if getattr(props, "uuid", None) else None
        if uuid and not uuid.startswith("GPU-"):
            uuid = f"GPU-{uuid}"
        found.append((f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0", uuid))
    return found


def gpus_from_sysfs(root: Path) -> list[tuple[str, str | None]]:
    """(bdf, uuid) of every NVIDIA display/3D PCI function under ``root``, in PCI bus order.
    The UUID comes from the driver's /proc/driver/nvidia/gpus/<bdf>/information when present."""
    devices = root / "sys/bus/pci/devices"
    found = []
    if not devices.is_dir():
        return found
    for entry in sorted(devices.iterdir(), key=lambda p: p.name):
        vendor = (_read(entry / "vendor") or "").strip().lower()
        pci_class = (_read(entry / "class") or "").strip().lower()
        if vendor != NVIDIA_VENDOR or not pci_class.startswith(GPU_CLASSES):
            continue
        bdf = normalise_bdf(entry.name)
        uuid = None
        info = _read(root / "proc/driver/nvidia/gpus" / bdf / "information") or ""
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID":
                uuid = value.strip()
        found.append((bdf, uuid))
    return found


# --- NUMA nodes, CPUs, cgroups ----------------------------------------------------------


def read_numa_node(root: Path, bdf: str) -> int:
    text = _read(root / "sys/bus/pci/devices" / bdf / "numa_node")
    if text is None:
        return -1
    try:
        return int(text.strip())
    except ValueError:
        raise NumaError(f"{root / 'sys/bus/pci/devices' / bdf / 'numa_node'}: {text.strip()!r} is not an integer") from None


def read_node_cpus(root: Path) -> dict[int, frozenset[int]]:
    """node id -> its CPUs, for every node under sys/devices/system/node (CPU-less nodes,
    such as GPU memory exposed as a node, map to the empty set)."""
    nodes_dir = root / "sys/devices/system/node"
    nodes: dict[int, frozenset[int]] = {}
    if not nodes_dir.is_dir():
        return nodes
    for entry in nodes_dir.iterdir():
        match = _NODE_DIR.match(entry.name)
        if match:
            path = entry / "cpulist"
            nodes[int(match.group(1))] = parse_cpulist(_read(path) or "", str(path))
    return nodes


def read_memory_nodes(root: Path, nodes: Mapping[int, frozenset[int]]) -> frozenset[int]:
    path = root / "sys/devices/system/node/has_memory"
    text = _read(path)
    return parse_cpulist(text, str(path)) if text is not None else frozenset(nodes)


def read_core_map(root: Path, cpus: frozenset[int]) -> dict[int, int]:
    """cpu -> lowest CPU of its physical core (hyperthread siblings share a core id)."""
    core_of = {}
    for cpu in cpus:
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        for name in ("core_cpus_list", "thread_siblings_list"):
            text = _read(topo / name)
            if text is not None:
                siblings = parse_cpulist(text, str(topo / name))
                core_of[cpu] = min(siblings) if siblings else cpu
                break
        else:
            core_of[cpu] = cpu
    return core_of


def _own_cgroup_paths(root: Path) -> tuple[str, str]:
    """This process's cgroup path for v2 ("0::/...") and for the v1 cpuset hierarchy, from
    <root>/proc/self/cgroup; "/" when unknown (inside a cgroup namespace it is "/" anyway)."""
    v2 = v1 = "/"
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpuset" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def read_cgroup_cpus(root: Path) -> frozenset[int] | None:
    """The CPUs the container's cgroup cpuset grants (v2 cpuset.cpus.effective, else v1
    cpuset.effective_cpus); None when no cpuset file is readable (no restriction known)."""
    v2_path, v1_path = _own_cgroup_paths(root)
    candidates = [
        root / "sys/fs/cgroup" / v2_path.lstrip("/") / "cpuset.cpus.effective",
        root / "sys/fs/cgroup/cpuset.cpus.effective",
        root / "sys/fs/cgroup/cpuset" / v1_path.lstrip("/") / "cpuset.effective_cpus",
        root / "sys/fs/cgroup/cpuset/cpuset.effective_cpus",
    ]
    for path in candidates:
        text = _read(path)
        if text is not None and text.strip():
            return parse_cpulist(text, str(path))
    return None


# --- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------


def resolve_visible(gpus: tuple[Gpu, ...], cuda_visible_devices: str | None) -> tuple[int, ...]:
    """Map CUDA_VISIBLE_DEVICES onto indices of ``gpus`` (listed in PCI bus order).

    Entries are integer indices (PCI bus order: what CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID
    and, on servers of identical GPUs, by default) or "GPU-<uuid>" (a unique prefix is enough,
    as for CUDA). Unset means every GPU; "" or "-1" means none.
    """
    if cuda_visible_devices is None:
        return tuple(range(len(gpus)))
    visible: list[int] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry == "" or entry == "-1":
            break
        if entry.isdigit():
            index = int(entry)
            if index >= len(gpus):
                raise NumaError(
                    f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: index {index} but this machine "
                    f"lists {len(gpus)} GPU(s); use indices 0..{len(gpus) - 1} or GPU UUIDs"
                )
        elif entry.startswith("GPU-"):
            matches = [i for i, gpu in enumerate(gpus) if gpu.uuid and gpu.uuid.startswith(entry)]
            if len(matches) != 1:
                known = ", ".join(gpu.uuid or "?" for gpu in gpus)
                raise NumaError(
                    f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: {entry!r} matches "
                    f"{len(matches)} GPU(s) (known UUIDs: {known}); give a full GPU UUID"
                )
            index = matches[0]
        else:
            raise NumaError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: cannot map {entry!r} to a PCI device "
                "(MIG instances are not supported); use GPU indices or GPU-<uuid> values"
            )
        if index in visible:
            raise NumaError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: GPU {entry!r} listed twice")
        visible.append(index)
    return tuple(visible)


def align_cuda_to_pci(
    cuda: list[tuple[str, str | None]], pci: list[tuple[str, str | None]]
) -> tuple[list[tuple[str, str | None]], tuple[int, ...]]:
    """Place torch's CUDA devices among every GPU on the PCI bus, so that the GPUs sharing a
    node's CPUs are all the node's GPUs even when this process sees one of them (a Ray actor).
    Returns (GPU list, CUDA device i -> index in it); torch's own list when a device is missing
    from the PCI list."""
    index = {bdf: i for i, (bdf, _) in enumerate(pci)}
    if not all(bdf in index for bdf, _ in cuda):
        return cuda, tuple(range(len(cuda)))
    merged = list(pci)
    for bdf, uuid in cuda:
        merged[index[bdf]] = (bdf, uuid or pci[index[bdf]][1])
    return merged, tuple(index[bdf] for bdf, _ in cuda)


# --- discovery ----------------------------------------------------------------------------


def discover(
    root: str | os.PathLike[str] = "/",
    environ: Mapping[str, str] | None = None,
    affinity: frozenset[int] | None = None,
) -> Topology:
    """Read the topology. ``affinity`` defaults to os.sched_getaffinity(0) on the real machine
    and to no restriction for a fixture root; the cgroup cpuset under ``root`` always applies."""
    root_path = Path(root)
    real_machine = root_path.resolve() == Path("/")
    environ = os.environ if environ is None else environ

    listed, source = (gpus_from_nvml() if real_machine else None), "nvml"
    cuda = gpus_from_torch() if real_machine and listed is None else None
    if listed is None:
        listed, source = gpus_from_sysfs(root_path), "sysfs"
    if cuda is not None:
        # torch has already applied CUDA_VISIBLE_DEVICES: its device i is CUDA device i.
        listed, visible = align_cuda_to_pci(cuda, listed)
        source = "torch"
    gpus = tuple(Gpu(bdf, uuid, read_numa_node(root_path, bdf)) for bdf, uuid in listed)
    if cuda is None:
        visible = resolve_visible(gpus, environ.get("CUDA_VISIBLE_DEVICES"))

    node_cpus = read_node_cpus(root_path)
    all_cpus = frozenset().union(*node_cpus.values()) if node_cpus else frozenset()
    allowed = all_cpus
    if affinity is None and real_machine:
        affinity = frozenset(os.sched_getaffinity(0))
    if affinity is not None:
        allowed = allowed & affinity
    cgroup_cpus = read_cgroup_cpus(root_path)
    if cgroup_cpus is not None:
        allowed = allowed & cgroup_cpus

    return Topology(
        gpus=gpus,
        visible=visible,
        node_cpus=node_cpus,
        allowed_cpus=allowed,
        core_of=read_core_map(root_path, allowed),
        memory_nodes=read_memory_nodes(root_path, node_cpus),
        source=source,
    )
