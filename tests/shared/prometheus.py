"""A real Prometheus server (built from its Go module with the cluster components) for tests, and the
PromQL of the shipped Grafana dashboards with their template variables substituted."""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from kuberl.common.ports import unclaimed_port

from tests.harness.components import binary_path, is_built
from tests.harness.harness import REPO_ROOT

DASHBOARDS = sorted((REPO_ROOT / "charts" / "kuberl" / "dashboards").glob("*.json"))
MISSING = ("the real Prometheus server is not built: `python -m tests.harness build prometheus promtool` "
           "(or .ci/setup) builds it from its Go module into ~/.cache/kuberl/bin")


def binaries() -> tuple[str, str] | None:
    """(prometheus, promtool) when built (tests/harness/components.py pins their version)."""
    if not (is_built("prometheus") and is_built("promtool")):
        return None
    return str(binary_path("prometheus")), str(binary_path("promtool"))


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str


def dashboard_queries() -> list[Query]:
    """Every PromQL target of every panel (Grafana template variables left in)."""
    queries = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries.append(Query(path.name, panel["title"], target["expr"]))
    return queries


def template_variables(path: Path) -> dict[str, str]:
    """name -> query of the dashboard's `query` variables (Grafana's label_values(...) syntax)."""
    board = json.loads(path.read_text())
    return {v["name"]: v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"}


def substitute(expr: str, values: dict[str, str]) -> str:
    # Longest names first so $job never eats the start of a longer $job_... name.
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${name}", values[name])
    assert "$" not in expr, f"unsubstituted template variable in {expr!r}"
    return expr


def promql_of_label_values(query: str) -> tuple[str, str]:
    """Grafana's `label_values(selector, label)` as (PromQL, label): `group by (label) (selector)`."""
    assert query.startswith("label_values(") and query.endswith(")"), query
    selector, label = query[len("label_values("):-1].rsplit(",", 1)
    return f"group by ({label.strip()}) ({selector.strip()})", label.strip()


def check_rules_file(promtool: str, exprs: dict[str, str], workdir: Path) -> subprocess.CompletedProcess:
    """Parse expressions offline with `promtool check rules` (as recording rules)."""
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"kuberl:dashboard:{i}", "expr": e}
                                                          for i, e in enumerate(exprs.values())]}]}
    path = workdir / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


class PrometheusServer:
    """`prometheus` with a generated config scraping static loopback targets every second."""

    def __init__(self, binary: str, promtool: str, workdir: Path, scrape_configs: list[dict]) -> None:
        self.workdir, self.port = workdir, unclaimed_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": scrape_configs}))
        checked = subprocess.run([promtool, "check", "config", str(self.config)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        self.binary, self.log_path, self.proc = binary, workdir / "prometheus.log", None

    def command(self, listen: str) -> list[str]:
        """The server's command line, listening on `listen` (host:port)."""
        return [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address={listen}"]

    def start(self, timeout: float = 60) -> "PrometheusServer":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(f"127.0.0.1:{self.port}"), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.2)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:  # 400 bad_data: the body says why
            return json.loads(err.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def targets_up(self) -> dict[str, str]:
        active = self.api("targets")["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] for t in active}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def finite_values(result: dict) -> list[float]:
    """The finite sample values of an instant-query vector/scalar result."""
    data = result["data"]
    samples = [data["result"]] if data["resultType"] == "scalar" else [r["value"] for r in data["result"]]
    return [v for v in (float(s[1]) for s in samples) if math.isfinite(v)]
