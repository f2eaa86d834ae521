"""Alert rules and the Grafana dashboard: promtool checks and unit tests, and the metric-name contract.

Every expression must parse (promtool) and may only read metrics that the runtime or the operator
export (their metric_names modules), the rules' own recording rules, or Prometheus' standard series.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.io import metric_names as operator_metrics
from batchpilot_runtime.contract import metric_names as runtime_metrics

from .promql_names import metric_names, substitute_grafana_variables
from .tools import DEPLOY, promtool_path, run

RULES = DEPLOY / "prometheus" / "batchpilot.rules.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "batchpilot.rules.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "batchpilot-dashboard.json"
STANDARD_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"})
REQUIRED_ALERTS = {
    "BatchpilotSLOBurn",
    "BatchpilotProfileNotSynced",
    "BatchpilotMetricsMissing",
    "BatchpilotOperatorDown",
}


def _promtool() -> Path:
    path = promtool_path()
    if path is None:
        pytest.skip("promtool not installed: run scripts/system-deps.sh (Debian's prometheus package)")
    return path


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _recorded() -> frozenset[str]:
    return frozenset(rule["record"] for rule in _rules() if "record" in rule)


def _contract() -> frozenset[str]:
    return runtime_metrics.all_series_names() | operator_metrics.all_series_names() | STANDARD_SERIES | _recorded()


def _dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return found


def _dashboard_variable_metrics() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            assert query.startswith("label_values("), query
            selector = query.removeprefix("label_values(").rsplit(",", 1)[0]
            found.append((f"variable {variable['name']}", selector))
    return found


def test_promtool_checks_the_rules() -> None:
    result = run([_promtool(), "check", "rules", RULES])
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run([_promtool(), "test", "rules", RULE_TESTS], cwd=RULE_TESTS.parent)
    assert "SUCCESS" in result.stdout, result.stdout


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts >= REQUIRED_ALERTS
    fired: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else silent).add(check["alertname"])
    assert fired == alerts, f"no firing case for {sorted(alerts - fired)}"
    assert silent == alerts, f"no silent case for {sorted(alerts - silent)}"


RUNBOOKS = DEPLOY.parent / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/batchpilot/batchpilot/blob/main/docs/runbooks.md#"


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def test_every_alert_links_a_runbook_section_that_exists() -> None:
    headings = [line.lstrip("#").strip() for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")]
    anchors = {_github_anchor(heading) for heading in headings}
    alerts = [rule for rule in _rules() if "alert" in rule]
    assert alerts
    for rule in alerts:
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(RUNBOOK_BASE), (rule["alert"], url)
        assert url.removeprefix(RUNBOOK_BASE) in anchors, (rule["alert"], url, sorted(anchors))
    # One section per alert, and none for an alert that is gone.
    assert sorted(headings) == sorted(rule["alert"] for rule in alerts)


def test_alerts_are_documented() -> None:
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_read_only_contract_metrics() -> None:
    contract = _contract()
    for rule in _rules():
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= contract, f"{rule.get('alert') or rule.get('record')}: unknown {sorted(names - contract)}"


def test_dashboard_reads_only_contract_metrics() -> None:
    contract = _contract()
    seen: set[str] = set()
    for where, expr in _dashboard_expressions() + _dashboard_variable_metrics():
        names = metric_names(substitute_grafana_variables(expr))
        assert names, where
        assert names <= contract, f"{where}: unknown {sorted(names - contract)}"
        seen |= names
    # The one screen the issue asks for: latency vs SLO, batch sizes, waits, KV usage, the window, decisions.
    for name in (
        "batchpilot_ttft_seconds_bucket",
        "batchpilot_operator_slo_seconds",
        "batchpilot_batch_size_bucket",
        "batchpilot_queue_wait_seconds_bucket",
        "batchpilot_kv_cache_usage_ratio",
        "batchpilot_window_target_batch_size",
        "batchpilot_window_hard_cap",
        "batchpilot_window_max_wait_seconds",
        "batchpilot_operator_decisions_total",
    ):
        assert name in seen, name


def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    """promtool parses each expression as a recording rule (Grafana's variables given plain values)."""
    expressions = _dashboard_expressions()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{index}", "expr": substitute_grafana_variables(expr)}
                    for index, (_, expr) in enumerate(expressions)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = run([_promtool(), "check", "rules", path], check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def test_dashboard_is_one_screen_with_decision_annotations() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "batchpilot"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    (decisions,) = dashboard["annotations"]["list"]
    assert "batchpilot_operator_decisions_total" in decisions["expr"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (model, le) (rate(batchpilot_ttft_seconds_bucket{model=~"a|b", le!="x"}[5m]))',
            {"batchpilot_ttft_seconds_bucket"},
        ),
        (
            "a_total offset 5m / on (model) group_left (profile) b:rec:rate5m and on () c > bool 1e3",
            {"a_total", "b:rec:rate5m", "c"},
        ),
        ('label_replace(up, "x", "$1", "job", "(.*)") unless absent(foo{bar="1"})', {"up", "foo"}),
        ("max(rate(x_count[10m:1m])) == 0 or vector(0)", {"x_count"}),
    ],
)
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
