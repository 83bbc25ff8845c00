"""A real Kubernetes control plane as local processes on 127.0.0.1.

etcd, kube-apiserver (TLS, RBAC, service-account tokens), kube-controller-
manager, kube-scheduler, KWOK (fake GPU nodes whose pods it reports Running)
and the KubeRay operator, the way controller-runtime's envtest runs a control
plane without containers. Binaries come from `python -m tests.harness build`.
CRDs: RayCluster, RayJob and RayService from the KubeRay operator's own Go
module, the version that runs (see kuberay_crds()).

    with Cluster() as cluster:
        cluster.kubectl("get", "nodes")
        core = kubernetes.client.CoreV1Api(cluster.api_client())
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import yaml

from kuberl.common.ports import unclaimed_port

from tests.harness import images, kueue, pki
from tests.harness import nodes as realnodes
from tests.harness.build import missing_components
from tests.harness.components import binary_path, cache_dir, data_path
from tests.harness.processes import ComponentExited, Process

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"


class ToolError(subprocess.CalledProcessError):
    """kubectl/helm failed; unlike CalledProcessError, its message includes stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr.strip()}"


class ClusterError(RuntimeError):
    """The control plane did not come up; the message names the component and its log."""


@functools.cache
def kuberay_crds() -> tuple[dict, ...]:
    """KubeRay's CRDs at the version the harness builds and runs (from its Go module). Parsed
    once per process (about 3.5 MB of YAML; libyaml's loader when PyYAML has it). Read-only."""
    path = data_path("kuberay-operator")
    if not path.is_file():
        raise ClusterError(f"KubeRay CRDs not built ({path}); run `python -m tests.harness build`")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(crd for crd in yaml.load_all(path.read_text(), Loader=loader) if crd)


def fake_gpu_node(name: str, zone: str) -> dict:
    """A Node that KWOK manages: 8 GPUs, 64 CPUs, 512Gi, with topology labels."""
    capacity = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110", "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "topology.kubernetes.io/region": "test-region",
                "topology.kubernetes.io/zone": zone,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.count": "8",
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def _write_kubeconfig(path: Path, server: str, ca: Path, user: str, credentials: dict) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kuberl-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "kuberl-test", "user": user}}],
        "current-context": user,
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)
    return path


