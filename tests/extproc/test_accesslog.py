"""scorer.extproc.accesslog: which logged requests become health evidence, and the log
stream's end at shutdown. Through a real Envoy: tests/e2e/test_e2e_lean.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2

from scorer.extproc.accesslog import UpstreamFailureLog, failed_endpoint
from scorer.pool.health import REQUEST_FAILED


def entry(status: int | None, dest: str | None = None, upstream: str | None = None) -> Any:
    e = al.HTTPAccessLogEntry()
    if status is not None:
        e.response.response_code.value = status
    props = e.common_properties
    if dest is not None:
        ns = props.metadata.filter_metadata["envoy.lb"]
        ns.fields["x-gateway-destination-endpoint"].string_value = dest
    if upstream is not None:
        host, port = upstream.rsplit(":", 1)
        props.upstream_remote_address.socket_address.address = host
        props.upstream_remote_address.socket_address.port_value = int(port)
    return e


def test_endpoint_is_the_decided_primary_else_the_upstream_address() -> None:
    assert failed_endpoint(entry(503, "10.0.0.1:8000")) == ("10.0.0.1:8000", 503)
    assert failed_endpoint(entry(503, "10.0.0.1:8000, 10.0.0.2:8000")) == ("10.0.0.1:8000", 503)
    assert failed_endpoint(entry(502, None, "10.0.0.3:9")) == ("10.0.0.3:9", 502)
    assert failed_endpoint(entry(503, "", "10.0.0.3:9")) == ("10.0.0.3:9", 503)
    assert failed_endpoint(entry(None)) == (None, 0)


class Pool:
    def __init__(self) -> None:
        self.reports: list[tuple[str, str]] = []

    def report(self, endpoint: str, kind: str, detail: str = "") -> None:
        self.reports.append((endpoint, kind))


def test_only_502_and_503_with_an_endpoint_are_reported() -> None:
    pool = Pool()
    log = UpstreamFailureLog(pool)  # type: ignore[arg-type]
    msg = als_pb2.StreamAccessLogsMessage()
    msg.http_logs.log_entry.extend(
        [
            entry(503, "10.0.0.1:1"),
            entry(502, None, "10.0.0.2:2"),
            entry(504, "10.0.0.3:3"),  # a timeout is not evidence (scorer.pool.health)
            entry(503),  # no endpoint
            entry(200, "10.0.0.4:4"),
        ]
    )
    assert log.take(msg) == 2
    assert pool.reports == [("10.0.0.1:1", REQUEST_FAILED), ("10.0.0.2:2", REQUEST_FAILED)]


class Stream:
    """A log stream that delivers `msgs`, then waits for more (Envoy keeps it open)."""

    def __init__(self, msgs: list[Any]) -> None:
        self.msgs = msgs
        self.idle = asyncio.Event()

    async def read(self) -> Any:
        if self.msgs:
            return self.msgs.pop(0)
        self.idle.set()
        await asyncio.Event().wait()  # never set: only a cancel ends this read


@pytest.mark.asyncio
async def test_release_ends_open_streams_with_ok() -> None:
    pool = Pool()
    log = UpstreamFailureLog(pool)  # type: ignore[arg-type]
    msg = als_pb2.StreamAccessLogsMessage()
    msg.http_logs.log_entry.append(entry(503, "10.0.0.1:1"))
    stream = Stream([msg])
    task = asyncio.create_task(log.StreamAccessLogs(None, stream))  # type: ignore[arg-type]
    await asyncio.wait_for(stream.idle.wait(), 5)
    assert log.release() == 1
    resp = await asyncio.wait_for(task, 5)
    assert isinstance(resp, als_pb2.StreamAccessLogsResponse)
    assert pool.reports == [("10.0.0.1:1", REQUEST_FAILED)]
