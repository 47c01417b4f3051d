"""deploy/: every rendered manifest is what deploy/render.py makes, validates against the
real schemas (core kinds with kubernetes-validate --strict, offline; CRD kinds with the
vendored CRDs in deploy/crds/) and agrees with the service it deploys."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from scorer.app import config_from_args, register
from scorer.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.37.0"  # the newest schema set kubernetes-validate 1.37.0 bundles


def _render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _render()


# libyaml's loader when built in (the vendored Gateway API CRDs are ~600 KB of YAML).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_LOADER) if d]


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {p.name: docs(p.read_text()) for p in sorted((DEPLOY / "manifests").glob("*.yaml"))}


def _strict(schema: Any) -> Any:
    """A CRD schema as the API server applies it with fieldValidation=Strict: unknown
    fields are errors (except where the schema preserves them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) → a validator for the strict openAPIV3Schema of every vendored
    CRD version (built once: the Gateway API schemas are large)."""
    out = {}
    for path in (DEPLOY / "crds").glob("*.yaml"):
        for crd in docs(path.read_text()):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for ver in crd["spec"]["versions"]:
                schema = _strict(ver["schema"]["openAPIV3Schema"])
                # metadata is ObjectMeta, checked by the API server itself; keep it open.
                props = schema.setdefault("properties", {})
                props["metadata"] = {"type": "object"}
                props.setdefault("apiVersion", {"type": "string"})
                props.setdefault("kind", {"type": "string"})
                out[(f"{group}/{ver['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


def validate(obj: dict[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    validator = crd_schemas().get(key)
    if validator is not None:
        validator.validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def test_committed_manifests_are_what_the_renderer_makes() -> None:
    want = render.committed()
    have = {p.name: p.read_text() for p in (DEPLOY / "manifests").glob("*.yaml")}
    assert have == want, "run: python deploy/render.py --write"


@pytest.mark.parametrize("name", sorted(render.committed()))
def test_every_object_validates_against_its_schema(name: str) -> None:
    objs = manifests()[name]
    assert objs
    for obj in objs:
        validate(obj)


def test_validation_catches_what_it_should() -> None:
    pool = by_kind(manifests()["kv-scorer.yaml"], "InferencePool")
    bad = json.loads(json.dumps(pool))
    bad["spec"]["targetPorts"] = [{"number": p} for p in range(8000, 8009)]  # 9 > maxItems 8
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    typo = json.loads(json.dumps(pool))
    typo["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"
    with pytest.raises(jsonschema.ValidationError):
        validate(typo)
    dep = json.loads(json.dumps(by_kind(manifests()["kv-scorer.yaml"], "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)


def _serve_config(objs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The kv-scorer configuration the Deployment's container would run with."""
    cm = by_kind(objs, "ConfigMap")
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    container = by_kind(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = [
        a.replace("/etc/kv-scorer/config.yaml", str(tmp_path / "config.yaml"))
        for a in container["args"]
    ]
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(args))


