"""envoy/gateway/: the Kubernetes manifests stay consistent with the service they deploy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from scorer.app import make_policy
from scorer.config import load_config
from scorer.pool import Pool

GATEWAY = Path(__file__).resolve().parents[1] / "envoy" / "gateway"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((GATEWAY / name).read_text()) if d]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def test_embedded_config_is_valid_and_builds_its_policy(tmp_path: Path) -> None:
    cm = _by_kind(_docs("kv-scorer.yaml"), "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    config = load_config(path, environ={})
    assert config.policy == "kv"
    assert all(w.events is not None and w.metrics_url for w in config.pool.workers)
    policy = make_policy(config, Pool.from_config(config), {})
    assert policy.name == "kv"


def test_ports_follow_the_inference_extension_conventions() -> None:
    docs = _docs("kv-scorer.yaml")
    container = _by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc-extproc": 9002, "grpc-health": 9003, "http-admin": 9090}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    service = _by_kind(docs, "Service")
    assert {p["port"] for p in service["spec"]["ports"]} == {9002, 9003, 9090}


def test_inference_pool_points_at_the_scorer_service() -> None:
    docs = _docs("inferencepool.yaml")
    pool = _by_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    service = _by_kind(_docs("kv-scorer.yaml"), "Service")
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] == 9002
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    route = _by_kind(docs, "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
