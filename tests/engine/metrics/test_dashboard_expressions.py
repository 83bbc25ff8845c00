"""Every PromQL expression in the shipped Grafana dashboards parses (promtool, offline); that each
returns data from a real Prometheus: tests/cluster/metrics/test_dashboards.py."""

from __future__ import annotations

from tests.shared.prometheus import (DASHBOARDS, check_rules_file, dashboard_queries, promql_of_label_values,
                                      substitute, template_variables)

JOB, OPERATOR_SCRAPE_JOB = "grpo-tiny-cpu", "kuberl-operator"
QUERIES = dashboard_queries()


def test_every_dashboard_expression_parses(prometheus_binaries, tmp_path):
    _, promtool = prometheus_binaries
    values = {"namespace": "team-a", "job": JOB, "operator_job": OPERATOR_SCRAPE_JOB, "__rate_interval": "1m"}
    exprs = {f"{q.dashboard}: {q.panel}": substitute(q.expr, values) for q in QUERIES}
    for path in DASHBOARDS:
        for query in template_variables(path).values():
            exprs[f"{path.name}: variable"] = substitute(promql_of_label_values(query)[0], values)
    result = check_rules_file(promtool, exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
