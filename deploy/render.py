"""Render kv-scorer's Kubernetes manifests from deploy/values.yaml and overlays.

    python deploy/render.py                                  # kv-scorer + InferencePool
    python deploy/render.py -f deploy/values/istio.yaml      # + Istio's gateway objects
    python deploy/render.py -f mine.yaml --set pool.name=qwen --set namespace=prod
    python deploy/render.py --vllm                           # the example vLLM Deployment
    python deploy/render.py --write                          # refresh deploy/manifests/

Overlays merge like Helm values (mappings merge, everything else replaces; later wins);
`--set a.b=v` parses v as a YAML scalar. Needs only PyYAML. The objects mirror the
inference extension's chart (gateway-api-inference-extension v1.5.0
config/charts/epplib/templates: _deployment, _service, _rbac, _servicemonitor,
_sa-token-secret; config/charts/inferencepool/templates: inferencepool, istio).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
GATEWAYS = ("istio", "envoy-gateway", "kgateway")
GATEWAY_CLASS = {
    # Istio: istiod with ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true serves class "istio".
    "istio": "istio",
    # Envoy Gateway + Envoy AI Gateway: a GatewayClass of Envoy Gateway's controller
    # (envoyproxy/ai-gateway examples/inference-pool/httproute.yaml).
    "envoy-gateway": "inference-gateway",
    # kgateway installed with --set inferenceExtension.enabled=true.
    "kgateway": "kgateway",
}
Obj = dict[str, Any]
TOKEN_DIR = "/var/run/kv-scorer/auth"


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_values(files: list[Path], sets: list[str]) -> dict[str, Any]:
    """deploy/values.yaml, then each file, then each --set key.path=value."""
    values: dict[str, Any] = yaml.safe_load((HERE / "values.yaml").read_text())
    for f in files:
        values = deep_merge(values, yaml.safe_load(Path(f).read_text()) or {})
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key.path=value")
        node: dict[str, Any] = {}
        leaf = node
        parts = key.split(".")
        for p in parts[:-1]:
            leaf = leaf.setdefault(p, {})
        leaf[parts[-1]] = yaml.safe_load(raw)
        values = deep_merge(values, node)
    return values


def _meta(v: Mapping[str, Any], name: str, **extra: Any) -> Obj:
    labels = {"app.kubernetes.io/name": "kv-scorer", "app.kubernetes.io/instance": v["name"]}
    return {"name": name, "namespace": v["namespace"], "labels": labels, **extra}


def _selector(v: Mapping[str, Any]) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kv-scorer", "app.kubernetes.io/instance": v["name"]}


def scorer_config(v: Mapping[str, Any]) -> dict[str, Any]:
    """kv-scorer's config.yaml (the ConfigMap): values.config + what the values imply."""
    cfg = deep_merge({}, v.get("config") or {})
    server: dict[str, Any] = {"grace_period_s": max(0, v["terminationGracePeriodSeconds"] - 10)}
    if v["tls"]["enabled"]:
        tls: dict[str, Any] = {"enabled": True}
        if v["tls"]["secretName"]:
            tls.update(
                cert_file="/etc/kv-scorer/tls/tls.crt", key_file="/etc/kv-scorer/tls/tls.key"
            )
        server["tls"] = tls
    # /debug/* stays off in a cluster unless asked for; /metrics, /debug/* and Score need the
    # bearer token that Prometheus also gets (the ServiceAccount's token Secret).
    server["debug_endpoints"] = bool(v["debugEndpoints"])
    if v["monitoring"]["auth"]:
        server["auth_token_file"] = f"{TOKEN_DIR}/token"
    cfg["server"] = deep_merge(server, cfg.get("server") or {})
    discovery: dict[str, Any] = {}
    if v["events"]["replayPort"]:
        discovery["events_replay_port"] = v["events"]["replayPort"]
    cfg["pool"] = deep_merge(cfg.get("pool") or {}, {"discovery": discovery} if discovery else {})
    if v["events"]["poolSocket"]:
        cfg["events"] = deep_merge(
            cfg.get("events") or {}, {"bind": f"tcp://*:{v['events']['port']}"}
        )
    return cfg


