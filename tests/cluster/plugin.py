"""pytest plugin: a session-scoped real control plane (`k8s_cluster`).

Enable with `pytest_plugins = ["tests.cluster.plugin"]` in tests/conftest.py
and mark tests that use it with `@pytest.mark.cluster`. The first test that
asks for `k8s_cluster` builds missing components (skipping only when Go is
missing; a failed build fails loudly) and starts the cluster once; it is
stopped at the end of the session. When a test that used it fails, the
report lists every component's log file.
"""

from __future__ import annotations

import pytest

from tests.cluster.build import GoToolchainError, build, missing_components
from tests.cluster.harness import Cluster

_session_cluster: Cluster | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: needs the real Kubernetes control plane (fixture k8s_cluster)")


@pytest.fixture(scope="session")
def k8s_cluster():
    global _session_cluster
    if missing_components():
        try:
            build()
        except GoToolchainError as err:
            pytest.skip(f"real Kubernetes control plane unavailable: {err}")
    cluster = Cluster()
    cluster.start()
    _session_cluster = cluster
    try:
        yield cluster
    finally:
        cluster.stop()
        _session_cluster = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _session_cluster is not None and "k8s_cluster" in getattr(item, "fixturenames", ()):
        lines = [f"{name:24s} {path}" for name, path in _session_cluster.logs().items()]
        dead = [p.name for p in _session_cluster.processes if p.exited() is not None]
        if dead:
            lines.append(f"components no longer running: {', '.join(dead)}")
        report.sections.append(("kuberl cluster logs", "\n".join(lines)))
