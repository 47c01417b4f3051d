"""envoy/gateways/*.yaml: rendered by scorer.envoyproc, shaped like each gateway's config,
and accepted by Envoy 1.40."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvscorer_tools.envoyrun import validate_config
from scorer.envoyproc import GATEWAY_FILE_POOL, GATEWAYS, render_gateway_config

DIR = Path(__file__).resolve().parents[2] / "envoy" / "gateways"


def ext_proc(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the HCM-level ext_proc config, the route's per-filter overrides or {})."""
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    tc = hcm["typed_config"]
    f = next(f for f in tc["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    route = tc["route_config"]["virtual_hosts"][0]["routes"][0]
    per = route.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {})
    return f["typed_config"], per.get("overrides", {})


def clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_committed_file_is_the_renderers_output(gateway: str) -> None:
    text = (DIR / f"{gateway}.yaml").read_text()
    assert text == render_gateway_config(gateway, GATEWAY_FILE_POOL)  # type: ignore[arg-type]
    assert text.startswith("# Envoy configured the way") and "Read from:" in text


@pytest.mark.envoy
@pytest.mark.parametrize("gateway", GATEWAYS)
def test_envoy_accepts_the_file(gateway: str) -> None:
    r = validate_config(DIR / f"{gateway}.yaml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_istio_shape() -> None:
    doc = yaml.safe_load((DIR / "istio.yaml").read_text())
    base, over = ext_proc(doc)
    assert base["message_timeout"] == "1000s"
    ns = base["metadata_options"]
    assert ns["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert ns["forwarding_namespaces"]["untyped"] == ["envoy.lb"]
    mode = over["processing_mode"]
    assert (mode["response_header_mode"], mode["response_body_mode"]) == (
        "SEND",
        "FULL_DUPLEX_STREAMED",
    )
    assert mode["response_trailer_mode"] == "SEND" and over["failure_mode_allow"] is False
    pool = clusters(doc)["pool"]
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    src = policy["typed_config"]["override_host_sources"][0]["metadata"]
    assert src == {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    assert "transport_socket" not in clusters(doc)["endpoint_picker"]
    with_tls = yaml.safe_load(render_gateway_config("istio", GATEWAY_FILE_POOL, picker_tls=True))
    assert "transport_socket" in clusters(with_tls)["endpoint_picker"]


def test_envoy_ai_gateway_shape() -> None:
    doc = yaml.safe_load((DIR / "envoy-ai-gateway.yaml").read_text())
    base, over = ext_proc(doc)
    assert over == {} and "metadata_options" not in base
    assert base["message_timeout"] == "300s" and base["failure_mode_allow"] is False
    assert base["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    pool = clusters(doc)["pool"]
    assert pool["type"] == "ORIGINAL_DST"
    assert pool["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    tls = clusters(doc)["endpoint_picker"]["transport_socket"]["typed_config"]
    assert tls["common_tls_context"] == {"validation_context": {}}
    with pytest.raises(ValueError, match="fails closed"):
        render_gateway_config("envoy-ai-gateway", GATEWAY_FILE_POOL, failure_mode_allow=True)


def test_kgateway_shape() -> None:
    doc = yaml.safe_load((DIR / "kgateway.yaml").read_text())
    base, over = ext_proc(doc)
    assert base["message_timeout"] == "5s"
    assert base["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb.subset_hint"]
    assert base["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert over["grpc_service"]["timeout"] == "10s"
    assert clusters(doc)["pool"]["type"] == "ORIGINAL_DST"
    assert "transport_socket" in clusters(doc)["endpoint_picker"]
