"""Upstream failures from Envoy's gRPC access log: the lean shape's fault evidence.

The lean envoy/envoy.yaml skips the response headers, so the director never sees the
502/503 Envoy answers itself when a worker refuses or resets the connection (the health
monitor's `request_failed` evidence with envoy-full.yaml). That envoy.yaml instead logs
only such requests (an access-log filter on Envoy's upstream-failure response flags)
to `envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs` on the ext_proc port,
one entry at a time, off the request path: a request that succeeds costs nothing here.

Each entry names the endpoint we routed to (the `envoy.lb` metadata the scorer set,
`x-gateway-destination-endpoint`, forwarded by the access log's common properties; the
upstream address Envoy tried when that is missing) and its status; a 502/503 is reported
as `request_failed` evidence (scorer.pool.health confirms it with a probe, as for a
followed response: an entry from anyone who can reach the ext_proc port costs one probe
and cannot eject a worker that answers it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2
from prometheus_client import Counter

from scorer.extproc.protocol import DESTINATION_HEADER, DESTINATION_NAMESPACE
from scorer.extproc.transport import H2GrpcServer, StreamContext
from scorer.pool.health import REQUEST_FAILED, UPSTREAM_FAILED
from scorer.pool.workers import Pool

log = logging.getLogger(__name__)
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
ENTRIES = Counter(
    "kv_scorer_upstream_failure_logs_total",
    "Envoy access-log entries of requests whose upstream failed (lean envoy.yaml), by "
    "outcome (reported: 502/503 reported as evidence against the endpoint; ignored: "
    "another status or no endpoint)",
    ["outcome"],
)
_REPORTED = ENTRIES.labels("reported")
_IGNORED = ENTRIES.labels("ignored")


def failed_endpoint(entry: al.HTTPAccessLogEntry) -> tuple[str | None, int]:
    """(the endpoint the request was routed to, its status) from one log entry."""
    status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    props = entry.common_properties
    meta = props.metadata.filter_metadata.get(DESTINATION_NAMESPACE)
    if meta is not None and DESTINATION_HEADER in meta.fields:
        # A fallback list names its primary first (the one ORIGINAL_DST connects to).
        first = meta.fields[DESTINATION_HEADER].string_value.split(",", 1)[0].strip()
        if first:
            return first, status
    sa = props.upstream_remote_address.socket_address
    if sa.address and sa.port_value:
        return f"{sa.address}:{sa.port_value}", status
    return None, status


class UpstreamFailureLog:
    """The AccessLogService: each logged 502/503 → `pool.report(endpoint, request_failed)`."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        # Open log streams (Envoy keeps one per connection open while it runs): ended
        # with OK at shutdown (`release`), not held for the grace period.
        self._streams: set[asyncio.Task[Any]] = set()
        self._releasing = False

    def take(self, msg: als_pb2.StreamAccessLogsMessage) -> int:
        """Report the failures of one message; returns how many were reported."""
        n = 0
        for entry in msg.http_logs.log_entry:
            endpoint, status = failed_endpoint(entry)
            if endpoint is None or status not in UPSTREAM_FAILED:
                _IGNORED.inc()
                continue
            _REPORTED.inc()
            self.pool.report(endpoint, REQUEST_FAILED, f"HTTP {status} (access log)")
            n += 1
        return n

    async def StreamAccessLogs(  # the gRPC method name
        self, request_iterator: AsyncIterator[Any] | None, context: StreamContext
    ) -> als_pb2.StreamAccessLogsResponse:
        """Read Envoy's log stream until it ends (Envoy keeps it open while it runs)."""
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        try:
            while not self._releasing:
                msg = await context.read()
                if msg is _EOF:
                    break
                assert isinstance(msg, als_pb2.StreamAccessLogsMessage)
                self.take(msg)
        except asyncio.CancelledError:
            if not self._releasing:
                raise
        finally:
            self._streams.discard(task)  # type: ignore[arg-type]
        return als_pb2.StreamAccessLogsResponse()

    def release(self) -> int:
        """Shutdown: end every open log stream with OK now. Returns how many."""
        self._releasing = True
        n = len(self._streams)
        for t in list(self._streams):
            t.cancel()
        return n


def add_to_h2_server(service: UpstreamFailureLog, server: H2GrpcServer) -> None:
    """Register on our asyncio HTTP/2 server (a client stream: one answer at its end)."""

    async def handler(_: Any, stream: StreamContext) -> None:
        await stream.write(await service.StreamAccessLogs(None, stream))

    server.add_handler(PATH, handler, als_pb2.StreamAccessLogsMessage.FromString)


def add_to_server(service: UpstreamFailureLog, server: grpc.aio.Server) -> None:
    """Register on a grpc.aio server."""
    handler = grpc.stream_unary_rpc_method_handler(
        service.StreamAccessLogs,
        request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
        response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "envoy.service.accesslog.v3.AccessLogService", {"StreamAccessLogs": handler}
            ),
        )
    )
