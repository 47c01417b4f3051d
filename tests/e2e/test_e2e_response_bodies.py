"""Response bodies through real Envoy in FULL_DUPLEX_STREAMED (what every inference gateway
configures): every chunk answered with a streamed_response, nothing spurious, usage read.

Both transports (asyncio and grpcio), each with its own scorer and Envoy.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from configs import make_config

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import render_envoy_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]

USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}


async def _worker() -> tuple[web.AppRunner, str]:
    """A worker answering like vLLM: JSON with usage, SSE with usage in the last event."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        doc = json.loads(body)
        if doc.get("stream"):
            n = int(doc.get("n_chunks", 50))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                ev = {"choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
                await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {"len": len(body), "sha256": hashlib.sha256(body).hexdigest(), "usage": USAGE}
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="not json {", content_type="text/plain")

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/plain", plain)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(transport: str) -> AsyncIterator[tuple[App, EnvoyProcess]]:
    """Envoy + a scorer on each ext_proc transport (the `transport` fixture)."""
    runner, ep = await _worker()
    cfg = make_config([ep], server={"extproc_transport": transport})
    app = App(cfg)
    await app.start()
    envoy_cfg = render_envoy_config(
        0, app.extproc_port, 0, response_body_mode="FULL_DUPLEX_STREAMED"
    )
    try:
        async with EnvoyProcess(envoy_cfg) as envoy:
            yield app, envoy
    finally:
        await app.stop()
        await runner.cleanup()


async def _idle(app: App) -> None:
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if len(app.director) == 0 and len(app.pool.inflight) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still in flight")


def _spurious(envoy: EnvoyProcess) -> int:
    got = {k: v for k, v in envoy.stats().items() if k.endswith("ext_proc.spurious_msgs_received")}
    assert got, "Envoy exports ext_proc.spurious_msgs_received"
    return sum(got.values())


async def test_json_post_models_and_large_body(stack: tuple[App, EnvoyProcess]) -> None:
    app, envoy = stack
    base = f"http://127.0.0.1:{envoy.listener_port}"
    big = json.dumps({"model": "m", "prompt": "x" * 200_000}).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", data=b'{"model": "m", "prompt": "hi"}') as r:
            assert r.status == 200
            assert (await r.json())["usage"] == USAGE
        async with s.get(base + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
        async with s.post(base + "/v1/completions", data=big) as r:
            assert r.status == 200
            doc = await r.json()
            assert doc["len"] == len(big) and doc["sha256"] == hashlib.sha256(big).hexdigest()
        async with s.post(base + "/plain", data=b'{"model": "m"}') as r:
            assert r.status == 200 and await r.text() == "not json {"
    await _idle(app)
    assert _spurious(envoy) == 0
    got = [d for d in app.decisions.query(limit=10) if d["status_from"] == "response"]
    assert got and all(d["status"] == 200 for d in got)


async def test_sse_every_byte_arrives_and_usage_is_read(stack: tuple[App, EnvoyProcess]) -> None:
    app, envoy = stack
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
    body = json.dumps({"model": "m", "prompt": "p", "stream": True, "n_chunks": 300}).encode()
    seen: list[Any] = []
    app.director.completion_hooks.append(seen.append)
    try:
        async with aiohttp.ClientSession() as s, s.post(url, data=body) as r:
            assert r.status == 200
            raw = await r.read()
        await _idle(app)
    finally:
        app.director.completion_hooks.remove(seen.append)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert len(events) == 302 and events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:300]] == [
        f"t{i}" for i in range(300)
    ]
    assert _spurious(envoy) == 0
    done = [c for c in seen if c.routed]
    assert len(done) == 1
    c = done[0]
    assert (c.input_tokens, c.output_tokens, c.cached_tokens) == (11, 7, 4)
    assert c.response_bytes == len(raw) and c.status == 200