def test_the_deployment_runs_the_service_it_describes(tmp_path: Path) -> None:
    objs = manifests()["istio.yaml"]
    config = _serve_config(objs, tmp_path)
    d = config.pool.discovery
    pool = by_kind(objs, "InferencePool")
    assert (d.pool_name, d.pool_namespace, d.pool_group) == (
        pool["metadata"]["name"],
        pool["metadata"]["namespace"],
        "inference.networking.k8s.io",
    )
    assert config.server.tls.enabled and config.events.bind == "tcp://*:5557"
    assert config.server.debug_endpoints is False
    # The bearer token file is the mounted ServiceAccount token Secret.
    token_secret = by_kind(objs, "Secret")
    assert token_secret["type"] == "kubernetes.io/service-account-token"
    assert token_secret["metadata"]["annotations"] == {
        "kubernetes.io/service-account.name": by_kind(objs, "ServiceAccount")["metadata"]["name"]
    }
    assert d.events_replay_port == 5558

    dep = by_kind(objs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert spec["terminationGracePeriodSeconds"] == 130
    assert config.server.grace_period_s < spec["terminationGracePeriodSeconds"]
    c = spec["containers"][0]
    assert c["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090, "zmq-events": 5557,
    }  # fmt: skip
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {vol["name"]: vol for vol in spec["volumes"]}
    assert config.server.auth_token_file == mounts["auth-token"] + "/token"
    assert vols["auth-token"]["secret"]["secretName"] == token_secret["metadata"]["name"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"

    svc = by_kind(objs, "Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"grpc-ext-proc", "http-metrics", "zmq-events"}
    assert (
        ports["grpc-ext-proc"]["port"] == 9002 and ports["grpc-ext-proc"]["appProtocol"] == "http2"
    )
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["endpointPickerRef"]["name"] == svc["metadata"]["name"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002

    role = by_kind(objs, "Role")
    grants = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert grants == {
        ("", "pods"): {"get", "list", "watch"},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    }
    rb = by_kind(objs, "RoleBinding")
    sa = by_kind(objs, "ServiceAccount")
    assert rb["subjects"][0]["name"] == sa["metadata"]["name"] == spec["serviceAccountName"]

    route = by_kind(objs, "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    assert route["spec"]["parentRefs"][0]["name"] == by_kind(objs, "Gateway")["metadata"]["name"]
    dr = by_kind(objs, "DestinationRule")
    assert dr["spec"]["host"] == "kv-scorer.llm.svc.cluster.local"
    assert dr["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}


def test_standalone_runs_by_selector(tmp_path: Path) -> None:
    objs = manifests()["standalone.yaml"]
    assert not [o for o in objs if o["kind"] == "InferencePool"]
    config = _serve_config(objs, tmp_path)
    assert config.pool.discovery.endpoint_selector == "app=vllm"
    assert config.pool.discovery.endpoint_target_ports == [8000]
    role = by_kind(objs, "Role")
    assert [r["resources"] for r in role["rules"]] == [["pods"]]


def test_each_gateway_gets_its_objects() -> None:
    m = manifests()
    assert "DestinationRule" not in {o["kind"] for o in m["kgateway.yaml"]}
    assert by_kind(m["kgateway.yaml"], "Gateway")["spec"]["gatewayClassName"] == "kgateway"
    eg = m["envoy-gateway.yaml"]
    cls = by_kind(eg, "GatewayClass")
    assert cls["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    assert by_kind(eg, "Gateway")["spec"]["gatewayClassName"] == cls["metadata"]["name"]
    helm = yaml.safe_load((DEPLOY / "values" / "envoy-gateway-helm-values.yaml").read_text())
    (res,) = helm["config"]["envoyGateway"]["extensionManager"]["backendResources"]
    assert res == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "version": "v1"}


def test_vllm_example_publishes_to_the_pool_socket() -> None:
    m = manifests()
    (vllm,) = m["vllm-example.yaml"]
    pool = by_kind(m["kv-scorer.yaml"], "InferencePool")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    c = vllm["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    cfg = json.loads(args[args.index("--kv-events-config") + 1])
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
    # Connects to kv-scorer's Service on its zmq-events port, topic names the worker.
    svc = by_kind(m["kv-scorer.yaml"], "Service")
    zmq_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["zmq-events"]
    assert cfg["endpoint"] == f"tcp://kv-scorer.llm.svc:{zmq_port}"
    port = pool["spec"]["targetPorts"][0]["number"]
    assert re.fullmatch(rf"kv@\$\(POD_IP\):{port}@Qwen/Qwen3-8B", cfg["topic"])
    assert {e["name"] for e in c["env"]} >= {"POD_IP"}
    assert cfg["replay_endpoint"] == "tcp://*:5558"
    assert "--enable-prefix-caching" in args
    config = load_config(
        environ={},
        overrides=yaml.safe_load(by_kind(m["kv-scorer.yaml"], "ConfigMap")["data"]["config.yaml"]),
    )
    assert args[args.index("--block-size") + 1] == str(config.pool.block_size)
    assert {p["containerPort"] for p in c["ports"]} == {port, 5558}
    assert c["readinessProbe"]["httpGet"]["port"] == port


def test_overlays_and_sets(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("namespace: prod\npool: {name: qwen, targetPorts: [8000, 8001]}\n")
    v = render.load_values(
        [DEPLOY / "values" / "istio.yaml", mine],
        ["tls.secretName=picker-tls", "monitoring.serviceMonitor=true"],
    )
    objs = render.render_scorer(v) + render.render_gateway(v)
    for obj in objs:
        validate(obj)
    pool = by_kind(objs, "InferencePool")
    assert pool["metadata"] == {**pool["metadata"], "name": "qwen", "namespace": "prod"}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000, 8001]
    config = _serve_config(objs, tmp_path)
    assert config.server.tls.cert_file == "/etc/kv-scorer/tls/tls.crt"
    sm = by_kind(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http-metrics"
    secret = by_kind(objs, "Secret")
    assert (
        sm["spec"]["endpoints"][0]["authorization"]["credentials"]["name"]
        == secret["metadata"]["name"]
    )
    with pytest.raises(SystemExit, match=r"gateway\.provider"):
        render.render_gateway(render.load_values([], ["gateway.provider=nginx"]))


def test_render_cli_prints_valid_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        render.main(["-f", str(DEPLOY / "values" / "kgateway.yaml"), "--set", "namespace=x"]) == 0
    )
    objs = docs(capsys.readouterr().out)
    assert {o["metadata"].get("namespace") for o in objs} == {"x"}
    assert shlex.split("python deploy/render.py --vllm")  # documented form
