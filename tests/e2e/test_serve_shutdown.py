"""`kv-scorer serve` as a real subprocess: SIGTERM drains gracefully and exits 0, on the
default event loop (uvloop) and on asyncio's (`server.event_loop`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2_grpc
from serve_proc import health_status, serve_ports


def request_msgs() -> list[ep.ProcessingRequest]:
    h = ep.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/completions")):
        h.request_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    h.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    b = ep.ProcessingRequest()
    b.request_body.body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    b.request_body.end_of_stream = True
    return [h, b]


@pytest.mark.slow
@pytest.mark.parametrize("event_loop", ["default", "asyncio"])
async def test_sigterm_drains_then_exits_zero(event_loop: str) -> None:
    env = dict(os.environ)
    env.pop("KV_SCORER_SERVER__EVENT_LOOP", None)
    if event_loop != "default":
        env["KV_SCORER_SERVER__EVENT_LOOP"] = event_loop
    env["KV_SCORER_SERVER__DRAIN_DELAY_S"] = "2"  # wide: loaded CI machines
    env["KV_SCORER_SERVER__GRACE_PERIOD_S"] = "10"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scorer.cli", "serve", "--worker", "127.0.0.1:7001",
        "--policy", "round_robin", "--host", "127.0.0.1", "--extproc-port", "0",
        "--health-port", "0", "--admin-port", "0",
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        expect = "uvloop" if event_loop == "default" else event_loop
        xp, hp, ap = await serve_ports(proc.stderr, 20, event_loop=expect)
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{xp}") as xch,
            grpc.aio.insecure_channel(f"127.0.0.1:{hp}") as hch,
            aiohttp.ClientSession() as http,
        ):
            health = health_pb2_grpc.HealthStub(hch)
            assert await health_status(health, "readiness") == "SERVING"
            stub = ep_grpc.ExternalProcessorStub(xch)
            # A: still in its request phase (headers sent, body not yet).
            a = stub.Process()
            head, body = request_msgs()
            await a.write(head)
            # B: routed, waiting for the end of its response.
            b = stub.Process()
            await b.write(head)
            await b.write(body)
            first = await asyncio.wait_for(b.read(), 5)
            assert first.WhichOneof("response") == "request_headers"
            await asyncio.wait_for(b.read(), 5)

            proc.send_signal(signal.SIGTERM)
            for _ in range(1500):  # readiness goes down first
                if await health_status(health, "readiness") == "NOT_SERVING":
                    break
                await asyncio.sleep(0.02)
            assert await health_status(health, "readiness") == "NOT_SERVING"
            assert await health_status(health, "liveness") == "SERVING"
            async with http.get(f"http://127.0.0.1:{ap}/readyz") as r:
                assert r.status == 503

            # After the drain delay the server sets `draining` and then releases B (closed
            # with OK: Envoy finishes its response without us). B's end is therefore the
            # signal that new streams are refused from now on.
            assert await asyncio.wait_for(b.read(), 10) is grpc.aio.EOF
            assert await b.code() == grpc.StatusCode.OK
            # A new stream is refused with UNAVAILABLE. The probe reads without writing: the
            # server ends a refused stream before reading it, and a grpcio aio client write
            # that races that end replaces the server's status with a local INTERNAL
            # "Failed execute_batch" (grpc/grpc#36066) — the old flake of this test.
            c2 = stub.Process()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(c2.read(), 5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            # A still gets its routing answer within the grace period.
            await a.write(body)
            r = await asyncio.wait_for(a.read(), 5)
            assert r.WhichOneof("response") == "request_headers"
            assert await asyncio.wait_for(a.read(), 5) is not grpc.aio.EOF  # the body
            await a.done_writing()
            assert await asyncio.wait_for(a.read(), 5) is grpc.aio.EOF
            assert await a.code() == grpc.StatusCode.OK
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
