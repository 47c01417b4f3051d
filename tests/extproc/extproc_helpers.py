"""Helpers for the ext_proc contract tests: config and real ext_proc v3 messages."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from configs import make_config
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from scorer.app import App

WORKERS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.2:7003"]
PM = processing_mode_pb2.ProcessingMode


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


class Harness:
    """A started App and an ext_proc stub on a real channel to its port."""

    def __init__(self, app: App, channel: grpc.aio.Channel) -> None:
        self.app = app
        self.channel = channel
        self.stub = ep_grpc.ExternalProcessorStub(channel)

    def stream(self) -> Any:
        return self.stub.Process()


@contextlib.asynccontextmanager
async def harnesses(transport: str) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """`make(**config_sections)` starts an App on `transport` over WORKERS (round robin
    unless a policy is given) with a channel to its ext_proc port; every App is stopped
    when the block ends."""
    started: list[tuple[App, grpc.aio.Channel]] = []

    async def make(**over: Any) -> Harness:
        over["server"] = {"extproc_transport": transport, **over.get("server", {})}
        app = App(make_config(WORKERS, **over))
        await app.start()
        assert (app.extproc_h2 is not None) == (transport == "asyncio")
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}")
        started.append((app, ch))
        return Harness(app, ch)

    try:
        yield make
    finally:
        for app, ch in started:
            await ch.close()
            app.config.server.grace_period_s = 0.5
            await app.stop()
