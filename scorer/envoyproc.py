"""Render Envoy bootstrap configs for kv-scorer (part of the runtime: users need it).

    yaml_text = render_envoy_config(listener_port=0, extproc_port=9002, admin_port=0)

`render_envoy_config()` with the default ports produces the same structure as
`envoy/envoy.yaml` (a test checks it); `mode="header"` matches `envoy/envoy-header.yaml`
and `response_headers=True` matches `envoy/envoy-full.yaml`.
Ports may be 0 (Envoy binds free ports). Starting an Envoy for tests, the demo and the
benchmarks is tooling: `kvscorer_tools.envoyrun.EnvoyProcess` (tools/, not in the runtime).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

DESTINATION_KEY = "x-gateway-destination-endpoint"
_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_GRPC_ACCESS_LOG = (
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
)
# Envoy's response flags for a request whose upstream failed under it (its access-log
# docs, "Response flags"): connection failure, connection termination, remote reset,
# retries exhausted. Envoy answers these itself, 503 (or 502).
UPSTREAM_FAILURE_FLAGS = ("UF", "UC", "UR", "URX")


def upstream_failure_log(cluster: str = "kv_scorer") -> dict[str, Any]:
    """An HCM access log that sends only requests whose upstream failed to the scorer's
    AccessLogService (scorer.extproc.accesslog): the lean shape's health evidence. No
    batching (`buffer_size_bytes: 0`): each failure is sent when it is logged."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
        "typed_config": {
            "@type": _GRPC_ACCESS_LOG,
            "common_config": {
                "log_name": "kv-scorer-upstream-failures",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "buffer_size_bytes": 0,
            },
        },
    }


_HEADER_TO_METADATA = (
    "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
)
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


# The scorer cluster's circuit breaker. Envoy's defaults (1,024 requests, 1,024 pending;
# envoy/config/cluster/v3/circuit_breaker.proto) would cap the gateway at 1,024 requests in
# flight: with response tracking each running generation holds one ext_proc stream, so
# request 1,025 failed with 500 (issue 11).
SCORER_CIRCUIT_BREAKERS: dict[str, Any] = {
    "thresholds": [
        {
            "priority": "DEFAULT",
            "max_connections": 1024,
            "max_pending_requests": 65536,
            "max_requests": 65536,
            "max_retries": 3,
        }
    ]
}


