"""deploy/grafana/expertmesh-dashboard.json: a valid Grafana dashboard whose
queries use only the metric names expertmesh exports (the router's and the
orchestrator's health gauges), each of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from expertmesh.infra.telemetry import ORCHESTRATOR_PROMETHEUS_METRICS, PROMETHEUS_METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "expertmesh-dashboard.json"
METRICS = PROMETHEUS_METRICS | ORCHESTRATOR_PROMETHEUS_METRICS


PROMQL_WORDS = {
    # functions and aggregations the dashboard may use
    "rate",
    "irate",
    "increase",
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "topk",
    "bottomk",
    "quantile",
    "histogram_quantile",
    "scalar",
    "vector",
    "clamp_min",
    "clamp_max",
    "label_values",
    "abs",
    # modifiers
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
}


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def _queries(dashboard):
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query if isinstance(query, str) else query["query"]


def _identifiers(expr: str) -> set[str]:
    """Names in a PromQL expression that are neither label matchers, label lists, ranges, strings nor numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)  # label lists
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"label_values(\1)", expr)
    return set(re.findall(r"(?<![\w.$])[a-zA-Z_:][\w:]*", expr))


def test_is_a_grafana_dashboard_with_a_prometheus_datasource_variable(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_panel_ids_are_unique_and_panels_fit_the_grid(dashboard):
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]


def test_queries_use_only_expertmesh_metrics(dashboard):
    used = set()
    for title, expr in _queries(dashboard):
        names = _identifiers(expr)
        unknown = names - METRICS - PROMQL_WORDS
        assert not unknown, f"{title}: {expr!r} uses {unknown}"
        assert names & METRICS, f"{title}: {expr!r} reads no expertmesh metric"
        used |= names & METRICS
    assert used == METRICS, f"metrics without a panel: {METRICS - used}"


def test_the_identifier_check_catches_a_stray_metric():
    assert _identifiers('sum by (le) (rate(http_requests_total{job="x"}[5m]))') == {
        "sum",
        "by",
        "rate",
        "http_requests_total",
    }


def test_required_panels_are_there(dashboard):
    titles = " | ".join(panel["title"].lower() for panel in _panels(dashboard))
    for words in (
        "load",
        "balancedness",
        "entropy",
        "group call latency",
        "queue depth",
        "request latency",
        "time to first token",
        "inter-token latency",
        "errors",
        "active parameters",
        "top-1 gate probability",
        "top-1 / top-2 margin",
        "expert health",
        "kl divergence",
        "not healthy",
    ):
        assert words in titles, words
    exprs = " ".join(expr for _, expr in _queries(dashboard))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
