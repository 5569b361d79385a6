"""The planner-keda component: the router runs the SLO planner with flags its parser accepts, and
KEDA sets pdserve-prefill and pdserve-decode to the planner's desired counts (an exported series,
AverageValue with threshold 1 so replicas == the value). Rendered offline with every serving
overlay; it replaces autoscaling-keda, so it is never rendered with it."""

from __future__ import annotations

import re

import pytest

from pdserve.cli import build_parser
from pdserve.commands.router import router_config
from tests.deploy.test_manifests import K8S_VERSION, OVERLAYS, SERIES, by_kind, exported, render


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_follows_the_planner_of_a_router_that_runs_it(overlay, tmp_path):
    import kubernetes_validate

    docs = render(overlay, ("planner-keda",), tmp_path)
    deployments = by_kind(docs, "Deployment")
    for dep in deployments.values():
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    args = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    planner = router_config(build_parser().parse_args(args)).slo_planner
    assert planner.enabled and planner.ttft_slo and planner.tpot_slo and planner.planner_max_nodes
    scaled = by_kind(docs, "ScaledObject")
    assert set(scaled) == {"pdserve-decode", "pdserve-prefill"}
    namespace = deployments["pdserve-decode"]["metadata"]["namespace"]
    for name, obj in scaled.items():
        assert obj["metadata"]["namespace"] == namespace
        assert obj["spec"]["scaleTargetRef"]["name"] == name in deployments
        # each role between its minimum and the whole budget less the other role's minimum
        least = planner.planner_min_prefill if name == "pdserve-prefill" else 1
        other_least = 1 if name == "pdserve-prefill" else planner.planner_min_prefill
        assert obj["spec"]["minReplicaCount"] == least
        assert obj["spec"]["maxReplicaCount"] == planner.planner_max_nodes - other_least
        [trigger] = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"
        query = trigger["metadata"]["query"]
        assert re.findall(r'namespace="([^"]*)"', query) == [namespace], query
        assert f'role="{name.removeprefix("pdserve-")}"' in query
        assert SERIES.findall(query) == ["pdserve_planner_desired_replicas"]
        assert exported("pdserve_planner_desired_replicas")