def _config_text(v: Mapping[str, Any]) -> str:
    return yaml.safe_dump(scorer_config(v), sort_keys=False)


def render_scorer(v: Mapping[str, Any]) -> list[Obj]:
    """ServiceAccount, RBAC, ConfigMap, Deployment, Service, InferencePool, monitoring."""
    name, ns = v["name"], v["namespace"]
    pool = v["pool"]
    objs: list[Obj] = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(v, name)}]
    rules: list[Obj] = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    if not pool["standalone"]:
        rules.append(
            {
                "apiGroups": [pool["group"]],
                "resources": ["inferencepools"],
                "verbs": ["get", "list", "watch"],
            }
        )
    objs.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(v, name),
            "rules": rules,
        }
    )
    objs.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(v, name),
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        }
    )
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(v, name),
            "data": {"config.yaml": _config_text(v)},
        }
    )
    if pool["standalone"]:
        labels = ",".join(f"{k}={val}" for k, val in sorted(pool["selector"].items()))
        ports = ",".join(str(p) for p in pool["targetPorts"])
        source = ["--endpoint-selector", labels, "--endpoint-target-ports", ports]
    else:
        source = [
            "--pool-name",
            pool["name"],
            "--pool-namespace",
            ns,
            "--pool-group",
            pool["group"],
        ]
    container_ports = [
        {"name": "grpc-ext-proc", "containerPort": 9002},
        {"name": "grpc-health", "containerPort": 9003},
        {"name": "http-metrics", "containerPort": 9090},
    ]
    if v["events"]["poolSocket"]:
        container_ports.append({"name": "zmq-events", "containerPort": v["events"]["port"]})
    mounts = [
        {"name": "config", "mountPath": "/etc/kv-scorer/config.yaml", "subPath": "config.yaml"},
        {"name": "models", "mountPath": "/models", "readOnly": True},
    ]
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": name}},
        {"name": "models", **v["tokenizerVolume"]},
    ]
    mon = v["monitoring"]
    if mon["auth"]:
        mounts.append({"name": "auth-token", "mountPath": TOKEN_DIR, "readOnly": True})
        volumes.append({"name": "auth-token", "secret": {"secretName": mon["secretName"]}})
    if v["tls"]["enabled"] and v["tls"]["secretName"]:
        mounts.append({"name": "tls", "mountPath": "/etc/kv-scorer/tls", "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": v["tls"]["secretName"]}})
    container = {
        "name": "kv-scorer",
        "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "imagePullPolicy": v["image"]["pullPolicy"],
        "args": ["serve", "--config", "/etc/kv-scorer/config.yaml", *source],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": container_ports,
        # Plaintext gRPC health on 9003 (kubelet probes speak no TLS): liveness stays
        # SERVING while the process runs; readiness waits for the first pool sync.
        "livenessProbe": {
            "grpc": {"port": 9003, "service": "liveness"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
        },
        "readinessProbe": {"grpc": {"port": 9003, "service": "readiness"}, "periodSeconds": 2},
        "resources": v["resources"],
        "volumeMounts": mounts,
    }
    objs.append(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(v, name),
            "spec": {
                "replicas": v["replicas"],
                # The old picker goes before the new one starts (state is per process).
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": _selector(v)},
                "template": {
                    "metadata": {"labels": _selector(v)},
                    "spec": {
                        "serviceAccountName": name,
                        "terminationGracePeriodSeconds": v["terminationGracePeriodSeconds"],
                        "containers": [container],
                        "volumes": volumes,
                    },
                },
            },
        }
    )
    # h2 over TLS is "http2"; cleartext h2 is "kubernetes.io/h2c" (KEP-3726 appProtocol).
    app_protocol = "http2" if v["tls"]["enabled"] else "kubernetes.io/h2c"
    svc_ports: list[Obj] = [
        {
            "name": "grpc-ext-proc",
            "port": 9002,
            "targetPort": 9002,
            "protocol": "TCP",
            "appProtocol": app_protocol,
        },
        {"name": "http-metrics", "port": 9090, "targetPort": 9090, "protocol": "TCP"},
    ]
    if v["events"]["poolSocket"]:
        p = v["events"]["port"]
        svc_ports.append({"name": "zmq-events", "port": p, "targetPort": p, "protocol": "TCP"})
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(v, name),
            "spec": {"type": "ClusterIP", "selector": _selector(v), "ports": svc_ports},
        }
    )
    if not pool["standalone"]:
        objs.append(
            {
                "apiVersion": f"{pool['group']}/v1",
                "kind": "InferencePool",
                "metadata": _meta(v, pool["name"]),
                "spec": {
                    "selector": {"matchLabels": dict(pool["selector"])},
                    "targetPorts": [{"number": p} for p in pool["targetPorts"]],
                    "endpointPickerRef": {
                        "name": name,
                        "port": {"number": 9002},
                        "failureMode": pool["failureMode"],
                    },
                },
            }
        )
    if mon["auth"]:
        # The ServiceAccount's token, filled in by Kubernetes: kv-scorer reads it as
        # server.auth_token_file and Prometheus sends it (the reference chart's
        # _sa-token-secret.yaml).
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _meta(
                    v,
                    mon["secretName"],
                    annotations={"kubernetes.io/service-account.name": name},
                ),
                "type": "kubernetes.io/service-account-token",
            }
        )
    if mon["serviceMonitor"]:
        endpoint: Obj = {"port": "http-metrics", "path": "/metrics", "interval": mon["interval"]}
        if mon["auth"]:
            endpoint["authorization"] = {"credentials": {"name": mon["secretName"], "key": "token"}}
        objs.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": _meta(v, name),
                "spec": {
                    "endpoints": [endpoint],
                    "jobLabel": name,
                    "namespaceSelector": {"matchNames": [ns]},
                    "selector": {"matchLabels": _meta(v, name)["labels"]},
                },
            }
        )
    return objs


