"""Real nodes for the test cluster: containerd, runc, CNI, kubelet, kube-proxy and CoreDNS.

Everything network-facing lives in a network namespace the harness makes (`Network`): the whole
control plane (so that kubelets reach the API server and the API server its kubelets), one
interface holding the API server's, the nodes' and CoreDNS's addresses, the pods' veths (CNI
`ptp`: every pod packet is routed by the namespace's own stack, so kube-proxy's iptables rules see
all of it), and kube-proxy's rules. Nothing listens on or sends to an address outside loopback and
that namespace; the host's tests reach the control plane's loopback ports through
tests/harness/forward.py. The namespace has no route out: an image pull from a registry fails at
once.

Each node is a Debian containerd 1.6 (kubelet v1.36 still accepts its CRI: without the
RuntimeConfig RPC it falls back to the configured cgroup driver) with runc, and a kubelet
(cgroupfs driver; `failCgroupV1: false` for this machine's cgroup v1 hierarchy). Node and pod
processes run under a cgroup of the session (`/kuberl-<pid>-<id>/<node>`) in every v1 hierarchy,
so teardown finds every container and shim, even after the harness was killed (the next start
clears cgroups of dead sessions). One kube-proxy and one CoreDNS (as processes in the
namespace, CoreDNS behind the `kube-dns` Service at 10.0.0.10) serve all nodes: they share the
namespace.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Addresses inside the namespace only (its dummy interface and the pods' veths).
API_ADDRESS = "10.240.0.1"
DNS_ADDRESS = "10.240.0.53"
CLUSTER_DNS = "10.0.0.10"  # in SERVICE_CLUSTER_IP_RANGE
CLUSTER_CIDR = "10.244.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = Path("/usr/lib/cni")
REAL_NODE_LABEL = "kuberl.test/real-node"
# The kubelets' hard eviction threshold for free disk (nodefs and imagefs): under it a kubelet deletes
# every image no pod uses. images.import_fits keeps imports well above it.
EVICTION_FREE_PERCENT = 1
# The kernel settings kubelet sets on start (vm.overcommit_memory, kernel.panic, ...): global to
# the machine, so the harness puts back what it found once the kubelets are up.
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)


class NodeError(RuntimeError):
    """A real node could not be set up; the message says which step and why."""


def _run(*argv: str, netns: str | None = None) -> str:
    if netns is not None:
        argv = ("ip", "netns", "exec", netns, *argv)
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise NodeError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


def host_tools_missing() -> list[str]:
    tools = ["ip", "iptables", "conntrack", "containerd", "containerd-shim-runc-v2", "ctr", "runc", "gcc"]
    missing = [t for t in tools if shutil.which(t) is None]
    if not (CNI_BIN_DIR / "ptp").exists():
        missing.append(f"CNI plugins ({CNI_BIN_DIR}/ptp)")
    return missing


# -- the network namespace ---------------------------------------------------------------------


def host_resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's IPv4 name servers other than loopback's. Components in the namespace read the
    host's resolv.conf, as KubeRay's operator does to reach a head Service by name: these addresses
    are the namespace's own there, where CoreDNS (listening on all of them) answers with the
    cluster's names. Loopback ones need nothing: CoreDNS has all of 127/8 already."""
    servers = []
    for line in resolv_conf.read_text().splitlines() if resolv_conf.exists() else []:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver" and fields[1].count(".") == 3 \
                and not fields[1].startswith("127.") and fields[1] not in servers:
            servers.append(fields[1])
    return servers


