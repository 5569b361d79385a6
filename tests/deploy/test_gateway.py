"""The gateway-api and inference-pool components, validated offline against their vendored CRD schemas."""

from __future__ import annotations

import pytest

from tests.deploy.test_manifests import OVERLAYS, by_kind, render
from tests.deploy.test_monitoring import validator


def _errors(doc: dict) -> list[str]:
    return [f"{e.message} at {list(e.absolute_path)}" for e in validator(doc["kind"]).iter_errors(doc)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_httproute_sends_the_gateway_to_the_router_service(overlay, tmp_path):
    docs = render(overlay, ("gateway-api",), tmp_path)
    route = by_kind(docs, "HTTPRoute")["pdserve"]
    assert not _errors(route), _errors(route)
    service = by_kind(docs, "Service")["pdserve-router"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("Service", "pdserve-router")
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert route["metadata"]["namespace"] == service["metadata"]["namespace"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_inference_pool_selects_the_router_pods(overlay, tmp_path):
    docs = render(overlay, ("inference-pool",), tmp_path)
    pool = by_kind(docs, "InferencePool")["pdserve-router"]
    route = by_kind(docs, "HTTPRoute")["pdserve-pool"]
    for doc in (pool, route):
        assert not _errors(doc), _errors(doc)
    router = by_kind(docs, "Deployment")["pdserve-router"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= router["metadata"]["labels"].items()
    ports = {p["containerPort"] for c in router["spec"]["containers"] for p in c["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "pdserve-router",
    )


def test_schema_check_catches_misspelt_and_missing_fields(tmp_path):
    docs = render("cpu-demo", ("inference-pool",), tmp_path)
    pool = by_kind(docs, "InferencePool")["pdserve-router"]
    pool["spec"]["targetPortNumber"] = pool["spec"].pop("targetPorts")  # the v1alpha2 field name
    assert _errors(pool)
    route = by_kind(docs, "HTTPRoute")["pdserve-pool"]
    route["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"  # not a PathMatchType
    assert _errors(route)