def _static_cluster(
    name: str,
    endpoints: Sequence[str],
    http2: bool = False,
    circuit_breakers: dict[str, Any] | None = None,
) -> dict[str, Any]:
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
    if circuit_breakers is not None:
        c["circuit_breakers"] = circuit_breakers
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
    response_body_mode: Literal["NONE", "STREAMED", "BUFFERED", "FULL_DUPLEX_STREAMED"] = "NONE",
    response_headers: bool = False,
) -> str:
    """An Envoy bootstrap (YAML) equivalent to envoy/envoy.yaml, with run-time ports.

    mode: where the ORIGINAL_DST cluster reads the endpoint: `envoy.lb` dynamic metadata
    (the inference extension's way) or the `x-gateway-destination-endpoint` header.
    track_responses: keep the ext_proc stream open until the response ends (in-flight
    accounting: the director ends the request when the stream ends); off, the scorer
    closes the stream after routing and Envoy skips the response path.
    response_headers: also send the response headers to the scorer (`envoy-full.yaml`):
    the director then learns the status (502/503 = health evidence, error metrics) and the
    served endpoint, at the cost of one more round trip Envoy waits on before the client
    gets its first byte. Off (the default, `envoy.yaml`: "lean") the response path sends
    nothing; the stream's end is still the request's end (docs/envoy.md). Response bodies
    (`response_body_mode` other than NONE) always come with their headers: the director
    reads the content type to parse usage.
    direct_backends: add a listener `direct` (port `direct_port`) that round-robins straight
    to these `ip:port` backends without ext_proc (the benchmark's baseline).
    extra_http_filters: HTTP filters placed before ext_proc (tests use header_to_metadata
    to inject a subset hint, as a gateway would).
    fail_open_endpoint: with failure_mode_allow, where a request goes when the scorer is
    unreachable (metadata mode only): a header_to_metadata filter before ext_proc puts this
    `ip:port` in `envoy.lb` metadata (and drops any client-sent destination header); the
    scorer's answer overwrites it. Without it a fail-open request has no destination and
    the ORIGINAL_DST cluster answers 503.
    response_body_mode: how response bodies go to the scorer (the gateways use
    FULL_DUPLEX_STREAMED: usage is read from them, every chunk answered at once).
    """
    follow_headers = track_responses and (response_headers or response_body_mode != "NONE")
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
                "response_header_mode": "SEND" if follow_headers else "SKIP",
                "request_body_mode": body_mode,
                "response_body_mode": response_body_mode if track_responses else "NONE",
                # FULL_DUPLEX_STREAMED requires trailer mode SEND.
                "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                # SEND keeps the stream open until the response ends (trailers may still
                # come): Envoy closes it when the HTTP stream is destroyed, which is the
                # end of each request for the scorer; Envoy sends no message when the
                # response has no trailers. SKIP here (with the rest skipped) closes it
                # right after the routing answer (measured, Envoy 1.40).
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
    if track_responses and not follow_headers:
        # Lean: the response status never reaches ext_proc; the requests whose upstream
        # failed reach the scorer through the access log instead (health evidence).
        hcm = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["access_log"] = [upstream_failure_log()]
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": odc,
        },
        _static_cluster(
            "kv_scorer",
            [f"{extproc_host}:{extproc_port}"],
            http2=True,
            circuit_breakers=SCORER_CIRCUIT_BREAKERS,
        ),
    ]
    if direct_backends:
        listeners.append(_listener("direct", host, direct_port, "direct_backends", []))
        clusters.append(_static_cluster("direct_backends", direct_backends))
    doc = {
        "admin": {"address": _addr(host, admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    return yaml.safe_dump(doc, sort_keys=False)


# ------------------------------------------------------------------ gateway shapes
#
# How each Gateway API Inference Extension gateway configures Envoy toward its endpoint
# picker, read from their sources (each file named below), reproduced with static
# resources so a real Envoy can run it without Kubernetes. The EDS cluster of a pool's
# pods becomes a STATIC cluster of `pool_endpoints`; the picker's Service becomes a
# STATIC cluster of `extproc_host:extproc_port`.

Gateway = Literal["istio", "envoy-ai-gateway", "kgateway"]
GATEWAYS: tuple[Gateway, ...] = ("istio", "envoy-ai-gateway", "kgateway")
Destination = Literal["original_dst", "override_host"]

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_EXT_PROC_PER_ROUTE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Istio's default route retry policy (istio/istio
# pilot/pkg/networking/core/route/retry/retry.go, `cachedDefaultPolicy`): the fallbacks
# of an override_host list are tried by retries, so a list needs one.
_ISTIO_RETRY = {
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2,
    "host_selection_retry_max_attempts": 5,
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }
    ],
}


def _processing_mode(body: str, response_body: str) -> dict[str, str]:
    # All three gateways: headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND, in
    # both directions (FULL_DUPLEX_STREAMED requires trailer mode SEND).
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": body,
        "response_body_mode": response_body,
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }


def override_host_cluster(name: str, endpoints: Sequence[str]) -> dict[str, Any]:
    """The pool cluster as Istio builds it (istio/istio
    pilot/pkg/networking/core/cluster_builder.go `applyOverrideHostPolicy`): the pool's
    endpoints, the `override_host` LB policy (Envoy >= 1.35) reading the picker's
    `envoy.lb/x-gateway-destination-endpoint` — a comma list: the first address is used,
    the next ones by retries — writing the host it used to
    `envoy.lb/x-gateway-destination-endpoint-served`, round robin without a pick."""
    c = _static_cluster(name, endpoints)
    del c["lb_policy"]
    c["lb_policy"] = "CLUSTER_PROVIDED"
    c["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _OVERRIDE_HOST,
                        "override_host_sources": [
                            {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_KEY}]}}
                        ],
                        "selected_host_key": {"key": "envoy.lb", "path": [{"key": SERVED_KEY}]},
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {"@type": _ROUND_ROBIN},
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }
    return c