class Network:
    """The session's network namespace `kuberl-<pid>-<id>`: loopback, an interface with the API
    server's, nodes' and CoreDNS's addresses, forwarding on."""

    def __init__(self, session: str, node_count: int) -> None:
        self.name = f"kuberl-{session}"
        self.path = str(NETNS_DIR / self.name)
        self.node_ips = [f"10.240.0.{10 + i}" for i in range(node_count)]

    def create(self) -> None:
        _run("ip", "netns", "add", self.name)
        ns = self.name
        _run("ip", "link", "set", "lo", "up", netns=ns)
        # A bridge without ports as the holder of the addresses (this kernel has no `dummy`).
        _run("ip", "link", "add", "kuberl0", "type", "bridge", netns=ns)
        for address in (API_ADDRESS, DNS_ADDRESS, *self.node_ips, *host_resolvers()):
            _run("ip", "addr", "add", f"{address}/32", "dev", "kuberl0", netns=ns)
        _run("ip", "link", "set", "kuberl0", "up", netns=ns)
        # Pod to pod and pod to Service traffic is routed by this namespace.
        _run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", netns=ns)

    def add_service_address(self) -> str:
        """Another address on `kuberl0`, for a server the harness runs in the namespace."""
        self._services = getattr(self, "_services", 0) + 1
        address = f"10.240.1.{self._services}"
        _run("ip", "addr", "add", f"{address}/32", "dev", "kuberl0", netns=self.name)
        return address

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def clear_stale_sessions() -> None:
    """Remove network namespaces and cgroups of sessions whose process is gone (a killed harness)."""
    for path in list(NETNS_DIR.glob("kuberl-*")) + [p for p in (CGROUP_ROOT / "pids").glob("kuberl-*")]:
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if _pid_alive(pid):
            continue
        if path.parent == NETNS_DIR:
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True)
        else:
            SessionCgroup(path.name).destroy()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- cgroups -----------------------------------------------------------------------------------


def _v1_hierarchies() -> list[Path]:
    return sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir() and (p / "cgroup.procs").exists() and p.name != "unified")


