"""The built Helm v3 (from the cluster harness's Go build) run offline: lint and template need no
cluster. Its cache/config live in a per-session temp dir so runs never touch ~/.config/helm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.harness.build import GoToolchainError, build, missing_components
from tests.harness.components import binary_path
from tests.harness.harness import REPO_ROOT

CHART = REPO_ROOT / "charts" / "kuberl"


class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        self.env = dict(os.environ, HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
                        HELM_DATA_HOME=str(home / "data"))
        self.env.pop("KUBECONFIG", None)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def template(self, *args: str) -> list[dict]:
        """`helm template` of the chart as a list of objects (release `kuberl`, namespace kuberl-system)."""
        out = self.run("template", "kuberl", str(CHART), "--namespace", "kuberl-system", *args).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    if missing_components(["helm"]):
        try:
            build(["helm"])
        except GoToolchainError as err:
            pytest.skip(f"helm is built from Go modules by the cluster harness and Go is unavailable: {err}")
    return Helm(binary_path("helm"), tmp_path_factory.mktemp("helm"))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran the operator shows the operator's log."""
    outcome = yield
    report = outcome.get_result()
    release = getattr(item, "funcargs", {}).get("release")
    if report.when == "call" and report.failed and release is not None:
        report.sections.append(("kuberl operator log", release.operator.tail()))