def original_dst_cluster(name: str, source: Literal["metadata", "header"]) -> dict[str, Any]:
    """An ORIGINAL_DST cluster: exactly ONE `ip:port` (a comma list is no address: 503)."""
    odc: dict[str, Any]
    if source == "metadata":
        odc = {"metadata_key": {"key": "envoy.lb", "path": [{"key": DESTINATION_KEY}]}}
    else:
        odc = {"use_http_header": True, "http_header_name": DESTINATION_KEY}
    return {
        "name": name,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "10s",
        "original_dst_lb_config": odc,
    }


def picker_cluster(name: str, host: str, port: int, tls: bool) -> dict[str, Any]:
    """The endpoint picker's cluster: HTTP/2, and TLS that accepts any certificate (an
    empty validation context) the way Envoy AI Gateway and kgateway always build it."""
    c = _static_cluster(name, [f"{host}:{port}"], http2=True)
    c["connect_timeout"] = "10s"
    if tls:
        c["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _TLS, "common_tls_context": {"validation_context": {}}},
        }
    return c


@dataclass(frozen=True)
class GatewayPool:
    """One InferencePool behind the gateway: its endpoints and its picker.

    `path_prefix`: the pool has its own route (an HTTPRoute rule per pool); None: the pool
    is a weighted backend of the catch-all route (`weight`, like backendRef weights)."""

    name: str
    endpoints: Sequence[str]
    extproc_port: int
    extproc_host: str = "127.0.0.1"
    weight: int = 1
    path_prefix: str | None = None


def _names(pool: GatewayPool, single: bool) -> tuple[str, str]:
    # One pool keeps the short names the committed files and stats use.
    return ("pool", "endpoint_picker") if single else (f"pool_{pool.name}", f"picker_{pool.name}")


_SOURCES: dict[Gateway, str] = {
    "istio": (
        "istio/istio pilot/pkg/xds/filters/filters.go (InferencePoolExtProc),\n"
        "pilot/pkg/networking/core/route/route.go (per-route ExtProcOverrides),\n"
        "pilot/pkg/networking/core/cluster_builder.go (applyOverrideHostPolicy),\n"
        "pilot/pkg/networking/core/route/retry/retry.go (default retry policy)"
    ),
    "envoy-ai-gateway": (
        "envoyproxy/ai-gateway internal/extensionserver/inferencepool.go\n"
        "(buildHTTPFilterForInferencePool, buildExtProcClusterForInferencePoolEndpointPicker),\n"
        "internal/extensionserver/post_cluster_modify.go (handleInferencePoolCluster)"
    ),
    "kgateway": (
        "kgateway-dev/kgateway pkg/kgateway/extensions2/plugins/inferenceextension/\n"
        "endpointpicker/plugin.go (HttpFilters, ApplyForBackend, buildExtProcCluster,\n"
        "processBackendObjectIR); the metadata options (receiving envoy.lb, forwarding\n"
        "envoy.lb.subset_hint) are those of newer kgateway releases"
    ),
}