class SessionCgroup:
    """`/<name>` in every cgroup v1 hierarchy: the nodes' containerd, shims and pods live below."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create(self, relative: str) -> None:
        for hierarchy in _v1_hierarchies():
            directory = hierarchy
            for part in Path(self.name, relative).parts:
                directory = directory / part
                if directory.exists():
                    continue
                directory.mkdir()
                if hierarchy.name == "cpuset":
                    # A v1 cpuset starts empty; no task can join it until it has CPUs and memory nodes.
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (directory / knob).write_text((directory.parent / knob).read_text())

    def procs_files(self, relative: str) -> list[Path]:
        return [h / self.name / relative / "cgroup.procs" for h in _v1_hierarchies()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        top = CGROUP_ROOT / "pids" / self.name
        if top.exists():
            for procs in top.rglob("cgroup.procs"):
                try:
                    found |= {int(p) for p in procs.read_text().split()}
                except OSError:
                    pass
        return found

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process below, until none is left (containers may fork meanwhile)."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def destroy(self) -> None:
        self.kill_all()
        for hierarchy in _v1_hierarchies() + [CGROUP_ROOT / "unified"]:
            top = hierarchy / self.name
            if not top.exists():
                continue
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                try:
                    directory.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                pass


CAP_SYS_RESOURCE = 24

_RUNC_WRAPPER = """#!/bin/sh
# Written by the kuberl test harness (tests/harness/nodes.py). This machine withholds
# CAP_SYS_RESOURCE even from root, so no process may lower its oom_score_adj below 0, and runc
# fails to create a container whose spec asks for it ("failed to update /proc/self/oom_score_adj:
# Permission denied"). kubelet asks for -998 (pod sandboxes) and -997 (Guaranteed pods): raise
# such values to 0 in the bundle's config.json, then run the real runc.
bundle=""; previous=""
for arg in "$@"; do [ "$previous" = "--bundle" ] && bundle="$arg"; previous="$arg"; done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  sed -i -E 's/"oomScoreAdj":-[0-9]+/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec {runc} "$@"
"""


def has_capability(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def runc_binary(directory: Path) -> str:
    """runc, or where CAP_SYS_RESOURCE is missing, a wrapper that drops negative OOM score
    adjustments (above); the rest of the container is as kubelet asked."""
    runc = shutil.which("runc")
    if has_capability(CAP_SYS_RESOURCE):
        return runc
    wrapper = directory / "runc"
    wrapper.write_text(_RUNC_WRAPPER.format(runc=runc))
    wrapper.chmod(0o755)
    return str(wrapper)


def pod_network_namespaces(pids: set[int]) -> list[Path]:
    """The named network namespaces (containerd's /run/netns/cni-*) that these processes are in:
    containerd removes them only when it stops a pod sandbox, which a killed node never does."""
    inodes = set()
    for pid in pids:
        try:
            inodes.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            pass
    return [path for path in NETNS_DIR.glob("cni-*") if _inode(path) in inodes]


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def remove_named_namespaces(paths: list[Path]) -> None:
    for path in paths:
        subprocess.run(["umount", str(path)], capture_output=True)
        path.unlink(missing_ok=True)


def unmount_below(directory: Path) -> None:
    """Unmount (lazily) every mount under `directory`, deepest first: kubelet's volume tmpfs and
    containerd's overlay rootfs would otherwise outlive the session."""
    prefix = str(directory.resolve()) + "/"
    mounts = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            target = line.split()[4].encode().decode("unicode_escape")
            if target.startswith(prefix):
                mounts.append(target)
    for target in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


def read_kernel_tunables() -> dict[str, str]:
    return {name: (Path("/proc/sys") / name).read_text().strip() for name in KERNEL_TUNABLES}


def restore_kernel_tunables(saved: dict[str, str]) -> None:
    for name, value in saved.items():
        path = Path("/proc/sys") / name
        if path.read_text().strip() != value:
            path.write_text(value)


# -- images kept between sessions ----------------------------------------------------------------


class NodeStores:
    """The nodes' containerd roots kept between sessions under `<cache>/node-store/<node>`, so that
    a warm run finds its images already imported: worker-cpu is 7 GB and takes minutes per node.
    One session at a time holds them (an flock); a concurrent session gets None from `claim` and
    imports into throwaway roots as before, rather than a second copy of every image on disk.
    Delete the directory to give the space back."""

    def __init__(self, directory: Path, lock) -> None:
        self.directory, self._lock = directory, lock

    @classmethod
    def claim(cls, cache: Path) -> "NodeStores | None":
        directory = cache / "node-store"
        directory.mkdir(parents=True, exist_ok=True)
        lock = (directory / ".lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        return cls(directory, lock)

    def root(self, node: str) -> Path:
        return self.directory / node / "containerd-root"

    def _record(self, node: str) -> Path:
        return self.directory / node / "imported.json"

    def imported(self, node: str, present: set[str]) -> dict[str, str]:
        """image name -> the local image it was imported from, for the names still in the node's
        containerd (`present`; kubelet's image GC may have removed some)."""
        try:
            recorded = json.loads(self._record(node).read_text())
        except (OSError, ValueError):
            return {}
        return {name: source for name, source in recorded.items() if name in present}

    def remember(self, node: str, imported: dict[str, str]) -> None:
        record = self._record(node)
        partial = record.with_suffix(".partial")
        partial.write_text(json.dumps(imported, indent=1, sort_keys=True))
        partial.replace(record)

    def scrub(self, node: RealNode, pause_image: str, log: Path) -> None:
        """Remove the previous session's containers (its pods and sandboxes, dead with it) from
        the root, keeping the images, with a containerd whose CRI plugin is off: a CRI that
        recovered them would hand kubelet sandboxes of pods from another cluster. A root that
        cannot be scrubbed is dropped whole."""
        if not (node.root / "io.containerd.metadata.v1.bolt" / "meta.db").exists():
            return
        config = node.write_containerd_config(pause_image, cri=False)
        with log.open("a") as out:
            daemon = subprocess.Popen(["containerd", f"--config={config}"], stdout=out, stderr=subprocess.STDOUT)
        scrubbed = False
        try:
            deadline = time.monotonic() + 60
            while subprocess.run([*node.ctr(), "version"], capture_output=True).returncode != 0:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise NodeError(f"containerd on the kept root of {node.name} did not start; log {log}")
                time.sleep(0.2)
            ids = _run(*node.ctr(), "-n", "k8s.io", "containers", "ls", "-q").split()
            if ids:
                _run(*node.ctr(), "-n", "k8s.io", "containers", "rm", *ids)
            scrubbed = True
        except NodeError as err:
            with log.open("a") as out:
                out.write(f"scrub failed, dropping the kept root: {err}\n")
        finally:
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if not scrubbed:
            shutil.rmtree(self.directory / node.name, ignore_errors=True)

    def release(self) -> None:
        self._lock.close()


# -- one node ------------------------------------------------------------------------------------


@dataclass
class RealNode:
    name: str
    index: int
    ip: str
    directory: Path
    # containerd's root (content, snapshots, metadata): a NodeStore's when the session holds the
    # stores, else the node's own directory, dropped at the end.
    containerd_root: Path | None = None

    @property
    def root(self) -> Path:
        return self.containerd_root or self.directory / "containerd-root"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def state(self) -> Path:
        """containerd's state directory: its running tasks, their root filesystems mounted."""
        return self.directory / "containerd-state"

    def rootfs(self, task: str) -> Path:
        """The root filesystem of the running container ``task`` (of the kubelet's namespace)."""
        return self.state / "io.containerd.runtime.v2.task" / "k8s.io" / task / "rootfs"

    @property
    def cgroup(self) -> str:
        return self.name

    def ctr(self) -> list[str]:
        return ["ctr", f"--address={self.socket}"]

    def write_containerd_config(self, pause_image: str, cri: bool = True) -> Path:
        """`cri=False`: containerd without its CRI plugin (NodeStore.scrub), so that nothing
        recovers the sandboxes being removed."""
        cni = self.directory / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-kuberl.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0",
            "name": "kuberl",
            "plugins": [
                {
                    "type": "ptp",
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.directory / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=2))
        config = self.directory / ("containerd.toml" if cri else "containerd-scrub.toml")
        disabled = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
        if not cri:
            disabled.append("io.containerd.grpc.v1.cri")
        config.write_text(f"""version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = {json.dumps(disabled)}
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.directory / 'containerd.sock.ttrpc'}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.directory / 'containerd-opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc_binary(self.directory)}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni}"
    max_conf_num = 1
""")
        return config

    def write_kubelet_config(self, session_cgroup: str, client_ca: Path, healthz_port: int) -> Path:
        resolv = self.directory / "resolv.conf"
        resolv.write_text("")  # no upstream DNS: nothing outside the namespace is reachable
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This machine mounts cgroup v1 (beside an empty cgroup2 "unified" mount).
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{session_cgroup}/{self.cgroup}",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(client_ca)},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "podLogsDir": str(self.directory / "pod-logs"),
            "failSwapOn": False,
            # Never garbage-collect the images the harness imported (nothing can be pulled here),
            # and do not evict on a busy shared disk.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": f"{EVICTION_FREE_PERCENT}%",
                             "imagefs.available": f"{EVICTION_FREE_PERCENT}%"},
            "serializeImagePulls": False,
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "shutdownGracePeriod": "0s",
        }
        path = self.directory / "kubelet.json"
        path.write_text(json.dumps(config, indent=2))
        return path