def _wait(what: str, ready: Callable[[], bool], timeout: float, watch: list[Process], interval: float = 0.1) -> None:
    """Poll `ready()` until true; fail fast if a watched component exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        for process in watch:
            process.check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            logs = ", ".join(str(p.log) for p in watch)
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}; logs: {logs}")
        time.sleep(interval)


class Cluster:
    """Start/stop a loopback control plane; see the module docstring."""

    def __init__(self, workdir: Path | None = None, nodes: int = 3, kuberay: bool = True, real_nodes: int = 0) -> None:
        """`kuberay=False`: neither the KubeRay CRDs nor its operator (a faster, plain cluster).
        `real_nodes=N`: N real nodes (containerd + kubelet) beside the `nodes` KWOK ones, with
        kube-proxy and CoreDNS; the control plane then runs in the cluster's network namespace
        (tests/harness/nodes.py) and its ports are forwarded to the host's loopback."""
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kuberl-cluster-"))
        self.log_dir = self.workdir / "logs"
        self.pki_dir = self.workdir / "pki"
        self.node_names = [f"kwok-gpu-{i}" for i in range(nodes)]
        self.with_kuberay = kuberay
        names = ["etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok", "kuberay-metrics", "kuberay-probe"]
        if real_nodes:
            names += ["kube-proxy-healthz", "kube-proxy-metrics", "coredns-ready", "coredns-health"]
            names += [f"kubelet-healthz-{i}" for i in range(real_nodes)]
        self.ports = {name: unclaimed_port() for name in names}
        self.session = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.network = realnodes.Network(self.session, real_nodes) if real_nodes else None
        self.session_cgroup = realnodes.SessionCgroup(f"kuberl-{self.session}") if real_nodes else None
        self.real_nodes = [
            realnodes.RealNode(f"real-node-{i}", i, ip, self.workdir / "nodes" / f"real-node-{i}")
            for i, ip in enumerate(self.network.node_ips if self.network else [])
        ]
        # node -> image name -> the local image it was imported from.
        self._imported: dict[str, dict[str, str]] = {node.name: {} for node in self.real_nodes}
        self._stores: realnodes.NodeStores | None = None
        self._saved_kernel_tunables: dict[str, str] | None = None
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.processes: list[Process] = []
        self.startup_seconds: dict[str, float] = {}
        self._stopped = threading.Event()
        self._api_client = None

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Cluster":
        missing = missing_components()
        if missing:
            raise ClusterError(f"components not built: {missing}; run `python -m tests.harness build` first")
        for directory in (self.log_dir, self.pki_dir):
            directory.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        _install_signal_handlers(self)
        began = time.monotonic()
        try:
            if self.real_nodes:
                self._step("network-namespace", self._make_network)
            self._step("certificates", self._make_pki)
            self._step("etcd", self._start_etcd)
            self._step("kube-apiserver", self._start_apiserver)
            if self.with_kuberay:
                self._step("kuberay-crds-create", self._create_kuberay_crds)
            # Nodes, KWOK and the scheduler need no CRD: start them while the
            # (large) KubeRay CRDs get established, which takes seconds.
            self._step("nodes+kwok+scheduler", self._start_node_side)
            if self.with_kuberay:
                self._step("kuberay-crds-established", self._wait_kuberay_crds)
            # After the CRDs: the garbage collector discovers ray.io kinds at start.
            self._step("controller-manager", self._start_controller_manager)
            if self.with_kuberay:
                self._step("kuberay-operator", self._start_kuberay)
            self._step("ready", self._wait_ready)
            if self.real_nodes:
                self._step("real-nodes", self._start_real_nodes)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["total"] = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every component (reverse start order) and drop etcd's data; logs stay."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        # Signal every component at once, then wait on one shared deadline:
        # stopping them one by one would add up their shutdown times.
        for process in reversed(self.processes):
            process.terminate()
        # kube-apiserver drains for longer than a throwaway cluster needs.
        deadline = time.monotonic() + 2.0
        for process in reversed(self.processes):
            process.reap(deadline)
        if self._api_client is not None:
            self._api_client.close()
        if self.real_nodes:
            self._stop_real_nodes()
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
        atexit.unregister(self.stop)

    def _step(self, name: str, fn: Callable[[], None]) -> None:
        began = time.monotonic()
        fn()
        self.startup_seconds[name] = time.monotonic() - began

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, host: bool = False,
               cgroup_procs: list[Path] = ()) -> Process:
        """Start a component; with real nodes, inside the network namespace unless `host`."""
        netns = self.network.path if self.network and not host else None
        process = Process(name, argv, self.log_dir / f"{name}.log", env=env, netns=netns, cgroup_procs=cgroup_procs)
        process.start()
        self.processes.append(process)
        return process

    # -- components ------------------------------------------------------------

    def _make_pki(self) -> None:
        self.ca = pki.CertificateAuthority(self.pki_dir)
        self.serving = self.ca.issue(
            "apiserver",
            "kube-apiserver",
            dns_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                       "kubernetes.default.svc.cluster.local"),
            ip_addresses=("127.0.0.1", "10.0.0.1", realnodes.API_ADDRESS),
            server=True,
        )
        self.service_account_keys = pki.service_account_key_pair(self.pki_dir)
        identities = {
            # name: (common name, organisations); CNs the bootstrap RBAC policy knows.
            "admin": ("kuberl-test-admin", ("system:masters",)),
            "controller-manager": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
            "kwok": ("kwok-controller", ("system:masters",)),
            "kuberay-operator": ("kuberay-operator", ("system:masters",)),
            "kueue": ("kueue-controller-manager", ("system:masters",)),
        }
        if self.real_nodes:
            identities.update({
                # The API server's client identity towards kubelets (logs, exec).
                "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ("system:masters",)),
                "kube-proxy": ("system:kube-proxy", ()),
                "coredns": ("kuberl-coredns", ("system:masters",)),
                **{node.name: (f"system:node:{node.name}", ("system:nodes",)) for node in self.real_nodes},
            })
        self.kubeconfigs: dict[str, Path] = {}
        for name, (common_name, orgs) in identities.items():
            pair = self.ca.issue(name, common_name, organizations=orgs)
            self.kubeconfigs[name] = _write_kubeconfig(
                self.workdir / f"{name}.kubeconfig",
                self.server,
                self.ca.pair.cert,
                common_name,
                {"client-certificate": str(pair.cert), "client-key": str(pair.key)},
            )
        self.kubeconfig = self.kubeconfigs["admin"]
        self._admin_tls = ssl.create_default_context(cafile=str(self.ca.pair.cert))
        admin = self.pki_dir / "admin"
        self._admin_tls.load_cert_chain(f"{admin}.crt", f"{admin}.key")

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        etcd = self._spawn(
            "etcd",
            [
                str(binary_path("etcd")),
                "--name=kuberl-test",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=kuberl-test={peer}",
                # Throwaway data: skipping fsync makes every write much cheaper.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self.etcd_url = client
        _wait("etcd /health", lambda: _http_ok(f"{client}/health"), 30, [etcd])

    def _start_apiserver(self) -> None:
        sa = self.service_account_keys
        if self.real_nodes:
            # Pods reach the API server through the `kubernetes` Service, whose endpoint is the
            # advertised address in the namespace; it talks to kubelets as its own client.
            client = self.pki_dir / "apiserver-kubelet-client"
            network_flags = [
                "--bind-address=0.0.0.0",
                f"--advertise-address={realnodes.API_ADDRESS}",
                f"--kubelet-client-certificate={client}.crt",
                f"--kubelet-client-key={client}.key",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        else:
            network_flags = [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # 127.0.0.1 is not a valid Endpoints address; nothing here needs the
                # `kubernetes` Service's endpoints, so do not reconcile them.
                "--endpoint-reconciler-type=none",
            ]
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(binary_path("kube-apiserver")),
                f"--etcd-servers={self.etcd_url}",
                *network_flags,
                f"--secure-port={self.ports['apiserver']}",
                f"--cert-dir={self.pki_dir / 'apiserver-generated'}",
                f"--tls-cert-file={self.serving.cert}",
                f"--tls-private-key-file={self.serving.key}",
                f"--client-ca-file={self.ca.pair.cert}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
            ],
        )
        _wait("kube-apiserver /readyz", lambda: self._api_ok("/readyz"), 90, [apiserver], interval=0.2)

    def _create_kuberay_crds(self) -> None:
        # Straight to the API: a kubectl process per CRD costs seconds under load.
        for crd in kuberay_crds():
            self._api_create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    def _wait_kuberay_crds(self) -> None:
        for name in ("rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"):
            _wait(f"CRD {name} Established", lambda: self.crd_established(name), 90, self.processes)

    def _start_node_side(self) -> None:
        self._start_scheduler_and_kwok()
        self._add_nodes()

    def _start_controller_manager(self) -> None:
        kcm = self.kubeconfigs["controller-manager"]
        self._spawn(
            "kube-controller-manager",
            [
                str(binary_path("kube-controller-manager")),
                f"--kubeconfig={kcm}",
                f"--authentication-kubeconfig={kcm}",
                f"--authorization-kubeconfig={kcm}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['controller-manager']}",
                f"--cert-dir={self.pki_dir / 'controller-manager-generated'}",
                "--leader-elect=false",
                # Default-on controllers: garbage collector, serviceaccount,
                # serviceaccount-token, root-ca-cert-publisher, job, node lifecycle...
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.service_account_keys.key}",
                f"--root-ca-file={self.ca.pair.cert}",
                f"--cluster-signing-cert-file={self.ca.pair.cert}",
                f"--cluster-signing-key-file={self.ca.pair.key}",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ],
        )

    def _start_scheduler_and_kwok(self) -> None:
        sched = self.kubeconfigs["scheduler"]
        self._spawn(
            "kube-scheduler",
            [
                str(binary_path("kube-scheduler")),
                f"--kubeconfig={sched}",
                f"--authentication-kubeconfig={sched}",
                f"--authorization-kubeconfig={sched}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                f"--cert-dir={self.pki_dir / 'scheduler-generated'}",
                "--leader-elect=false",
            ],
        )
        self._spawn(
            "kwok",
            [
                str(binary_path("kwok")),
                f"--kubeconfig={self.kubeconfigs['kwok']}",
                f"--config={data_path('kwok')}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
                "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40",
            ],
        )

    def _add_nodes(self) -> None:
        zones = ["test-zone-a", "test-zone-b"]
        nodes = [fake_gpu_node(name, zones[i % len(zones)]) for i, name in enumerate(self.node_names)]
        for node in nodes:
            self._api_create("/api/v1/nodes", node)

    def _start_kuberay(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfigs["kuberay-operator"]))
        self._spawn(
            "kuberay-operator",
            [
                str(binary_path("kuberay-operator")),
                f"--metrics-addr=127.0.0.1:{self.ports['kuberay-metrics']}",
                f"--health-probe-bind-address=127.0.0.1:{self.ports['kuberay-probe']}",
                "--enable-leader-election=false",
                "--log-stdout-encoder=console",
            ],
            env=env,
        )

    def start_kueue(self) -> None:
        """Start Kueue (tests/harness/kueue.py) against this control plane, once: its CRDs, its
        webhooks on loopback, then the process, ready when its webhook server is up."""
        if any(p.name == "kueue" for p in self.processes):
            return
        if missing_components(["kueue"]):
            raise ClusterError("Kueue is not built: run `python -m tests.harness build kueue` first")
        for name in ("kueue-webhook", "kueue-health", "kueue-metrics"):
            self.ports[name] = unclaimed_port()
        ca_pem = self.ca.pair.cert.read_bytes()
        docs = kueue.manifests()
        crds = kueue.crds(docs, self.ports["kueue-webhook"], ca_pem)
        for crd in crds:
            self._api_create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        self._api_create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": kueue.NAMESPACE}})
        cert_dir = self.pki_dir / "kueue-webhook"
        cert_dir.mkdir(exist_ok=True)
        serving = self.ca.issue("kueue-webhook", "kueue-webhook", ip_addresses=("127.0.0.1",), server=True)
        shutil.copy(serving.cert, cert_dir / "tls.crt")
        shutil.copy(serving.key, cert_dir / "tls.key")
        self._kueue_metrics_certs(serving)
        config = self.workdir / "kueue-config.yaml"
        config.write_text(yaml.safe_dump(kueue.configuration(
            self.ports["kueue-webhook"], cert_dir, self.ports["kueue-health"], self.ports["kueue-metrics"])))
        # Served and discovered, not only Established: Kueue sets up its indexes at start and exits
        # on a kind its RESTMapper does not find ("no matches for kind Workload", seen once on a
        # loaded machine with the endpoint already served): the aggregated discovery document, which
        # the RESTMapper reads, is updated after the endpoint.
        for crd in crds:
            group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
            version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
            _wait(f"{plural}.{group}/{version} served and discovered",
                  lambda: self._api_ok(f"/apis/{group}/{version}/{plural}") and self._discovered(group, version, plural),
                  90, self.processes)
        process = self._spawn("kueue", [str(binary_path("kueue")), f"--config={config}", "--zap-log-level=info"],
                              env=dict(os.environ, KUBECONFIG=str(self.kubeconfigs["kueue"])))
        if self.network:  # real nodes: Kueue is in the cluster's network namespace; its probe is forwarded
            self._spawn("forward-kueue", [sys.executable, str(Path(__file__).with_name("forward.py")),
                                          self.network.path, str(self.ports["kueue-health"])], host=True)
        probe = f"http://127.0.0.1:{self.ports['kueue-health']}"
        _wait("Kueue /readyz (its webhook server)", lambda: _http_ok(f"{probe}/readyz"), 90, [process])
        # The webhooks go in once Kueue answers: before that, RayJob creations would fail on them.
        for webhook in kueue.webhook_configurations(docs, self.ports["kueue-webhook"], ca_pem):
            kind = webhook["kind"].lower() + "s"
            self._api_create(f"/apis/admissionregistration.k8s.io/v1/{kind}", webhook)

    @staticmethod
    def _kueue_metrics_certs(pair: pki.KeyPair) -> None:
        """Kueue's fixed metrics certificate path (kueue.METRICS_CERT_DIR), written once and
        atomically (a directory renamed into place): other sessions may start Kueue too."""
        target = kueue.METRICS_CERT_DIR
        if (target / "tls.crt").exists() and (target / "tls.key").exists():
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".certs-", dir=target.parent))
            shutil.copy(pair.cert, staging / "tls.crt")
            shutil.copy(pair.key, staging / "tls.key")
            staging.chmod(0o755)
            try:
                staging.rename(target)
            except OSError:  # another session put it there first
                shutil.rmtree(staging, ignore_errors=True)
        except PermissionError as err:
            raise ClusterError(f"Kueue needs a certificate at {target} (fixed in Kueue 0.17 when its own "
                               f"certificate management is off) and it cannot be written: {err}; create "
                               f"{target}/tls.crt and tls.key once as root (any key pair)") from err

    def _wait_ready(self) -> None:
        watch = list(self.processes)
        kcm_health = f"https://127.0.0.1:{self.ports['controller-manager']}/healthz"
        sched_health = f"https://127.0.0.1:{self.ports['scheduler']}/healthz"
        _wait("kube-controller-manager /healthz", lambda: _http_ok(kcm_health, insecure=True), 60, watch)
        _wait("kube-scheduler /healthz", lambda: _http_ok(sched_health, insecure=True), 60, watch)
        _wait("KWOK to report every node Ready", self._nodes_ready, 60, watch, interval=0.25)
        # The ServiceAccount admission plugin refuses pods until the
        # controller-manager has created the namespace's `default` account.
        _wait("ServiceAccount default/default", lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"), 60, watch)
        if self.with_kuberay:
            probe = f"http://127.0.0.1:{self.ports['kuberay-probe']}"
            _wait("KubeRay operator /readyz", lambda: _http_ok(f"{probe}/readyz") and _http_ok(f"{probe}/healthz"), 60, watch)

    def crd_established(self, name: str) -> bool:
        """True once CustomResourceDefinition `name` is Established (served)."""
        crd = self._api_get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = ((crd or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    def _nodes_ready(self) -> bool:
        return set(self.node_names) <= self._ready_nodes()

    # -- real nodes (tests/harness/nodes.py) ------------------------------------------

    def _make_network(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("real nodes need root (network namespace, cgroups, containerd)")
        missing = realnodes.host_tools_missing()
        if missing:
            raise ClusterError(f"real nodes need {', '.join(missing)}: `bash .ci/setup --tests` installs them")
        realnodes.clear_stale_sessions()
        self.network.create()
        # The host's tests reach every component's loopback port as without real nodes.
        ports = sorted(set(self.ports.values()))
        self._spawn("forward", [sys.executable, str(Path(__file__).with_name("forward.py")), self.network.path, *map(str, ports)], host=True)

    def _start_real_nodes(self) -> None:
        images.build(())
        self._saved_kernel_tunables = realnodes.read_kernel_tunables()
        self._stores = realnodes.NodeStores.claim(cache_dir())
        for node in self.real_nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            if self._stores:
                node.containerd_root = self._stores.root(node.name)
                self._stores.scrub(node, images.PAUSE_IMAGE, self.log_dir / f"containerd-scrub-{node.name}.log")
            self.session_cgroup.create(f"{node.cgroup}/runtime")
            config = node.write_containerd_config(images.PAUSE_IMAGE)
            containerd = self._spawn(
                f"containerd-{node.name}", ["containerd", f"--config={config}"],
                cgroup_procs=self.session_cgroup.procs_files(f"{node.cgroup}/runtime"),
            )
            _wait(f"containerd of {node.name}", lambda node=node: _ctr_ok(node), 60, [containerd], interval=0.2)
            if self._stores:
                present = set(subprocess.run([*node.ctr(), "-n", "k8s.io", "images", "ls", "-q"],
                                             capture_output=True, text=True, check=True).stdout.split())
                self._imported[node.name] = self._stores.imported(node.name, present)
            self._import([node], images.PAUSE_IMAGE, images.PAUSE_IMAGE)
        for i, node in enumerate(self.real_nodes):
            config = node.write_kubelet_config(self.session_cgroup.name, self.ca.pair.cert, self.ports[f"kubelet-healthz-{i}"])
            self._spawn(
                f"kubelet-{node.name}",
                [
                    str(binary_path("kubelet")),
                    f"--config={config}",
                    f"--kubeconfig={self.kubeconfigs[node.name]}",
                    f"--hostname-override={node.name}",
                    f"--node-ip={node.ip}",
                    f"--root-dir={node.directory / 'kubelet'}",
                    f"--node-labels={realnodes.REAL_NODE_LABEL}=true",
                    "--v=1",
                ],
            )
            # One at a time: every kubelet binds /var/lib/kubelet/device-plugins/kubelet.sock
            # (a fixed path, whatever --root-dir says), and two starting together can both find it
            # taken ("address already in use").
            healthz = f"http://127.0.0.1:{self.ports[f'kubelet-healthz-{i}']}/healthz"
            _wait(f"kubelet of {node.name} /healthz", lambda healthz=healthz: _http_ok(healthz), 60,
                  list(self.processes), interval=0.2)
        proxy_config = self.workdir / "kube-proxy.json"
        proxy_config.write_text(json.dumps(realnodes.kube_proxy_config(
            self.kubeconfigs["kube-proxy"], self.real_nodes[0].name,
            self.ports["kube-proxy-healthz"], self.ports["kube-proxy-metrics"])))
        self._spawn("kube-proxy", [str(binary_path("kube-proxy")), f"--config={proxy_config}", "--v=1"])
        corefile = self.workdir / "Corefile"
        corefile.write_text(realnodes.corefile(self.kubeconfigs["coredns"], self.ports["coredns-ready"], self.ports["coredns-health"]))
        self._spawn("coredns", [str(binary_path("coredns")), "-conf", str(corefile)])
        for obj in realnodes.kube_dns_objects():
            group = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
            self._api_create(f"{group}/namespaces/kube-system/{obj['kind'].lower()}s", obj)
        watch = list(self.processes)
        names = [node.name for node in self.real_nodes]
        _wait(f"real nodes {names} Ready", lambda: self._ready_nodes() >= set(names), 120, watch, interval=0.5)
        # kubelet has set the machine-wide kernel settings it wants by now; put back the host's.
        realnodes.restore_kernel_tunables(self._saved_kernel_tunables)
        ready = f"http://127.0.0.1:{self.ports['coredns-ready']}/ready"
        _wait("CoreDNS /ready", lambda: _http_ok(ready), 60, watch)
        proxy = f"http://127.0.0.1:{self.ports['kube-proxy-healthz']}/healthz"
        _wait("kube-proxy /healthz", lambda: _http_ok(proxy), 60, watch)

    def _import(self, nodes: list["realnodes.RealNode"], image: str, name: str) -> None:
        """Import podman's `image` into `nodes` as `name`, unless a node has it already. The node's
        superseded kuberl images (images.superseded) go before the import when it would not fit
        beside them (a new dependency layer: 13 GiB per node for worker-cpu), else after it, so that
        a code change, which adds only the small code layer, keeps the shared dependency layer
        rather than importing it again. The pause image is imported again if anything removed it."""
        held = {node.name: self._images_of(node) for node in nodes}
        for node in nodes:  # what a kubelet's eviction removed is imported again
            self._imported[node.name] = {n: source for n, source in self._imported[node.name].items()
                                         if n in held[node.name]}
        nodes = [node for node in nodes if self._imported[node.name].get(name) != image]
        if not nodes:
            return
        stale = {node.name: images.superseded(held[node.name], name) for node in nodes}
        if any(stale.values()) and not images.room_for_import(image, self._contents(nodes), nodes[0].root.parent):
            for node in nodes:
                self._remove_images(node, stale[node.name])
            stale = {node.name: [] for node in nodes}
        images.check_room_for_import(image, self._contents(nodes), nodes[0].root.parent)
        images.import_into([node.ctr() for node in nodes], image, name,
                           [self.log_dir / f"import-{node.name}.log" for node in nodes])
        for node in nodes:
            # `name` itself now names the new image; containerd collects the old one's layers.
            self._remove_images(node, [n for n in stale[node.name] if n != name])
            self._imported[node.name][name] = image
            if self._stores:
                self._stores.remember(node.name, self._imported[node.name])
        if name != images.PAUSE_IMAGE:
            self._import(nodes, images.PAUSE_IMAGE, images.PAUSE_IMAGE)

    @staticmethod
    def _images_of(node: "realnodes.RealNode") -> list[str]:
        return subprocess.run([*node.ctr(), "-n", "k8s.io", "images", "ls", "-q"], capture_output=True, text=True,
                              check=True).stdout.split()

    @staticmethod
    def _contents(nodes: list["realnodes.RealNode"]) -> list[set[str]]:
        """Each node's content digests (the layers an import need not write again)."""
        return [images.content_digests(node.ctr()) for node in nodes]

    def _remove_images(self, node: "realnodes.RealNode", names: list[str]) -> None:
        """Remove `names` from the node's containerd and wait for its garbage collection, so that
        their space is free when this returns."""
        if not names:
            return
        subprocess.run([*node.ctr(), "-n", "k8s.io", "images", "rm", "--sync", *names], capture_output=True, text=True,
                       check=True)
        for n in names:
            self._imported[node.name].pop(n, None)
        if self._stores:
            self._stores.remember(node.name, self._imported[node.name])

    def _nodes_named(self, node_names: list[str] | None) -> list["realnodes.RealNode"]:
        return [node for node in self.real_nodes if node_names is None or node.name in node_names]

    def load_images(self, names: tuple[str, ...] = images.NAMES, node_names: list[str] | None = None) -> dict[str, float]:
        """Build images/Dockerfile --target <name> (cached) and import each into the real nodes'
        containerd as ghcr.io/kuberl/<name>:<version>, into all nodes at once; returns seconds per
        step (build and import)."""
        times = {f"build {k}": v for k, v in images.build(names).items()}
        nodes = self._nodes_named(node_names)
        for name in names:
            began = time.monotonic()
            self._import(nodes, images.local_tag(name), images.public_name(name))
            times[f"import {name} into {len(nodes)} nodes"] = time.monotonic() - began
        return times

    def load_base(self, node_names: list[str] | None = None) -> str:
        """Import the local Debian base (python3, no kuberl) into the real nodes; returns its name."""
        images.build((), base=True)
        self._import(self._nodes_named(node_names), images.base_tag(), images.base_tag())
        return images.base_tag()

    def serve_in_network(self, name: str, argv: list[str], port: int, namespace: str, env: dict[str, str] | None = None) -> str:
        """Run `argv`, a server listening on 0.0.0.0:`port`, as a component inside the cluster's
        network namespace, behind a Service `name` in `namespace` (created if missing); returns
        the URL pods use. The host reaches it at 127.0.0.1:`port` (`port` must be free here).
        For servers the tests need in the cluster without an image of their own (an S3 server)."""
        address = self.network.add_service_address()
        self._spawn(name, argv, env=env)
        self._spawn(f"forward-{name}", [sys.executable, str(Path(__file__).with_name("forward.py")), self.network.path, str(port)], host=True)
        self.kubectl("create", "namespace", namespace, check=False)
        for obj in realnodes.external_service_objects(name, namespace, address, port):
            group = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
            self._api_create(f"{group}/namespaces/{namespace}/{obj['kind'].lower()}s", obj)
        _wait(f"{name} on 127.0.0.1:{port}", lambda: _tcp_ok(port), 60, self.processes)
        return f"http://{name}.{namespace}.svc.{realnodes.CLUSTER_DOMAIN}:{port}"

    def _stop_real_nodes(self) -> None:
        # Containers and containerd's shims outlive containerd: kill all that runs in the
        # session's cgroups, then drop the mounts, the node directories and the namespace.
        pod_namespaces = realnodes.pod_network_namespaces(self.session_cgroup.pids())
        self.session_cgroup.destroy()
        realnodes.remove_named_namespaces(pod_namespaces)
        realnodes.unmount_below(self.workdir)
        for node in self.real_nodes:
            for heavy in (node.directory / "containerd-root", node.state, node.directory / "kubelet"):
                shutil.rmtree(heavy, ignore_errors=True)
        if self._stores:
            self._stores.release()
        if self._saved_kernel_tunables:
            realnodes.restore_kernel_tunables(self._saved_kernel_tunables)
        self.network.delete()

    def _ready_nodes(self) -> set[str]:
        body = self._api_get("/api/v1/nodes")
        if body is None:
            return set()
        return {
            n["metadata"]["name"]
            for n in body["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in (n.get("status") or {}).get("conditions") or [])
        }

    # -- readiness helpers --------------------------------------------------------

    def _api_get(self, path: str, accept: str = "application/json") -> dict | None:
        request = urllib.request.Request(self.server + path, headers={"Accept": accept})
        try:
            with urllib.request.urlopen(request, context=self._admin_tls, timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            return None

    def _api_create(self, path: str, obj: dict) -> None:
        request = urllib.request.Request(
            self.server + path, data=json.dumps(obj).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, context=self._admin_tls, timeout=30):
                pass
        except urllib.error.HTTPError as err:
            name = obj.get("metadata", {}).get("name")
            raise ClusterError(f"creating {obj.get('kind')} {name}: HTTP {err.code}: {err.read().decode(errors='replace')}") from err

    def _discovered(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server's aggregated discovery (``/apis`` as APIGroupDiscoveryList, what
        client-go's RESTMapper reads) lists ``plural`` in ``group/version``."""
        discovery = self._api_get("/apis", accept="application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList")
        groups = (discovery or {}).get("items") or []
        return any(resource.get("resource") == plural
                   for listed in groups if listed.get("metadata", {}).get("name") == group
                   for listed_version in listed.get("versions") or [] if listed_version.get("version") == version
                   for resource in listed_version.get("resources") or [])

    def _api_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.server + path, context=self._admin_tls, timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    # -- what tests use --------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise ComponentExited if any component has died."""
        for process in self.processes:
            process.check_alive()

    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in self.processes}

    def pod_on_node(self, namespace: str, pod: str) -> "PodOnNode":
        """``pod``'s running containers on its real node, looked up now: to read what they write
        and to crash them from the host, without kubectl's or the kubelet's latency."""
        node_name = self.kubectl("get", "pod", pod, "-n", namespace, "-o", "jsonpath={.spec.nodeName}").stdout
        [node] = [n for n in self.real_nodes if n.name == node_name]
        ctr = [*node.ctr(), "-n", "k8s.io"]
        mine = f'labels."io.kubernetes.pod.name"=={pod},labels."io.kubernetes.pod.namespace"=={namespace}'
        ids = set(subprocess.run([*ctr, "containers", "ls", "-q", mine], capture_output=True, text=True,
                                 check=True).stdout.split())
        tasks = subprocess.run([*ctr, "tasks", "ls"], capture_output=True, text=True, check=True).stdout.splitlines()
        running = [task for task, _pid, status in (line.split()[:3] for line in tasks[1:])
                   if task in ids and status == "RUNNING"]
        assert running, f"pod {namespace}/{pod} has no running container on {node_name}"
        return PodOnNode(pod, ctr, [node.rootfs(task) for task in running], running)

    def api_client(self):
        """A `kubernetes` ApiClient authenticated as cluster admin (system:masters)."""
        if self._api_client is None:
            import kubernetes

            self._api_client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def _run_tool(self, tool: str, args: tuple[str, ...], input: str | None, check: bool, env: dict, timeout: float):
        argv = [str(binary_path(tool)), *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check and result.returncode != 0:
            raise ToolError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None, timeout: float = 120):
        """Run the built kubectl against this cluster (admin unless `kubeconfig` is given)."""
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or self.kubeconfig), KUBECACHEDIR=str(self.workdir / "kube-cache"))
        env.pop("KUBECTL_KUBERC", None)
        return self._run_tool("kubectl", args, input, check, env, timeout)

    def helm(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300):
        """Run the built helm against this cluster; its cache/config live in the session dir."""
        helm_home = self.workdir / "helm"
        env = dict(
            os.environ,
            KUBECONFIG=str(self.kubeconfig),
            HELM_CACHE_HOME=str(helm_home / "cache"),
            HELM_CONFIG_HOME=str(helm_home / "config"),
            HELM_DATA_HOME=str(helm_home / "data"),
        )
        return self._run_tool("helm", args, input, check, env, timeout)

    def service_account_kubeconfig(self, namespace: str, name: str, duration: str = "2h") -> Path:
        """A kubeconfig holding a TokenRequest token for ServiceAccount namespace/name.

        The account must exist; its rights are exactly what RBAC grants it,
        which is how an operator is run with a restricted identity.
        """
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        user = f"system:serviceaccount:{namespace}:{name}"
        return _write_kubeconfig(
            self.workdir / f"sa-{namespace}-{name}.kubeconfig", self.server, self.ca.pair.cert, user, {"token": token}
        )

    def client_for_service_account(self, namespace: str, name: str):
        """A `kubernetes` ApiClient acting as ServiceAccount namespace/name."""
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(self.service_account_kubeconfig(namespace, name)))


class PodOnNode:
    """A pod's running containers (the sandbox's too) on its real node, seen from the host."""

    def __init__(self, pod: str, ctr: list[str], roots: list[Path], tasks: list[str]):
        self.pod, self.ctr, self.roots, self.tasks = pod, ctr, roots, tasks

    def files(self, pattern: str) -> list[Path]:
        """The files matching ``pattern`` (a glob relative to a container's /) in any of them."""
        return [path for root in self.roots for path in root.glob(pattern)]

    def crash(self) -> None:
        """SIGKILL every process of the pod at once, its sandbox's too, as a node's crash would:
        no SIGTERM first, so nothing in it runs on (Ray's raylet drains its node on SIGTERM; a
        `kubectl delete --force` gives the SIGKILL 2 s after the SIGTERM). With the sandbox gone
        the kubelet would rebuild the pod from its init containers before it restarted anything:
        a deletion right after the crash cancels that."""
        kills = [subprocess.Popen([*self.ctr, "tasks", "kill", "--all", "--signal", "SIGKILL", task],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for task in self.tasks]
        for task, kill in zip(self.tasks, kills):
            out, _ = kill.communicate(timeout=60)
            # "not found": the task had ended (with the sandbox's, or on its own).
            assert kill.returncode == 0 or "not found" in out, f"SIGKILL of container {task} of pod {self.pod}: {out}"


def _tcp_ok(port: int) -> bool:
    """Something answers on 127.0.0.1:port (through a forwarder: a connection it keeps open)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.settimeout(0.5)
            try:
                return sock.recv(1, socket.MSG_PEEK) != b""  # b"": closed, nothing behind the forwarder
            except TimeoutError:
                return True  # open and silent: a server waiting for the request
    except OSError:
        return False


def _ctr_ok(node: "realnodes.RealNode") -> bool:
    return node.socket.exists() and subprocess.run([*node.ctr(), "version"], capture_output=True).returncode == 0


def _http_ok(url: str, insecure: bool = False) -> bool:
    # `insecure` only for the components' own self-signed serving certs on
    # loopback (their /healthz is readable anonymously).
    context = ssl._create_unverified_context() if insecure else None
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _install_signal_handlers(cluster: Cluster) -> None:
    """Stop the cluster on SIGTERM/SIGHUP, then let the signal do what it did before."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        previous = signal.getsignal(signum)

        def handler(sig, frame, previous=previous):
            cluster.stop()
            if callable(previous):
                previous(sig, frame)
            else:
                signal.signal(sig, signal.SIG_DFL if previous in (None, signal.SIG_DFL) else previous)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


__all__ = ["Cluster", "ClusterError", "ComponentExited", "ToolError", "fake_gpu_node", "kuberay_crds"]
