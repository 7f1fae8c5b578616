"""The alert rules under `promtool test rules` (deploy/prometheus/alerts.test.yml): every alert
fires on the series that should raise it and stays quiet on a healthy replica, and the down alert
also fires when the target is gone altogether; a dashboard query evaluated the same way. promtool
comes from Debian's prometheus package (`.ci/install-tools`); in CI a missing promtool fails these
tests."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.deploy.common import ALERTS, COMPOSE, DASHBOARD, DEPLOY, K8S, duration_s, load_yaml, load_yaml_all
from tests.helpers import external_tool

RULE_TESTS = ALERTS.parent / "alerts.test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([external_tool("promtool"), *args], capture_output=True, text=True, timeout=120)


def test_rules_check():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr


def test_rule_unit_tests_pass():
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_tested_firing_and_quiet():
    alerts = {r["alert"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}
    fired, quiet = set(), set()
    for case in load_yaml(RULE_TESTS)["tests"]:
        for t in case["alert_rule_test"]:
            (fired if t["exp_alerts"] else quiet).add(t["alertname"])
    assert alerts <= fired, f"never expected to fire: {sorted(alerts - fired)}"
    assert alerts <= quiet, f"never expected to stay quiet: {sorted(alerts - quiet)}"


def test_the_absent_target_case_catches_a_down_alert_without_absent(tmp_path):
    """The unit tests are not vacuous: with the down alert as it was (`up == 0` only, which never
    fires when the target is gone), promtool fails them."""
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    text = ALERTS.read_text()
    old = 'up{job="moe-serve"} == 0 or absent(up{job="moe-serve"})'
    assert old in text
    (tmp_path / ALERTS.name).write_text(text.replace(old, 'up{job="moe-serve"} == 0'))
    r = promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert r.returncode != 0 and "MoeServeDown" in r.stdout + r.stderr, r.stdout + r.stderr


def startup_budgets_s() -> dict[str, float]:
    """How long each shipped deployment lets a start take before it calls the process broken."""
    budgets = {"compose healthcheck": duration_s(load_yaml(COMPOSE)["services"]["moe-serve"]["healthcheck"]
                                                 ["start_period"])}
    (deployment,) = [d for d in load_yaml_all(K8S / "deployment.yaml") if d["kind"] == "Deployment"]
    runtime = load_yaml(DEPLOY / "kserve" / "servingruntime.yaml")
    for name, container in (("k8s", deployment["spec"]["template"]["spec"]["containers"][0]),
                            ("kserve", runtime["spec"]["containers"][0])):
        probe = container["startupProbe"]
        budgets[f"{name} startup probe"] = probe["periodSeconds"] * probe["failureThreshold"]
    return budgets


def test_not_ready_never_pages_within_a_start():
    """Before: MoeServeNotReady (critical) fired after 5 minutes not ready, yet a start may take 600 s
    (MOE_START_TIMEOUT_S 300 s and the warm-up; the startup probe allows that): normal starts paged.
    Its `for` must outlast every start budget shipped, with a scrape interval of slack."""
    (rule,) = [r for g in load_yaml(ALERTS)["groups"] for r in g["rules"] if r.get("alert") == "MoeServeNotReady"]
    scrape_s = duration_s(load_yaml(DEPLOY / "prometheus" / "prometheus.yml")["global"]["scrape_interval"])
    for name, budget in startup_budgets_s().items():
        assert duration_s(rule["for"]) >= budget + scrape_s, f"MoeServeNotReady pages within the {name}'s {budget} s"


def panel_expr(title: str) -> str:
    """A dashboard panel's query as Prometheus gets it: every replica, a 5-minute rate window."""
    (panel,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    (target,) = panel["targets"]
    return target["expr"].replace("$instance", ".*").replace("$__rate_interval", "5m")


def test_5xx_ratio_panel_shows_0_on_a_healthy_replica(tmp_path):
    """Before: "No data" while no 5xx series exists (a healthy replica has none) and on no traffic."""
    expr = panel_expr("5xx ratio")
    ok = 'moe_requests_total{instance="a:8000", protocol="grpc", status="200"}'
    cases = [
        ([(ok, "0+600x20")], 0),                                    # traffic, no 5xx series at all
        ([(ok, "0x20")], 0),                                        # no traffic
        ([(ok, "0+600x20"), (ok.replace("200", "503"), "0+60x20")], 60 / 660),
    ]
    tests = [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
              "promql_expr_test": [{"expr": expr, "eval_time": "15m",
                                    "exp_samples": [{"labels": "{}", "value": value}]}]}
             for series, value in cases]
    path = tmp_path / "panel.test.yml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
