"""The shipped Grafana dashboards are well-formed for import: unique uids and panel ids, panels
that fit the 24-column grid without overlapping, a datasource variable every query uses, and
template variables that are defined before they are used."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness.harness import REPO_ROOT
from tests.shared.prometheus import DASHBOARDS, dashboard_queries, template_variables

BOARDS = {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def test_uids_are_unique_and_stable():
    assert sorted(b["uid"] for b in BOARDS.values()) == ["kuberl-overview", "kuberl-training"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_fit_the_grid_without_overlap(name):
    panels = BOARDS[name]["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & mine, f"{name}: panel {panel['title']!r} overlaps another"
        cells |= mine


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_queries_use_the_datasource_variable_and_defined_variables(name):
    board = BOARDS[name]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in variables
    grafana_builtins = {"__rate_interval", "__interval", "__range"}
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= variables | grafana_builtins, f"{panel['title']}: undefined {used - variables - grafana_builtins}"
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # A variable may only use variables listed before it (Grafana resolves them in order).
            earlier = [v["name"] for v in board["templating"]["list"]]
            earlier = set(earlier[:earlier.index(variable["name"])])
            assert set(re.findall(r"\$(\w+)", variable["query"]["query"])) <= earlier


def test_dashboards_have_queries_for_every_promised_panel():
    titles = {(q.dashboard, q.panel) for q in dashboard_queries()}
    assert {t for d, t in titles if d == "overview.json"} >= {
        "Jobs by phase", "Failed jobs", "RayJob restarts (1h)", "Reconcile latency", "Reconcile errors per second",
        "GPU-hours by job and role"}
    assert {t for d, t in titles if d == "training.json"} >= {
        "Reward", "KL to reference", "Loss", "Gradient norm", "Skipped steps", "Training throughput", "MFU",
        "Rollout throughput", "Weight sync time", "Weight sync bandwidth", "Last checkpoint time",
        "Last checkpoint size", "Staging bandwidth", "Recoveries", "Recovery time"}
    assert set(template_variables(REPO_ROOT / "charts/kuberl/dashboards/training.json")) == {"namespace", "job"}