def render_gateway(v: Mapping[str, Any]) -> list[Obj]:
    """Gateway + HTTPRoute to the InferencePool, and what the provider needs besides."""
    provider = v["gateway"]["provider"]
    if provider == "none":
        return []
    if provider not in GATEWAYS:
        raise SystemExit(f"gateway.provider: one of none, {', '.join(GATEWAYS)} (got {provider!r})")
    if v["pool"]["standalone"]:
        raise SystemExit("gateway.provider needs the InferencePool (pool.standalone: false)")
    ns, gw = v["namespace"], v["gateway"]["name"]
    objs: list[Obj] = []
    cls = GATEWAY_CLASS[provider]
    if provider == "envoy-gateway":
        objs.append(
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "GatewayClass",
                "metadata": {"name": cls},
                "spec": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
            }
        )
    objs.append(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": {"name": gw, "namespace": ns},
            "spec": {
                "gatewayClassName": cls,
                "listeners": [{"name": "http", "protocol": "HTTP", "port": v["gateway"]["port"]}],
            },
        }
    )
    objs.append(
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": v["pool"]["name"], "namespace": ns},
            "spec": {
                "parentRefs": [
                    {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw}
                ],
                "rules": [
                    {
                        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                        "backendRefs": [
                            {
                                "group": v["pool"]["group"],
                                "kind": "InferencePool",
                                "name": v["pool"]["name"],
                            }
                        ],
                        # Long generations: no route timeout.
                        "timeouts": {"request": "0s"},
                    }
                ],
            },
        }
    )
    if provider == "istio" and v["tls"]["enabled"]:
        # Istio dials the picker in plaintext unless told (the reference chart's istio.yaml).
        objs.append(
            {
                "apiVersion": "networking.istio.io/v1",
                "kind": "DestinationRule",
                "metadata": {"name": v["name"], "namespace": ns},
                "spec": {
                    "host": f"{v['name']}.{ns}.svc.cluster.local",
                    "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}},
                },
            }
        )
    return objs


