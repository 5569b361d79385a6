"""The monitoring component: CRD-schema validation of its objects, promtool checks of its rules and dashboard."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.test_manifests import OVERLAYS, render

HERE = Path(__file__).resolve().parent
RULE_FILE = HERE.parents[1] / "deploy" / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"
SCHEMAS = {
    "ServiceMonitor": "servicemonitor.v1.json",
    "PrometheusRule": "prometheusrule.v1.json",
    "HTTPRoute": "httproute.v1.json",
    "InferencePool": "inferencepool.v1.json",
}


def closed(schema: dict) -> dict:
    """The schema with every object that lists its properties closed to others, as API-server pruning
    would silently drop them: an unknown (misspelt) field becomes a validation error."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed(json.loads((HERE / "crd_schemas" / SCHEMAS[kind]).read_text())))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_objects_match_their_crd_schemas(overlay, tmp_path):
    docs = [d for d in render(overlay, ("monitoring",), tmp_path) if d["apiVersion"] == "monitoring.coreos.com/v1"]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "ServiceMonitor"]
    for doc in docs:
        errors = sorted(validator(doc["kind"]).iter_errors(doc), key=str)
        assert not errors, f"{doc['kind']}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_schema_check_catches_a_misspelt_field():
    rule = yaml.safe_load(RULE_FILE.read_text())
    rule["spec"]["groups"][0]["rules"][0]["exprr"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    assert list(validator("PrometheusRule").iter_errors(rule))


def _plain_rules(tmp_path: Path) -> Path:
    """The PrometheusRule's spec is a Prometheus rules file: write it out for promtool."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (scripts/install_ops_tools.sh installs it)")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(RULE_FILE.read_text())["spec"]))
    return path


def test_promtool_checks_the_rules(tmp_path):
    out = subprocess.run(
        ["promtool", "check", "rules", str(_plain_rules(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_passing_promtool_test_case(tmp_path):
    _plain_rules(tmp_path)
    cases = HERE / "promtool" / "rules_test.yaml"
    shutil.copy(cases, tmp_path / cases.name)
    alerts = {
        r["alert"] for g in yaml.safe_load(RULE_FILE.read_text())["spec"]["groups"] for r in g["rules"] if "alert" in r
    }
    tested = {
        t["alertname"]
        for case in yaml.safe_load(cases.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts == tested, f"alerts without a firing test case: {alerts - tested}"
    out = subprocess.run(
        ["promtool", "test", "rules", cases.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


DASHBOARD = HERE.parents[1] / "deploy" / "k8s" / "components" / "monitoring" / "dashboards" / "pdserve.json"


def dashboard_exprs(concrete: bool = False) -> list[str]:
    """Every query of the dashboard; `concrete` substitutes Grafana's variables as "All" would."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    if concrete:
        exprs = [
            e.replace("$__rate_interval", "1m")
            .replace("$namespace", ".*")
            .replace("$pod", ".*")
            .replace("$model", ".*")
            for e in exprs
        ]
    return exprs


def test_dashboard_has_scope_variables_and_rate_interval():
    variables = {v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert {"datasource", "namespace", "pod", "model"} <= variables
    for expr in dashboard_exprs():
        assert 'namespace=~"$namespace"' in expr and 'pod=~"$pod"' in expr, expr
        ranges = re.findall(r"\[([^\]]+)\]", expr)
        assert all(r == "$__rate_interval" for r in ranges), expr


def test_dashboard_queries_are_valid_promql(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (scripts/install_ops_tools.sh installs it)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(dashboard_exprs(concrete=True))
                ],
            }
        ]
    }
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
