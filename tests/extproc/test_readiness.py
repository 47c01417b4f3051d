"""Start-up readiness: the health names wait for workers and KV-event streams (real ZMQ)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scorer.api.readiness import ReadinessGate
from scorer.config import WorkerConfig
from scorer.pool.workers import Pool

READY_NAMES = [
    "",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_gate_waits_for_workers_then_streams_then_times_out() -> None:
    clock = Clock()
    pool = Pool([])
    streams: dict[str, bool] = {}
    gate = ReadinessGate(pool, lambda: streams, 5.0, clock)
    gate.start()
    st = gate.check()
    assert not st.ready and "pool is empty" in st.reason
    pool = Pool([WorkerConfig(endpoint="10.0.0.1:8000"), WorkerConfig(endpoint="10.0.0.2:8000")])
    gate = ReadinessGate(pool, lambda: streams, 5.0, clock)
    gate.start()
    streams.update({"10.0.0.1:8000": True, "10.0.0.2:8000": False})
    clock.t += 4.9
    st = gate.check()
    assert not st.ready and "1 KV-event stream" in st.reason and "10.0.0.2:8000" in st.reason
    clock.t += 0.1  # the timeout: ready with the stream still connecting
    assert gate.check().ready
    # Open once, open for good (a stream dropping later does not unready the picker).
    streams["10.0.0.1:8000"] = False
    assert gate.check().ready


def test_gate_opens_when_every_stream_connected() -> None:
    clock = Clock()
    pool = Pool([WorkerConfig(endpoint="10.0.0.1:8000")])
    streams = {"10.0.0.1:8000": False}
    gate = ReadinessGate(pool, lambda: streams, 60.0, clock)
    gate.start()
    assert not gate.check().ready
    streams["10.0.0.1:8000"] = True
    assert gate.check().ready


async def statuses(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        out = {}
        for name in [*READY_NAMES, "liveness"]:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
            out[name] = r.status
        return out


async def wait_serving(port: int, name: str = "inference-extension") -> None:
    """Health Watch until SERVING (event-driven; bounded)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=10)
        async for r in call:
            if r.status == SERVING:
                call.cancel()
                return
    raise AssertionError("health Watch ended before SERVING")


async def readyz(port: int) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/readyz") as r:
        return r.status, await r.text()


async def test_readiness_waits_for_the_event_stream_to_connect(
    harness: Any, closed_port: Callable[[], int]
) -> None:
    port = closed_port()  # nothing publishes here yet
    worker = {"endpoint": "127.0.0.1:7001", "events": f"tcp://127.0.0.1:{port}"}
    h = await harness(
        pool={"workers": [worker]},
        events={"reconnect_interval_s": 0.05},
        server={"readiness_events_timeout_s": 600},
    )
    st = await statuses(h.app.health_port)
    assert all(st[n] == NOT_SERVING for n in READY_NAMES), st
    assert st["liveness"] == SERVING
    code, text = await readyz(h.app.admin_port)
    assert code == 503 and "KV-event stream" in text and "127.0.0.1:7001" in text

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind(f"tcp://127.0.0.1:{port}")
        await asyncio.wait_for(wait_serving(h.app.health_port), 10)
    finally:
        pub.close()
        ctx.destroy(linger=0)
    st = await statuses(h.app.health_port)
    assert all(st[n] == SERVING for n in READY_NAMES), st
    assert (await readyz(h.app.admin_port))[0] == 200


async def test_readiness_opens_after_the_events_timeout(
    harness: Any, closed_port: Callable[[], int]
) -> None:
    worker = {"endpoint": "127.0.0.1:7001", "events": f"tcp://127.0.0.1:{closed_port()}"}
    h = await harness(pool={"workers": [worker]}, server={"readiness_events_timeout_s": 0.3})
    await asyncio.wait_for(wait_serving(h.app.health_port), 10)
    assert not h.app.events.status("127.0.0.1:7001").connected


async def test_empty_pool_is_not_ready(harness: Any) -> None:
    h = await harness(pool={"workers": []})
    st = await statuses(h.app.health_port)
    assert st["inference-extension"] == NOT_SERVING and st["liveness"] == SERVING
    code, text = await readyz(h.app.admin_port)
    assert code == 503 and "pool is empty" in text