def render_gateway_config(
    gateway: Gateway,
    pool_endpoints: Sequence[str] = (),
    *,
    listener_port: int = 8080,
    extproc_port: int = 9002,
    admin_port: int = 9901,
    host: str = "127.0.0.1",
    extproc_host: str = "127.0.0.1",
    picker_tls: bool | None = None,
    failure_mode_allow: bool = False,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
    extra_http_filters: Sequence[dict[str, Any]] = (),
    pools: Sequence[GatewayPool] | None = None,
    weighted_random_header: str | None = None,
) -> str:
    """Envoy bootstrap (YAML, with a header naming its sources) shaped like `gateway`.

    - istio: ext_proc at the HCM with per-route overrides (the picker's cluster, processing
      mode), metadata options receiving and forwarding `envoy.lb`, message_timeout 1000 s;
      the pool is an `override_host` cluster (comma lists work: fallbacks are retried with
      Istio's default retry policy). TLS to the picker only with the DestinationRule of
      Istio's guide (TLS SIMPLE, insecureSkipVerify): `picker_tls=True`; default off.
    - envoy-ai-gateway: ext_proc with no metadata options, message_timeout 300 s, fail
      closed, TLS to the picker; the pool is ORIGINAL_DST on the destination header.
    - kgateway: ext_proc with message_timeout 5 s, per-route gRPC timeout 10 s, receiving
      `envoy.lb`, forwarding `envoy.lb.subset_hint`, TLS to the picker; the pool is
      ORIGINAL_DST on the destination header.

    One pool: `pool_endpoints` (they stand in for the pool's EDS; only istio routes by
    them) and the picker at `extproc_host:extproc_port`. Several pools: `pools`, each
    with its own picker and either its own route (`path_prefix`) or a weight in the
    catch-all route; each route (or weighted cluster) points ext_proc at its pool's picker
    with a per-route override, as Istio and kgateway do. `failure_mode_allow` is the
    InferencePool's `failureMode: FailOpen` (Istio, kgateway; Envoy AI Gateway always
    fails closed). `weighted_random_header`: tests only — the weighted split reads its
    random value from this request header (Envoy's `weighted_clusters.header_name`), so a
    split can be checked exactly. Body modes may be changed for experiments; the gateways themselves
    send FULL_DUPLEX_STREAMED.
    """
    if gateway not in GATEWAYS:
        raise ValueError(f"gateway must be one of {GATEWAYS}, not {gateway!r}")
    if gateway == "envoy-ai-gateway" and failure_mode_allow:
        raise ValueError("Envoy AI Gateway always fails closed (failure_mode_allow: false)")
    if pools is None:
        pools = [GatewayPool("", pool_endpoints, extproc_port, extproc_host)]
    if not pools:
        raise ValueError("at least one pool")
    single = len(pools) == 1
    tls = picker_tls if picker_tls is not None else gateway != "istio"
    mode = _processing_mode(request_body_mode, response_body_mode)
    clusters: list[dict[str, Any]] = []
    first_picker = _names(pools[0], single)[1]

    def override(picker: str) -> dict[str, Any]:
        """The per-route ext_proc config pointing at `picker` (None: the filter's own)."""
        grpc: dict[str, Any] = {"envoy_grpc": {"cluster_name": picker}}
        if gateway == "istio":
            o: dict[str, Any] = {
                "failure_mode_allow": failure_mode_allow,
                "grpc_service": grpc,
                "processing_mode": mode,
            }
        elif gateway == "kgateway":
            o = {"grpc_service": {**grpc, "timeout": "10s"}}
        else:
            o = {"grpc_service": grpc}
        return {"envoy.filters.http.ext_proc": {"@type": _EXT_PROC_PER_ROUTE, "overrides": o}}

    def pool_cluster(name: str, endpoints: Sequence[str]) -> dict[str, Any]:
        if gateway == "istio":
            return override_host_cluster(name, endpoints)
        c = original_dst_cluster(name, "header")
        if gateway == "kgateway":
            c["connect_timeout"] = "1000s"
        return c

    routes: list[dict[str, Any]] = []
    weighted: list[dict[str, Any]] = []
    for pool in pools:
        cname, pname = _names(pool, single)
        clusters.append(pool_cluster(cname, pool.endpoints))
        clusters.append(picker_cluster(pname, pool.extproc_host, pool.extproc_port, tls))
        # Envoy AI Gateway's single-pool filter names the picker itself (no override).
        per = None if (gateway == "envoy-ai-gateway" and single) else override(pname)
        if pool.path_prefix is not None:
            r: dict[str, Any] = {"cluster": cname, "timeout": "0s"}
            if gateway == "istio":
                r["retry_policy"] = _ISTIO_RETRY
            route = {"match": {"prefix": pool.path_prefix}, "route": r}
            if per:
                route["typed_per_filter_config"] = per
            routes.append(route)
        else:
            wc: dict[str, Any] = {"name": cname, "weight": pool.weight}
            if per:
                wc["typed_per_filter_config"] = per
            weighted.append(wc)
    if weighted:
        r = {"timeout": "0s"}
        if gateway == "istio":
            r["retry_policy"] = _ISTIO_RETRY
        route = {"match": {"prefix": "/"}, "route": r}
        if len(weighted) == 1:
            r["cluster"] = weighted[0]["name"]
            if "typed_per_filter_config" in weighted[0]:
                route["typed_per_filter_config"] = weighted[0]["typed_per_filter_config"]
        else:
            r["weighted_clusters"] = {"clusters": weighted}
            if weighted_random_header:
                r["weighted_clusters"]["header_name"] = weighted_random_header
        routes.append(route)

    ext: dict[str, Any] = {"@type": _EXT_PROC}
    if gateway == "istio":
        # The HCM-level filter is a placeholder (headers SKIP, fail open); each route to
        # an InferencePool overrides the service, failure mode and processing mode.
        ext.update(
            {
                "grpc_service": {"envoy_grpc": {"cluster_name": first_picker}, "timeout": "10s"},
                "failure_mode_allow": True,
                "processing_mode": {
                    "request_header_mode": "SKIP",
                    "response_header_mode": "SKIP",
                },
                "message_timeout": "1000s",
                "metadata_options": {
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                    "forwarding_namespaces": {"untyped": ["envoy.lb"]},
                },
            }
        )
    elif gateway == "envoy-ai-gateway":
        ext.update(
            {
                "grpc_service": {"envoy_grpc": {"cluster_name": first_picker}},
                "processing_mode": mode,
                "allow_mode_override": False,
                "message_timeout": "300s",
                "failure_mode_allow": False,
            }
        )
    else:
        ext.update(
            {
                "grpc_service": {"envoy_grpc": {"cluster_name": first_picker}},
                "processing_mode": mode,
                "message_timeout": "5s",
                "failure_mode_allow": failure_mode_allow,
                "metadata_options": {
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                },
            }
        )
    filters: list[dict[str, Any]] = [
        *extra_http_filters,
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext},
    ]
    listener = _listener("main", host, listener_port, "pool", filters)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = routes
    doc = {
        "admin": {"address": _addr(host, admin_port)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }
    header = [
        f"Envoy configured the way {gateway} configures its endpoint-picker filter,",
        "with static resources (the pool's EDS and the picker's Service as STATIC clusters).",
        "Read from:",
        *_SOURCES[gateway].split("\n"),
        "Rendered by scorer.envoyproc.render_gateway_config; regenerate with",
        "`python -m scorer.envoyproc gateways envoy/gateways` (a test compares).",
    ]
    if gateway == "istio":
        header.append("Fallback lists work here (override_host): policies.NAME.fallbacks > 0.")
    else:
        header.append("ORIGINAL_DST takes exactly one endpoint: keep policies.NAME.fallbacks 0.")
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump(doc, sort_keys=False)


# The pool the committed envoy/gateways/*.yaml files route to (two local workers, as
# envoy/envoy.yaml's comment and examples/ use).
GATEWAY_FILE_POOL = ("127.0.0.1:8001", "127.0.0.1:8002")


def write_gateway_files(directory: str | Path) -> list[Path]:
    """Write envoy/gateways/<gateway>.yaml for every gateway shape; returns the paths."""
    out = []
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for g in GATEWAYS:
        p = d / f"{g}.yaml"
        p.write_text(render_gateway_config(g, GATEWAY_FILE_POOL))
        out.append(p)
    return out


if __name__ == "__main__":
    # `python -m scorer.envoyproc gateways DIR`: regenerate the gateway-shaped configs.
    if len(sys.argv) == 3 and sys.argv[1] == "gateways":
        for written in write_gateway_files(sys.argv[2]):
            print(written)
    else:
        print("usage: python -m scorer.envoyproc gateways DIR", file=sys.stderr)
        sys.exit(2)
