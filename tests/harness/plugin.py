"""pytest plugin: a session-scoped real control plane (`k8s_cluster`), and one with real
nodes (`real_cluster`: containerd + kubelet, kube-proxy, CoreDNS; tests/harness/nodes.py).

Enable with `pytest_plugins = ["tests.harness.plugin"]` in tests/conftest.py
and mark tests that use it with `@pytest.mark.cluster`. The first test that
asks for `k8s_cluster` builds missing components (skipping only when Go is
missing; a failed build fails loudly) and starts the cluster once; it is
stopped at the end of the session. When a test that used it fails, the
report lists every component's log file. Tests on real nodes are marked
`real_nodes` (run them alone with `pytest -m real_nodes`); they skip where
real nodes cannot run (not root, or Debian's containerd, runc, CNI plugins,
podman or debootstrap missing: `bash .ci/setup --tests` installs them).
"""

from __future__ import annotations

import pytest

import os

from tests.early_stop import stop_after_last_user
from tests.harness.build import GoToolchainError, build, missing_components
from tests.harness.harness import Cluster
from tests.harness.nodes import host_tools_missing

_session_clusters: dict[str, Cluster] = {}
# Two real nodes, so that pods are really apart; no KWOK nodes, so that every pod runs for real.
REAL_NODES = 2


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: needs the real Kubernetes control plane (fixture k8s_cluster)")
    config.addinivalue_line("markers", "real_nodes: runs real pods on real nodes (fixture real_cluster)")


def _build_or_skip() -> None:
    if missing_components():
        try:
            build()
        except GoToolchainError as err:
            pytest.skip(f"real Kubernetes control plane unavailable: {err}")


@pytest.fixture(scope="session")
def k8s_cluster():
    _build_or_skip()
    cluster = Cluster()
    cluster.start()
    _session_clusters["k8s_cluster"] = cluster
    stop_after_last_user("k8s_cluster", cluster.stop)  # before the e2e tier's real nodes start
    try:
        yield cluster
    finally:
        cluster.stop()
        del _session_clusters["k8s_cluster"]


@pytest.fixture(scope="session")
def kueue(k8s_cluster):
    """Kueue (its RayJob integration; tests/harness/kueue.py) on the session's control plane,
    started by the first test that asks for it and stopped with the cluster."""
    try:
        build(["kueue"])
    except GoToolchainError as err:
        pytest.skip(f"Kueue unavailable: {err}")
    k8s_cluster.start_kueue()
    return k8s_cluster


@pytest.fixture(scope="session")
def real_cluster():
    """A cluster whose nodes are real: pods run in containers (images: `real_cluster.load_images`)."""
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (network namespace, cgroups, containerd)")
    missing = host_tools_missing()
    if missing:
        pytest.skip(f"real nodes need {', '.join(missing)}: `bash .ci/setup --tests` installs them")
    _build_or_skip()
    cluster = Cluster(nodes=0, real_nodes=REAL_NODES)
    cluster.start()
    _session_clusters["real_cluster"] = cluster
    try:
        yield cluster
    finally:
        cluster.stop()
        del _session_clusters["real_cluster"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for fixture, cluster in _session_clusters.items():
        if fixture not in getattr(item, "fixturenames", ()):
            continue
        lines = [f"{name:24s} {path}" for name, path in cluster.logs().items()]
        dead = [p.name for p in cluster.processes if p.exited() is not None]
        if dead:
            lines.append(f"components no longer running: {', '.join(dead)}")
        report.sections.append((f"kuberl cluster logs ({fixture})", "\n".join(lines)))
