"""Helpers for the ext_proc contract tests: config and real ext_proc v3 messages."""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from scorer.config import load_config

WORKERS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.2:7003"]
PM = processing_mode_pb2.ProcessingMode


def make_config(**over: Any) -> Any:
    base: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "extproc_port": 0, "health_port": 0, "admin_port": 0},
        "pool": {"workers": list(WORKERS)},
        "policy": "round_robin",
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return load_config(overrides=base, environ={})


def headers_msg(
    headers: dict[str, str],
    end_of_stream: bool = False,
    body_mode: int | None = PM.FULL_DUPLEX_STREAMED,
    subset: Any = None,
) -> ep.ProcessingRequest:
    """A request_headers ProcessingRequest as Envoy 1.40 sends it (values in raw_value)."""
    m = ep.ProcessingRequest()
    hs = {":method": "POST", ":path": "/v1/completions", **headers}
    for k, v in hs.items():
        m.request_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    m.request_headers.end_of_stream = end_of_stream
    if body_mode is not None:
        m.protocol_config.request_body_mode = body_mode  # type: ignore[assignment]
    if subset is not None:
        s = struct_pb2.Struct()
        if isinstance(subset, list):
            s.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
        else:
            s.fields["x-gateway-destination-endpoint-subset"].string_value = subset
        m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return m


def body_msg(data: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.request_body.body = data
    m.request_body.end_of_stream = end_of_stream
    return m


def trailers_msg() -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.request_trailers.SetInParent()
    return m


def response_headers_msg(served: str | None = None) -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.response_headers.headers.headers.append(base_pb2.HeaderValue(key=":status", raw_value=b"200"))
    if served is not None:
        s = struct_pb2.Struct()
        s.fields["x-gateway-destination-endpoint-served"].string_value = served
        m.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    return m


def set_headers(mutation: ep.HeaderMutation) -> dict[str, bytes]:
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


def lb_metadata(resp: ep.ProcessingResponse) -> str:
    return (
        resp.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )
