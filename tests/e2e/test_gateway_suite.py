"""kv-scorer behind Envoy configured as each gateway configures it (envoy/gateways/*.yaml:
Istio, Envoy AI Gateway, kgateway), on both ext_proc transports, TLS to the picker (all
three: Envoy AI Gateway and kgateway always, Istio with its guide's DestinationRule),
response bodies as all three send them (see RESPONSE_BODY_MODE).

Per setup: a JSON POST, GET /v1/models, a 1,000-event SSE stream (every byte compared), a
4 MB POST, a client that disconnects mid-stream and 200 concurrent streams; then no 5xx
was seen, Envoy counted no spurious ext_proc message, no failed stream, no timeout, and
the scorer's in-flight accounting is back to zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from configs import make_config
from e2e_helpers import Backend, sse_events
from prometheus_client import REGISTRY

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import GATEWAYS, render_gateway_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]

TRANSPORTS = ("asyncio", "grpcio")
# All three gateways send response bodies FULL_DUPLEX_STREAMED, and so does the suite.
RESPONSE_BODY_MODE = "FULL_DUPLEX_STREAMED"
SETUPS = [(g, t) for g in GATEWAYS for t in TRANSPORTS]


@dataclass
class Setup:
    gateway: str
    app: App
    envoy: EnvoyProcess
    backends: list[Backend]
    statuses: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listener_port}"


def uses_tls(gateway: str) -> bool:
    """Envoy AI Gateway and kgateway always connect to the picker over TLS; Istio once its
    guide's DestinationRule (TLS SIMPLE, insecureSkipVerify) is applied — tested so (the
    plaintext Istio shape runs in tests/e2e/test_gateway_fallback.py)."""
    return gateway in ("istio", "envoy-ai-gateway", "kgateway")


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=SETUPS, ids=[f"{g}-{t}" for g, t in SETUPS]
)
async def gw(request: Any, backends: list[Backend]) -> AsyncIterator[Setup]:
    gateway, transport = request.param
    eps = [b.endpoint for b in backends]
    server = make_config(eps).server.model_dump()
    server.update(extproc_transport=transport, tls={"enabled": uses_tls(gateway)})
    app = App(make_config(eps, server=server))
    await app.start()
    try:
        yaml_text = render_gateway_config(
            gateway,  # type: ignore[arg-type]
            eps,
            listener_port=0,
            admin_port=0,
            extproc_port=app.extproc_port,
            picker_tls=uses_tls(gateway),
            response_body_mode=RESPONSE_BODY_MODE,
        )
        async with EnvoyProcess(yaml_text, concurrency=2) as envoy:
            yield Setup(gateway, app, envoy, backends)
    finally:
        await app.stop()


def completion(prompt: str = "hello", **extra: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


async def wait_idle(app: App) -> None:
    """In-flight back to zero (bounded: the streams end within the test's requests)."""
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if len(app.pool.inflight) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(app.pool.inflight)} requests still in flight")


async def test_json_post(gw: Setup) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", data=completion()) as r,
    ):
        gw.statuses.append(r.status)
        assert r.status == 200, await r.text()
        doc = await r.json()
    assert doc["destination"] in {b.endpoint for b in gw.backends}


async def test_get_models(gw: Setup) -> None:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/v1/models") as r:
        gw.statuses.append(r.status)
        assert r.status == 200, await r.text()
        assert (await r.json())["method"] == "GET"


def sample(metric: str) -> float:
    labels = {"model_name": "m", "target_model_name": "m"}
    return REGISTRY.get_sample_value(metric, labels) or 0.0


async def test_sse_stream_every_byte_arrives(gw: Setup) -> None:
    tokens_before = sample("inference_objective_output_tokens_sum")
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/stream?n=1000", data=completion(stream=True)) as r,
    ):
        gw.statuses.append(r.status)
        assert r.status == 200
        got = await r.read()
        name = got.rsplit(b"[DONE] ", 1)[-1].strip().decode()
    assert got == b"".join(sse_events(1000, name))
    await wait_idle(gw.app)
    # The last event's usage reached the inference extension's token metrics.
    assert sample("inference_objective_output_tokens_sum") - tokens_before == 1000


async def test_4mb_post(gw: Setup) -> None:
    payload = completion(prompt="0123456789abcdef" * (4 * 1024 * 1024 // 16))
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", data=payload) as r:
        gw.statuses.append(r.status)
        assert r.status == 200
        doc = await r.json()
    assert doc["len"] == len(payload)
    assert doc["sha256"] == hashlib.sha256(payload).hexdigest()


async def test_client_disconnects_mid_stream(gw: Setup) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/sse", data=completion(stream=True))
        gw.statuses.append(r.status)
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: first from ")
        r.close()  # the client goes away while the backend still streams
    for b in gw.backends:
        b.release.set()
    await wait_idle(gw.app)


async def test_200_concurrent_streams(gw: Setup) -> None:
    async def one(s: aiohttp.ClientSession) -> bytes:
        async with s.post(gw.url + "/stream?n=20", data=completion(stream=True)) as r:
            gw.statuses.append(r.status)
            assert r.status == 200
            return await r.read()

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        bodies = await asyncio.gather(*(one(s) for _ in range(200)))
    for got in bodies:
        name = got.rsplit(b"[DONE] ", 1)[-1].strip().decode()
        assert got == b"".join(sse_events(20, name))
    await wait_idle(gw.app)


async def test_no_5xx_no_spurious_messages_in_flight_zero(gw: Setup) -> None:
    assert gw.statuses and all(s < 500 for s in gw.statuses), gw.statuses
    await wait_idle(gw.app)
    stats = await asyncio.to_thread(gw.envoy.stats, "http.main.ext_proc.")
    assert stats.get("http.main.ext_proc.streams_started", 0) >= 200, stats
    for k in (
        "spurious_msgs_received",
        "streams_failed",
        "failure_mode_allowed",
        "message_timeouts",
        "rejected_header_mutations",
    ):
        assert stats.get(f"http.main.ext_proc.{k}", 0) == 0, (k, stats)
