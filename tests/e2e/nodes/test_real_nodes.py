"""Real pods on real nodes: containerd + runc + CNI under a kubelet of the API server's release,
kube-proxy and CoreDNS, all inside the cluster's own network namespace (tests/harness/nodes.py).
The pods run the local Debian base image the harness builds (tests/harness/images.py)."""

from __future__ import annotations

import uuid

import psutil
import pytest

from tests.harness.components import KUBERNETES_VERSION
from tests.harness.helpers import apply, get_json, wait_for
from tests.harness.nodes import CLUSTER_DOMAIN, REAL_NODE_LABEL

pytestmark = [pytest.mark.cluster, pytest.mark.real_nodes]


@pytest.fixture(scope="module")
def base_image(real_cluster) -> str:
    return real_cluster.load_base()


@pytest.fixture
def real_namespace(real_cluster):
    name = f"t-{uuid.uuid4().hex[:10]}"
    real_cluster.kubectl("create", "namespace", name)
    wait_for(
        f"ServiceAccount {name}/default",
        lambda: real_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        real_cluster,
    )
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod(name: str, image: str, node: str, containers: list[dict], init: list[dict] = (), **spec) -> dict:
    defaults = {"image": image, "imagePullPolicy": "Never"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "initContainers": [dict(defaults, **c) for c in init],
            "containers": [dict(defaults, **c) for c in containers],
            **spec,
        },
    }


def phase(cluster, namespace: str, name: str) -> str:
    return get_json(cluster, "pod", name, "-n", namespace).get("status", {}).get("phase", "")


def wait_succeeded(cluster, namespace: str, name: str, timeout: float = 180) -> None:
    def done():
        current = phase(cluster, namespace, name)
        if current == "Failed":
            raise AssertionError(cluster.kubectl("describe", "pod", name, "-n", namespace).stdout)
        return current == "Succeeded"

    wait_for(f"pod {namespace}/{name} Succeeded", done, cluster, timeout=timeout, interval=1)


def test_real_nodes_ready_with_containerd_and_kubelet_of_the_release(real_cluster):
    nodes = get_json(real_cluster, "nodes", "-l", f"{REAL_NODE_LABEL}=true")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == [n.name for n in real_cluster.real_nodes]
    for node in nodes:
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == KUBERNETES_VERSION
        assert info["containerRuntimeVersion"].startswith("containerd://1.6.")
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] in real_cluster.network.node_ips


def test_pod_with_an_init_container_runs_to_completion_and_both_logs_show(real_cluster, real_namespace, base_image):
    node = real_cluster.real_nodes[0].name
    apply(real_cluster, pod(
        "init-and-main", base_image, node,
        init=[{"name": "prepare", "command": ["sh", "-c", "echo prepared by init > /shared/msg; echo init says hello"],
               "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
        containers=[{"name": "main", "command": ["sh", "-c", "cat /shared/msg; echo main says hello"],
                     "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
        volumes=[{"name": "shared", "emptyDir": {}}],
    ), "-n", real_namespace)
    wait_succeeded(real_cluster, real_namespace, "init-and-main")
    init_log = real_cluster.kubectl("logs", "init-and-main", "-c", "prepare", "-n", real_namespace).stdout
    main_log = real_cluster.kubectl("logs", "init-and-main", "-c", "main", "-n", real_namespace).stdout
    assert init_log.strip() == "init says hello"
    assert main_log.split("\n")[:2] == ["prepared by init", "main says hello"]


SERVER = """
import http.server, socket
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {socket.gethostname()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8080), Handler).serve_forever()
"""

CLIENT = """
import sys, time, urllib.request
url = sys.argv[1]
for attempt in range(60):
    try:
        print(urllib.request.urlopen(url, timeout=5).read().decode()); break
    except OSError as err:
        print("retry:", err, file=sys.stderr); time.sleep(1)
else:
    sys.exit(1)
"""


def test_a_pod_reaches_a_pod_on_the_other_node_through_a_service_dns_name(real_cluster, real_namespace, base_image):
    server_node, client_node = (n.name for n in real_cluster.real_nodes[:2])
    apply(real_cluster, [
        pod("web", base_image, server_node, containers=[{"name": "web", "command": ["python3", "-c", SERVER],
                                                          "ports": [{"containerPort": 8080}]}]),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}},
    ], "-n", real_namespace)
    url = f"http://web.{real_namespace}.svc.cluster.local/"
    apply(real_cluster, pod("client", base_image, client_node,
                            containers=[{"name": "client", "command": ["python3", "-c", CLIENT, url]}]),
          "-n", real_namespace)
    wait_succeeded(real_cluster, real_namespace, "client")
    log = real_cluster.kubectl("logs", "client", "-n", real_namespace).stdout
    # The last line: before it, "retry: ..." lines while the server was still starting.
    assert log.strip().splitlines()[-1] == "hello from web", log
    pods = {p["metadata"]["name"]: p for p in get_json(real_cluster, "pods", "-n", real_namespace)["items"]}
    assert pods["web"]["spec"]["nodeName"] != pods["client"]["spec"]["nodeName"]
    assert pods["web"]["status"]["podIP"].startswith("10.244.")


def test_on_the_host_the_cluster_listens_only_on_loopback(real_cluster):
    """Every component but the port forwarder runs in the cluster's namespace; on the host's
    network the session's processes listen on 127.0.0.1 only."""
    ours = {p.pid for p in real_cluster.processes if p.pid}
    listening = [
        c for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    assert listening, "the forwarder should listen on the host's loopback"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
    forward = next(p for p in real_cluster.processes if p.name == "forward")
    assert {c.pid for c in listening} == {forward.pid}
    # The API server answers on its forwarded port, from the host.
    assert real_cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_components_in_the_namespace_resolve_services_through_the_hosts_resolv_conf(real_cluster):
    """KubeRay's operator reaches a RayJob's head Service by its DNS name, as in a real cluster
    where it runs as a pod: its lookups (to the host's name servers) are answered by CoreDNS."""
    import subprocess

    from tests.harness.nodes import host_resolvers

    assert host_resolvers(), "this machine's /etc/resolv.conf names no IPv4 name server to stand in for"
    name = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"
    out = subprocess.run(["ip", "netns", "exec", real_cluster.network.name, "getent", "hosts", name],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[0] == "10.0.0.1", out
