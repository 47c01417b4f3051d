"""Helpers for tests that run `kv-scorer serve` as a real subprocess."""

from __future__ import annotations

import asyncio
import re

from grpc_health.v1 import health_pb2, health_pb2_grpc

# The start-up line `serve` writes on stderr once its three ports are bound.
READY = re.compile(rb"ext_proc=[\d.]+:(\d+) health=[\d.]+:(\d+) admin=[\d.]+:(\d+)")


async def serve_ports(
    stderr: asyncio.StreamReader, line_timeout_s: float, event_loop: str | None = None
) -> tuple[int, int, int]:
    """(ext_proc, health, admin) ports from `serve`'s stderr; at most 50 lines are read.
    `event_loop`: assert the process runs on that loop (the line's `loop=`)."""
    m = None
    line = b""
    for _ in range(50):
        line = await asyncio.wait_for(stderr.readline(), line_timeout_s)
        m = READY.search(line)
        if m or not line:
            break
    assert m, "serve did not report its ports"
    if event_loop is not None:
        assert f" loop={event_loop}".encode() in line, line
    xp, hp, ap = (int(g) for g in m.groups())
    return xp, hp, ap


async def health_status(stub: health_pb2_grpc.HealthStub, name: str) -> str:
    """The serving status name of one gRPC health service (e.g. "readiness")."""
    r = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
