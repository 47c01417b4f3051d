"""Render Envoy bootstrap configs for kv-scorer (part of the runtime: users need it).

    yaml_text = render_envoy_config(listener_port=0, extproc_port=9002, admin_port=0)

`render_envoy_config()` with the default ports produces the same structure as
`envoy/envoy.yaml` (a test checks it); `mode="header"` matches `envoy/envoy-header.yaml`.
Ports may be 0 (Envoy binds free ports). Starting an Envoy for tests, the demo and the
benchmarks is tooling: `kvscorer_tools.envoyrun.EnvoyProcess` (tools/, not in the runtime).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import yaml

DESTINATION_KEY = "x-gateway-destination-endpoint"
_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HEADER_TO_METADATA = (
    "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
)
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: Sequence[str], http2: bool = False) -> dict[str, Any]:
    lb = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        lb.append({"endpoint": {"address": _addr(host.strip("[]"), int(port))}})
    c: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]},
    }
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return c


def _listener(name: str, host: str, port: int, cluster: str, filters: list[Any]) -> dict[str, Any]:
    return {
        "name": name,
        "address": _addr(host, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": name,
                            "route_config": {
                                "name": name,
                                "virtual_hosts": [
                                    {
                                        "name": name,
                                        "domains": ["*"],
                                        "routes": [
                                            {
                                                "match": {"prefix": "/"},
                                                # timeout 0: no route timeout; the 15 s
                                                # default cuts long generations.
                                                "route": {"cluster": cluster, "timeout": "0s"},
                                            }
                                        ],
                                    }
                                ],
                            },
                            "http_filters": [
                                *filters,
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": _ROUTER},
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }


def render_envoy_config(
    listener_port: int = 8080,
    extproc_port: int = 9002,
    admin_port: int = 9901,
    mode: Literal["metadata", "header"] = "metadata",
    body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    track_responses: bool = True,
    *,
    host: str = "127.0.0.1",
    extproc_host: str = "127.0.0.1",
    message_timeout: str = "5s",
    direct_backends: Sequence[str] | None = None,
    direct_port: int = 0,
    extra_http_filters: Sequence[dict[str, Any]] = (),
    fail_open_endpoint: str | None = None,
) -> str:
    """An Envoy bootstrap (YAML) equivalent to envoy/envoy.yaml, with run-time ports.

    mode: where the ORIGINAL_DST cluster reads the endpoint: `envoy.lb` dynamic metadata
    (the inference extension's way) or the `x-gateway-destination-endpoint` header.
    track_responses: send response headers to the scorer (in-flight accounting); off, the
    scorer closes the stream after routing and Envoy skips the response path.
    direct_backends: add a listener `direct` (port `direct_port`) that round-robins straight
    to these `ip:port` backends without ext_proc (the benchmark's baseline).
    extra_http_filters: HTTP filters placed before ext_proc (tests use header_to_metadata
    to inject a subset hint, as a gateway would).
    fail_open_endpoint: with failure_mode_allow, where a request goes when the scorer is
    unreachable (metadata mode only): a header_to_metadata filter before ext_proc puts this
    `ip:port` in `envoy.lb` metadata (and drops any client-sent destination header); the
    scorer's answer overwrites it. Without it a fail-open request has no destination and
    the ORIGINAL_DST cluster answers 503.
    """
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "kv_scorer"}, "timeout": "10s"},
            # false = fail closed: scorer unreachable → 500/503 to the client.
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": message_timeout,
            "allow_mode_override": True,
            "processing_mode": {
                "request_header_mode": "SEND",  # must be SEND: routing starts on headers
                "response_header_mode": "SEND" if track_responses else "SKIP",
                "request_body_mode": body_mode,
                "response_body_mode": "NONE",
                # FULL_DUPLEX_STREAMED requires trailer mode SEND.
                "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                # SEND keeps the stream open until the response ends (trailers may still
                # come), so the scorer sees the end of each request; Envoy sends no message
                # when the response has no trailers.
                "response_trailer_mode": "SEND" if track_responses else "SKIP",
            },
            # Without envoy.lb here Envoy drops our metadata and ORIGINAL_DST finds no host.
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            },
        },
    }
    if mode == "metadata":
        odc: dict[str, Any] = {
            "metadata_key": {"key": "envoy.lb", "path": [{"key": DESTINATION_KEY}]}
        }
    elif mode == "header":
        odc = {"use_http_header": True, "http_header_name": DESTINATION_KEY}
    else:
        raise ValueError(f"mode must be 'metadata' or 'header', not {mode!r}")
    filters = list(extra_http_filters)
    if fail_open_endpoint is not None:
        if mode != "metadata":
            raise ValueError("fail_open_endpoint needs mode='metadata'")
        default = {
            "metadata_namespace": "envoy.lb",
            "key": DESTINATION_KEY,
            "value": fail_open_endpoint,
            "type": "STRING",
        }
        filters.append(
            {
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    "@type": _HEADER_TO_METADATA,
                    "request_rules": [
                        {
                            "header": DESTINATION_KEY,
                            "on_header_present": default,
                            "on_header_missing": default,
                            "remove": True,
                        }
                    ],
                },
            }
        )
    listeners = [
        _listener(
            "main",
            host,
            listener_port,
            "original_destination_cluster",
            [*filters, ext_proc],
        )
    ]
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": odc,
        },
        _static_cluster("kv_scorer", [f"{extproc_host}:{extproc_port}"], http2=True),
    ]
    if direct_backends:
        listeners.append(_listener("direct", host, direct_port, "direct_backends", []))
        clusters.append(_static_cluster("direct_backends", direct_backends))
    doc = {
        "admin": {"address": _addr(host, admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    return yaml.safe_dump(doc, sort_keys=False)