def kube_proxy_config(kubeconfig: Path, hostname: str, healthz_port: int, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": CLUSTER_CIDR,
        "hostnameOverride": hostname,
        "bindAddress": "127.0.0.1",
        "nodePortAddresses": ["primary"],
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # 0: leave the machine-wide conntrack table and timeouts as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig: Path, ready_port: int, health_port: int) -> str:
    return f""".:53 {{
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
}}
"""


def external_service_objects(name: str, namespace: str, address: str, port: int) -> list[dict]:
    """A Service without a selector and its EndpointSlice: pods reach `address:port` as
    `<name>.<namespace>.svc.cluster.local:<port>`."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"ports": [{"name": "tcp", "protocol": "TCP", "port": port, "targetPort": port}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{name}-harness",
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": name, "endpointslice.kubernetes.io/managed-by": "kuberl-test-harness"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "tcp", "protocol": "TCP", "port": port}],
        },
    ]


def kube_dns_objects() -> list[dict]:
    """The `kube-dns` Service at CLUSTER_DNS and its EndpointSlice: CoreDNS in the namespace."""
    ports = [{"name": "dns", "protocol": "UDP", "port": 53}, {"name": "dns-tcp", "protocol": "TCP", "port": 53}]
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
            "spec": {"clusterIP": CLUSTER_DNS, "ports": [dict(p, targetPort=53) for p in ports]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-coredns",
                "namespace": "kube-system",
                "labels": {"kubernetes.io/service-name": "kube-dns", "endpointslice.kubernetes.io/managed-by": "kuberl-test-harness"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [DNS_ADDRESS], "conditions": {"ready": True}}],
            "ports": ports,
        },
    ]
