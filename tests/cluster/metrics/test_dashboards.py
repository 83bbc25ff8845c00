"""Every PromQL expression in the shipped Grafana dashboards returns finite data from a real
Prometheus server that scrapes the real operator (installed with the chart, run under its
ServiceAccount) and two worker exporters (trainer and rollout). That each parses:
tests/engine/metrics/test_dashboard_expressions.py; that the promised panels have one:
tests/unit/metrics/test_dashboard_json.py."""

from __future__ import annotations

import time

import pytest

from tests.cluster.chart.release import install, uninstall
from tests.harness.harness import REPO_ROOT
from tests.harness.helpers import wait_for
from tests.shared.prometheus import (DASHBOARDS, PrometheusServer, dashboard_queries, finite_values,
                                      promql_of_label_values, substitute, template_variables)

JOB, OPERATOR_SCRAPE_JOB = "grpo-tiny-cpu", "kuberl-operator"
# Grafana's $__rate_interval is at least four scrape intervals; the test scrapes every second.
RATE_INTERVAL = "20s"
QUERIES = dashboard_queries()


@pytest.mark.cluster
def test_every_dashboard_expression_returns_data_from_real_prometheus(k8s_cluster, prometheus_binaries, worker_feeds,
                                                                     tmp_path):
    prometheus_bin, promtool = prometheus_binaries
    # Resync every 2 s so the operator reconciles (and observes its latency histogram) continuously.
    release = install(k8s_cluster, tmp_path, "--set", "operator.resyncSeconds=2")
    prometheus = None
    try:
        k8s_cluster.kubectl("apply", "-n", release.watched, "-f", str(REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml"))
        feeds = [worker_feeds(JOB, release.watched, "trainer", 0), worker_feeds(JOB, release.watched, "rollout", 0)]
        prometheus = PrometheusServer(prometheus_bin, promtool, tmp_path, [
            {"job_name": OPERATOR_SCRAPE_JOB,
             "static_configs": [{"targets": [f"127.0.0.1:{release.operator.metrics_port}"]}]},
            # As the chart's PodMonitor: the worker's job/namespace labels win over the scrape job's.
            {"job_name": "kuberl-workers", "honor_labels": True,
             "static_configs": [{"targets": [f.target for f in feeds]}]},
        ]).start()
        wait_for("Prometheus to scrape all three targets",
                 lambda: (up := prometheus.targets_up()) and len(up) == 3 and set(up.values()) == {"up"}, k8s_cluster)

        variables = {"operator_job": OPERATOR_SCRAPE_JOB, "__rate_interval": RATE_INTERVAL}
        for path in DASHBOARDS:
            for name, query in template_variables(path).items():
                promql, label = promql_of_label_values(query)
                result = prometheus.query(substitute(promql, {**variables, "namespace": release.watched}))
                assert result["status"] == "success", result
                offered = {r["metric"][label] for r in result["data"]["result"]}
                expected = {"namespace": release.watched, "job": JOB, "operator_job": OPERATOR_SCRAPE_JOB}[name]
                assert expected in offered, f"{path.name} variable ${name} offers {offered}"
        variables.update(namespace=release.watched, job=JOB)

        def without_data() -> list[str]:
            empty = []
            for query in QUERIES:
                expr = substitute(query.expr, variables)
                result = prometheus.query(expr)
                assert result["status"] == "success", f"{query.dashboard} / {query.panel}: {expr}\n{result}"
                if not finite_values(result):
                    empty.append(f"{query.dashboard} / {query.panel}: {expr} -> {result['data']['result']}")
            return empty

        # rate() needs two samples inside RATE_INTERVAL and the checkpoint panels a first checkpoint
        # (every 10 steps of 0.2 s): poll until every panel has data rather than sleep a guess.
        deadline = time.monotonic() + 90
        while (empty := without_data()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not empty, "dashboard queries without finite data:\n" + "\n".join(empty)

        # Spot-check that the data is the real operator's and worker's, not just present.
        running = prometheus.query('sum(kuberl_operator_jobs)')
        assert finite_values(running) == [1.0]
        mfu = prometheus.query(substitute(f'avg(kuberl_train_mfu_ratio{{namespace="$namespace", job="$job"}})', variables))
        assert finite_values(mfu) == [0.35]
    finally:
        if prometheus is not None:
            prometheus.stop()
        uninstall(k8s_cluster, release)
