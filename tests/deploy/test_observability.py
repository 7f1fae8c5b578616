"""Prometheus, the alert rules, the Grafana dashboard and the HPA's metric: every PromQL expression
parses, and every metric and label it names exists in a live /metrics scrape of the CPU service."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import httpx
import pytest
from cloudcoil.models.prometheus_operator import v1 as monitoring

from service.config import Settings
from tests.deploy.common import (
    ALERTS,
    DASHBOARD,
    K8S,
    PROMETHEUS_CONFIG,
    PROMETHEUS_OWN,
    TARGET_LABELS,
    grouping_labels,
    load_yaml,
    load_yaml_all,
    scrape,
    selectors,
)
from tests.serverproc import ServerProcess

GRID_COLUMNS = 24  # Grafana's dashboard width
ADAPTER_VALUES = K8S / "prometheus-adapter-values.yaml"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable of the dashboard."""
    doc = dashboard()
    out = [(f"panel {p['title']!r} target {t['refId']}", t["expr"]) for p in doc["panels"] for t in p["targets"]]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"]
            assert query.startswith("label_values(") and query.endswith(")"), query
            inner = query[len("label_values("):-1].rsplit(",", 1)[0]  # label_values(<selector>, <label>)
            out.append((f"variable {var['name']}", inner))
    return out


def alert_queries() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]


def autoscaling_queries() -> list[tuple[str, str]]:
    """The HPA's Pods metrics (as selectors) and the adapter rule that serves them."""
    hpa = next(d for d in load_yaml_all(K8S / "hpa.yaml") if d["kind"] == "HorizontalPodAutoscaler")
    out = [(f"HPA metric {m['pods']['metric']['name']}", m["pods"]["metric"]["name"])
           for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    for rule in load_yaml(ADAPTER_VALUES)["rules"]["custom"]:
        out.append(("adapter seriesQuery", rule["seriesQuery"]))
    return out


ALL_QUERIES = dashboard_queries() + alert_queries() + autoscaling_queries()


# ---- static: syntax, structure, coverage ---------------------------------------------------------


@pytest.mark.parametrize("where,expr", ALL_QUERIES, ids=[w for w, _ in ALL_QUERIES])
def test_query_parses(where, expr):
    assert selectors(expr), f"{where}: no series selector in {expr!r}"


def test_alert_rules_validate_and_match_the_prometheusrule():
    groups = load_yaml(ALERTS)["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "alerts-yml"}, "spec": {"groups": groups}}
    back = monitoring.PrometheusRule.model_validate(doc).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert back == doc, "alerts.yml has fields a rule group does not know"
    (rule,) = load_yaml_all(K8S / "prometheusrule.yaml")
    assert rule["spec"]["groups"] == groups, "deploy/k8s/prometheusrule.yaml and deploy/prometheus/alerts.yml differ"
    for group in groups:
        for r in group["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning") and r["annotations"]["summary"], r["alert"]


def test_prometheus_config_loads_the_rules_and_scrapes_by_job():
    config = load_yaml(PROMETHEUS_CONFIG)
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / rule_file).is_file()
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    # The alerts' up{job=...} must name this job (the ServiceMonitor's job is the Service name, the same).
    assert f'up{{job="{job["job_name"]}"}}' in ALERTS.read_text()


def test_dashboard_covers_the_required_panels():
    used = {name for _, expr in dashboard_queries() for name, _ in selectors(expr)}
    required = {
        "request rate": {"moe_requests_total"},
        "latency": {"moe_request_duration_seconds_bucket"},
        "layer time by stage": {"moe_stage_seconds_sum", "moe_stage_seconds_count"},
        "exposed communication": {"moe_exposed_comm_seconds_sum"},
        "queue depth": {"moe_queued_tokens"},
        "batch tokens": {"moe_batch_tokens_bucket"},
        "restarts": {"moe_worker_restarts_total"},
    }
    for panel, names in required.items():
        assert names <= used, f"no {panel} panel: {names - used} unused"
    exprs = " ".join(expr for _, expr in dashboard_queries())
    assert "histogram_quantile(0.50" in exprs and "histogram_quantile(0.99" in exprs, "p50 and p99 latency"
    assert "sum by (status)" in exprs, "errors by code"
    assert "sum by (stage)" in exprs, "layer time by stage"


def test_dashboard_layout_and_datasource():
    doc = dashboard()
    assert doc["uid"] and doc["title"]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in doc["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']}: duplicate refId"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= GRID_COLUMNS, f"{p['title']} is outside the grid"
        cell = set(itertools.product(range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])))
        assert not cells & cell, f"{p['title']} overlaps another panel"
        cells |= cell


def test_hpa_metric_is_what_the_adapter_serves():
    names = [rule["name"]["as"] for rule in load_yaml(ADAPTER_VALUES)["rules"]["custom"]]
    for where, metric in autoscaling_queries():
        if where.startswith("HPA"):
            assert metric in names, f"{where}: prometheus-adapter serves only {names}"


# ---- live: names against a scrape of the running service -----------------------------------------


@pytest.fixture(scope="module")
def live_series(tmp_path_factory) -> dict[str, set[str]]:
    """Sample name -> label names from /metrics of `moe-serve` on the CPU, after one request (the
    labelled histograms have no series before their first observation)."""
    log = tmp_path_factory.mktemp("live") / "moe-serve.log"
    script = Path(sys.executable).parent / "moe-serve"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "service"]
    env = ServerProcess.loopback_env({**os.environ, "MOE_DEVICE": "cpu"})
    server = ServerProcess(cmd, log, env=env)
    try:
        server.wait_ready()
        model = Settings.model_fields["model_name"].default
        meta = httpx.get(f"{server.url}/v2/models/{model}", timeout=10).json()
        shapes = {t["name"]: t["shape"] for t in meta["inputs"]}
        H, K = shapes["hidden_states"][1], shapes["topk_ids"][1]
        T = 3
        body = {"hidden_states": [[0.01 * (t + 1) * (h % 7 - 3) for h in range(H)] for t in range(T)],
                "topk_ids": [[k for k in range(K)] for _ in range(T)],
                "topk_weights": [[1.0 / K] * K for _ in range(T)]}
        response = httpx.post(f"{server.url}/moe/forward", json=body, timeout=60)
        assert response.status_code == 200, response.text
        yield scrape(f"{server.url}/metrics")
    finally:
        code = server.stop()
    assert code == 0, f"moe-serve did not stop cleanly on SIGTERM:\n{server.log()[-3000:]}"


@pytest.mark.parametrize("where,expr", ALL_QUERIES, ids=[w for w, _ in ALL_QUERIES])
def test_query_names_only_exported_metrics_and_labels(live_series, where, expr):
    for name, labels in selectors(expr):
        if name in PROMETHEUS_OWN:
            continue
        assert name in live_series, f"{where}: {name} is not in /metrics (it has {sorted(live_series)})"
        unknown = labels - live_series[name] - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label {sorted(unknown)} (it has {sorted(live_series[name])})"
    known = set(TARGET_LABELS)
    for name, _ in selectors(expr):
        known |= live_series.get(name, set())
    missing = grouping_labels(expr) - known
    assert not missing, f"{where}: groups by labels the series lack: {sorted(missing)}"