def kv_events_config(v: Mapping[str, Any]) -> str:
    """vLLM's --kv-events-config for the pool socket (or its own PUB, connect mode)."""
    vl, ev = v["vllm"], v["events"]
    port = v["pool"]["targetPorts"][0]
    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    if ev["poolSocket"]:
        # kubelet expands $(POD_IP) from the env var below.
        cfg["endpoint"] = f"tcp://{v['name']}.{v['namespace']}.svc:{ev['port']}"
        cfg["topic"] = f"kv@$(POD_IP):{port}@{vl['model']}"
    else:
        cfg["endpoint"] = f"tcp://*:{ev['port']}"
    if ev["replayPort"]:
        cfg["replay_endpoint"] = f"tcp://*:{ev['replayPort']}"
    return json.dumps(cfg, separators=(",", ":"))


def render_vllm(v: Mapping[str, Any]) -> list[Obj]:
    """An example vLLM Deployment whose pods the InferencePool selects."""
    vl = v["vllm"]
    port = v["pool"]["targetPorts"][0]
    block_size = (v.get("config") or {}).get("pool", {}).get("block_size", 16)
    ports = [{"name": "http", "containerPort": port}]
    if v["events"]["replayPort"]:
        ports.append({"name": "zmq-replay", "containerPort": v["events"]["replayPort"]})
    if not v["events"]["poolSocket"]:
        ports.append({"name": "zmq-events", "containerPort": v["events"]["port"]})
    labels = dict(v["pool"]["selector"])
    container = {
        "name": "vllm",
        "image": vl["image"],
        "args": [
            "--model",
            vl["model"],
            "--port",
            str(port),
            # Prefix caching makes blocks reusable; the block size must equal
            # pool.block_size (kv-scorer checks vllm:cache_config_info and the events).
            "--enable-prefix-caching",
            "--block-size",
            str(block_size),
            "--kv-events-config",
            kv_events_config(v),
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        # /metrics is served on the same port (kv-scorer scrapes http://podIP:port/metrics).
        "ports": ports,
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "initialDelaySeconds": 300,
            "periodSeconds": 10,
        },
        "resources": {"limits": {"nvidia.com/gpu": vl["gpus"]}},
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": vl["name"], "namespace": v["namespace"], "labels": labels},
            "spec": {
                "replicas": vl["replicas"],
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"terminationGracePeriodSeconds": 120, "containers": [container]},
                },
            },
        }
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's config.yaml) as literal blocks."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def dump(objs: list[Obj], header: str) -> str:
    body = "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False) for o in objs)
    return header + body


def header(what: str) -> str:
    return (
        f"# {what}\n"
        "# Rendered by deploy/render.py from deploy/values.yaml: edit the values (or overlay\n"
        "# them) and render again rather than editing this file (make test checks it).\n"
    )


def committed() -> dict[str, str]:
    """What deploy/manifests/ holds: file name → rendered text."""
    out = {}
    base = load_values([], [])
    out["kv-scorer.yaml"] = dump(
        render_scorer(base), header("kv-scorer and its InferencePool (no gateway objects)")
    )
    for g in GATEWAYS:
        v = load_values([HERE / "values" / f"{g}.yaml"], [])
        out[f"{g}.yaml"] = dump(
            render_scorer(v) + render_gateway(v),
            header(f"kv-scorer, its InferencePool, and the Gateway + HTTPRoute for {g}"),
        )
    standalone = load_values([], ["pool.standalone=true"])
    out["standalone.yaml"] = dump(
        render_scorer(standalone),
        header("kv-scorer without the InferencePool CRD (--endpoint-selector)"),
    )
    out["vllm-example.yaml"] = dump(
        render_vllm(base), header("an example vLLM Deployment for the pool")
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "-f", "--values", action="append", default=[], type=Path, help="values overlay (repeatable)"
    )
    p.add_argument("--set", action="append", default=[], help="key.path=value (repeatable)")
    p.add_argument("--vllm", action="store_true", help="render the example vLLM Deployment")
    p.add_argument(
        "--write", action="store_true", help="rewrite deploy/manifests/ with the defaults"
    )
    args = p.parse_args(argv)
    if args.write:
        out_dir = HERE / "manifests"
        out_dir.mkdir(exist_ok=True)
        for fname, text in committed().items():
            (out_dir / fname).write_text(text)
        return 0
    v = load_values(args.values, args.set)
    objs = render_vllm(v) if args.vllm else render_scorer(v) + render_gateway(v)
    sys.stdout.write(dump(objs, header("kv-scorer manifests")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
