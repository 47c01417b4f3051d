"""The endpoint-picker (EPP) protocol on top of Envoy's ext_proc messages.

Sources for the wire facts used here:
- Gateway API Inference Extension, "Endpoint Picker Protocol"
  (docs/proposals/004-endpoint-picker-protocol): destination header and `envoy.lb`
  metadata key `x-gateway-destination-endpoint` (`ip:port`, comma list = fallbacks),
  subset hint `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, served
  endpoint `x-gateway-destination-endpoint-served`, 62,000-byte streamed body chunks.
- Envoy v3 API `envoy/service/ext_proc/v3/external_processor.proto` (HeaderMutation,
  StreamedBodyResponse, ImmediateResponse) and `envoy/type/v3/http_status.proto`
  (StatusCode enum values equal the HTTP status codes).
- Error bodies: the OpenAI error object of `scorer.errors`.

Everything here is pure functions over protobufs, so the servicer stays a small state
machine and these pieces are unit-testable without a channel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2  # type: ignore[import-untyped]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
REASON_HEADER = "x-kv-scorer-reason"
MATCHED_HEADER = "x-kv-scorer-matched-tokens"
# The inference extension streams mutated bodies back in chunks of at most this many bytes
# (its StreamedBodyResponse chunking); Envoy's gRPC message limit leaves room for it.
BODY_CHUNK_BYTES = 62_000

ProcessingMode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BUFFERED


# ---------------------------------------------------------------------------- headers


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Lower-case name → value. Envoy ≥1.3x sends values in `raw_value` (bytes)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        raw = h.raw_value
        out[h.key] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def _set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy 1.40 rejects `value` in mutations from ext_proc: header values go in raw_value.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination_mutation(
    endpoints: str | None, extra: Mapping[str, str] | None = None
) -> ep.HeaderMutation:
    """Set the destination header (overwriting any client-sent one) plus `extra` headers.

    With `endpoints` None only removes a client-sent destination header: it must never
    reach the proxy's load balancer.
    """
    m = ep.HeaderMutation()
    if endpoints is None:
        m.remove_headers.append(DESTINATION_HEADER)
    else:
        m.set_headers.append(_set_header(DESTINATION_HEADER, endpoints))
    if extra:
        for k, v in extra.items():
            m.set_headers.append(_set_header(k, v))
    return m


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    """Dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}`."""
    s = struct_pb2.Struct()
    s.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    return s


# ---------------------------------------------------------------------------- metadata


def _struct_value_strings(v: struct_pb2.Value) -> list[str]:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return [p.strip() for p in v.string_value.split(",") if p.strip()]
    if kind == "list_value":
        out: list[str] = []
        for item in v.list_value.values:
            out.extend(_struct_value_strings(item))
        return out
    return []


def subset_hint(req: ep.ProcessingRequest) -> frozenset[str] | None:
    """The subset hint, or None when absent. A list value or a comma string; entries are
    exact `ip:port` or IP-only. An empty hint is an empty set (nothing is eligible)."""
    if not req.HasField("metadata_context"):
        return None
    fm = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    ns = fm[SUBSET_NAMESPACE]
    if SUBSET_KEY not in ns.fields:
        return None
    return frozenset(_struct_value_strings(ns.fields[SUBSET_KEY]))


def served_endpoint(req: ep.ProcessingRequest) -> str | None:
    """`x-gateway-destination-endpoint-served` from `envoy.lb` metadata, if reported."""
    if not req.HasField("metadata_context"):
        return None
    fm = req.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in fm:
        return None
    ns = fm[DESTINATION_NAMESPACE]
    if SERVED_KEY not in ns.fields:
        return None
    vals = _struct_value_strings(ns.fields[SERVED_KEY])
    return vals[0] if vals else None


def response_status(req: ep.ProcessingRequest) -> int:
    """The `:status` of a response_headers message (0 when absent or not a number)."""
    for h in req.response_headers.headers.headers:
        if h.key == ":status":
            raw = h.raw_value.decode("ascii", "replace") if h.raw_value else h.value
            return int(raw) if raw.isdigit() and len(raw) == 3 else 0
    return 0


# ---------------------------------------------------------------------------- responses


def continue_headers(
    mutation: ep.HeaderMutation | None = None,
    metadata: struct_pb2.Struct | None = None,
    response_path: bool = False,
) -> ep.ProcessingResponse:
    """A headers response that lets the request (or response) continue."""
    resp = ep.ProcessingResponse()
    hr = resp.response_headers if response_path else resp.request_headers
    hr.response.status = ep.CommonResponse.CONTINUE
    if mutation is not None:
        hr.response.header_mutation.CopyFrom(mutation)
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def streamed_response_body(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """The answer to a response body chunk in FULL_DUPLEX_STREAMED: the same bytes and
    end_of_stream back as a `streamed_response` (Envoy rejects a plain CommonResponse in
    that mode as a spurious message; the inference extension's handlers/server.go answers
    the same way)."""
    resp = ep.ProcessingResponse()
    sr = resp.response_body.response.body_mutation.streamed_response
    sr.body = body
    sr.end_of_stream = end_of_stream
    return resp


def continue_response_body() -> ep.ProcessingResponse:
    """The answer to a response body message in STREAMED, BUFFERED or BUFFERED_PARTIAL
    mode: CONTINUE, body unchanged (one answer per message, in order)."""
    resp = ep.ProcessingResponse()
    resp.response_body.response.status = ep.CommonResponse.CONTINUE
    return resp


def continue_response_trailers() -> ep.ProcessingResponse:
    """The answer to response trailers: unchanged."""
    resp = ep.ProcessingResponse()
    resp.response_trailers.SetInParent()
    return resp


def header_value(headers: ep.HttpHeaders, name: str) -> str | None:
    """One header's value (name lower-case), or None."""
    for h in headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else str(h.value)
    return None


def continue_body(
    mutation: ep.HeaderMutation | None = None, metadata: struct_pb2.Struct | None = None
) -> ep.ProcessingResponse:
    """A BUFFERED body response: body unchanged, optional header mutation + metadata."""
    resp = ep.ProcessingResponse()
    resp.request_body.response.status = ep.CommonResponse.CONTINUE
    if mutation is not None:
        resp.request_body.response.header_mutation.CopyFrom(mutation)
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def streamed_body(body: bytes, end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: the body back in chunks of ≤ BODY_CHUNK_BYTES, end_of_stream on
    the last one. An empty body is one empty chunk (Envoy still needs the end marker)."""
    out = []
    n = len(body)
    start = 0
    while True:
        end = min(start + BODY_CHUNK_BYTES, n)
        resp = ep.ProcessingResponse()
        sbr = resp.request_body.response.body_mutation.streamed_response
        sbr.body = body[start:end]
        last = end >= n
        sbr.end_of_stream = end_of_stream and last
        out.append(resp)
        if last:
            return out
        start = end


def continue_trailers() -> ep.ProcessingResponse:
    resp = ep.ProcessingResponse()
    resp.request_trailers.SetInParent()
    return resp


def immediate_response(status: int, json_body: bytes, details: str) -> ep.ProcessingResponse:
    """An ImmediateResponse with a JSON body (content-type application/json)."""
    resp = ep.ProcessingResponse()
    ir = resp.immediate_response
    ir.status.code = status  # type: ignore[assignment]  # StatusCode values are HTTP codes
    ir.body = json_body
    ir.headers.set_headers.append(_set_header("content-type", "application/json"))
    ir.details = details
    return resp


def http_status_name(status: int) -> str:
    """The envoy.type.v3.StatusCode name for `status` (for logs)."""
    try:
        return str(http_status_pb2.StatusCode.Name(status))  # type: ignore[arg-type]
    except ValueError:
        return str(status)


def mode_override_skip_response() -> Any:
    """A ProcessingMode that skips response headers, body and trailers."""
    return ProcessingMode(
        response_header_mode=ProcessingMode.SKIP,
        response_body_mode=ProcessingMode.NONE,
        response_trailer_mode=ProcessingMode.SKIP,
    )


def join_endpoints(endpoints: Iterable[str]) -> str:
    return ",".join(endpoints)
