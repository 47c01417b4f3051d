"""End to end: client → real Envoy (ext_proc, FULL_DUPLEX_STREAMED, envoy.lb metadata) →
kv-scorer → real HTTP backends."""

from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest
from e2e_helpers import Backend

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]
DEST = "x-gateway-destination-endpoint"


def body(model: str = "m", **extra: object) -> bytes:
    return json.dumps({"model": model, "prompt": "hello", **extra}).encode()


async def wait_idle(app: App) -> None:
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if len(app.pool.inflight) == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(app.pool.inflight)} requests still in flight")


async def test_routing_follows_round_robin(envoy: EnvoyProcess, scorer: App, backends) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
    names = []
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.post(url, data=body()) as r:
                assert r.status == 200
                doc = await r.json()
                names.append(doc["backend"])
                # What the backend got is what the scorer decided.
                b = next(b for b in backends if b.name == doc["backend"])
                assert doc["destination"] == b.endpoint
    assert sorted(names[:3]) == ["b0", "b1", "b2"]
    assert names[3:] == names[:3]
    await wait_idle(scorer)
    assert sum(w.routed_total for w in scorer.pool.inflight.loads.values()) >= 6


async def test_forged_destination_header_never_survives(
    envoy: EnvoyProcess, backends: list[Backend]
) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=body(), headers={DEST: "127.0.0.1:1"}) as r,
    ):
        assert r.status == 200
        doc = await r.json()
    assert doc["destination"] in {b.endpoint for b in backends}


async def test_subset_hint_honoured(envoy: EnvoyProcess, backends: list[Backend]) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/chat/completions"
    allowed = {backends[1].endpoint, backends[2].endpoint}
    got = set()
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            hdr = {"x-test-subset": ",".join(sorted(allowed))}
            async with s.post(url, data=body(), headers=hdr) as r:
                assert r.status == 200
                got.add((await r.json())["destination"])
    assert got == allowed


@pytest.mark.parametrize(
    ("payload", "headers", "status", "code"),
    [
        (b"{oops", {}, 400, "bad_request"),
        (b'{"prompt": "no model"}', {}, 400, "bad_request"),
        (None, {"x-test-subset": "10.0.0.1:1"}, 503, "subset_empty"),
    ],
)
async def test_error_paths_return_openai_errors(
    envoy: EnvoyProcess, payload: bytes | None, headers: dict[str, str], status: int, code: str
) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=payload or body(), headers=headers) as r,
    ):
        assert r.status == status
        assert r.headers["content-type"] == "application/json"
        err = (await r.json())["error"]
    assert err["code"] == code
    assert set(err) == {"message", "type", "param", "code"}


async def test_bodyless_get_is_routed(envoy: EnvoyProcess, scorer: App) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/models"
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        assert (await r.json())["method"] == "GET"
    assert scorer.decisions.query(limit=1, reason="no_body")


async def test_sse_stream_arrives_unbuffered(
    envoy: EnvoyProcess, scorer: App, backends: list[Backend]
) -> None:
    url = f"http://127.0.0.1:{envoy.listener_port}/sse"
    async with aiohttp.ClientSession() as s, s.post(url, data=body(stream=True)) as r:
        assert r.status == 200
        first = await asyncio.wait_for(r.content.readline(), 5)
        # The backend is still holding the stream open: the event came through unbuffered.
        assert first.startswith(b"data: first from b")
        name = first.decode().split()[-1]
        b = next(b for b in backends if b.name == name)
        # A stream's headers come before its prefill ends (vLLM) and this Envoy sends no
        # response body: the request stays in prefill until its estimated prefill end.
        load = scorer.pool.inflight.load(b.endpoint)
        assert load.requests == 1 and load.prefill_tokens > 0
        director = scorer.director
        real_clock = director.clock
        director.clock = lambda: real_clock() + 3600.0
        try:
            assert director.expire_prefill() == 1
        finally:
            director.clock = real_clock
        assert load.requests == 1 and load.prefill_tokens == 0 and load.decode_blocks > 0
        b.release.set()
        rest = await asyncio.wait_for(r.read(), 5)
    assert b"[DONE]" in rest
    await wait_idle(scorer)


async def test_8mb_body_full_duplex_arrives_intact(envoy: EnvoyProcess) -> None:
    payload = body(prompt="0123456789abcdef" * (8 * 1024 * 1024 // 16))
    assert len(payload) > 8 * 1024 * 1024
    url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, data=payload) as r:
        assert r.status == 200
        doc = await r.json()
    assert doc["len"] == len(payload)
    assert doc["sha256"] == hashlib.sha256(payload).hexdigest()


async def test_envoy_saw_no_ext_proc_errors(envoy: EnvoyProcess) -> None:
    stats = await asyncio.to_thread(envoy.stats, "http.main.ext_proc.")
    assert stats, "no ext_proc stats"
    for k in ("streams_failed", "failure_mode_allowed", "message_timeouts"):
        assert stats.get(f"http.main.ext_proc.{k}", 0) == 0, (k, stats)
