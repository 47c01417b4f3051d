"""End to end with the other Envoy setups: header mode + BUFFERED, track_responses off
(both body modes, both transports), and the scorer down (fail closed by default, fail open
with failure_mode_allow); a streaming response surviving the scorer's shutdown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import pytest
from configs import make_config
from e2e_helpers import Backend

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import render_envoy_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]
BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()


async def post(port: int, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.text()


async def test_header_mode_buffered(scorer: App, backends: list[Backend]) -> None:
    cfg = render_envoy_config(0, scorer.extproc_port, 0, mode="header", body_mode="BUFFERED")
    async with EnvoyProcess(cfg) as e:
        seen = set()
        for _ in range(3):
            status, text = await post(
                e.listener_port, BODY, {"x-gateway-destination-endpoint": "127.0.0.1:1"}
            )
            assert status == 200, text
            seen.add(json.loads(text)["backend"])
        assert seen == {"b0", "b1", "b2"}
        status, text = await post(e.listener_port, b"{oops")
        assert status == 400 and json.loads(text)["error"]["code"] == "bad_request"
        # Documented limit: BUFFERED bodies over Envoy's 1 MiB buffer get 413 from Envoy.
        status, _ = await post(e.listener_port, b"x" * (2 * 1024 * 1024))
        assert status == 413


async def test_track_responses_off(backends: list[Backend]) -> None:
    app = App(make_config([b.endpoint for b in backends], extproc={"track_responses": False}))
    await app.start()
    try:
        cfg = render_envoy_config(0, app.extproc_port, 0, track_responses=False)
        async with EnvoyProcess(cfg) as e:
            for _ in range(4):
                status, text = await post(e.listener_port, BODY)
                assert status == 200, text
            assert len(app.pool.inflight) == 0
            assert all(w.routed_total == 0 for w in app.pool.inflight.loads.values())
            stats = await asyncio.to_thread(e.stats, "http.main.ext_proc.")
            assert stats["http.main.ext_proc.streams_failed"] == 0
            assert stats["http.main.ext_proc.streams_started"] == 4
    finally:
        await app.stop()


async def test_track_responses_off_both_body_modes(backends: list[Backend], transport: str) -> None:
    cfg = make_config(
        [b.endpoint for b in backends],
        server={"extproc_transport": transport},
        extproc={"track_responses": False},
    )
    app = App(cfg)
    await app.start()
    try:
        for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
            envoy_cfg = render_envoy_config(
                0, app.extproc_port, 0, body_mode=mode, track_responses=False
            )
            async with EnvoyProcess(envoy_cfg) as e, aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{e.listener_port}/v1/completions"
                seen = set()
                for _ in range(6):
                    async with s.post(url, data=BODY) as r:
                        assert r.status == 200, await r.text()
                        seen.add(json.loads(await r.text())["backend"])
                assert seen == {"b0", "b1", "b2"}
                stats = await asyncio.to_thread(e.stats, "http.main.ext_proc.")
                assert stats.get("http.main.ext_proc.streams_failed", 0) == 0, stats
                for k in ("streams_failed", "failure_mode_allowed", "message_timeouts"):
                    assert stats.get(f"http.main.ext_proc.{k}", 0) == 0, (k, stats)
                closed = stats["http.main.ext_proc.streams_closed"]
                assert closed + stats["http.main.ext_proc.server_half_closed"] >= 6, stats
        assert len(app.pool.inflight) == 0
    finally:
        await app.stop()


async def test_scorer_down_fails_closed_by_default(
    backends: list[Backend], closed_port: Callable[[], int]
) -> None:
    cfg = render_envoy_config(0, closed_port(), 0)
    async with EnvoyProcess(cfg) as e:
        before = sum(len(b.seen) for b in backends)
        status, _ = await post(e.listener_port, BODY)
        assert 500 <= status < 600
        assert sum(len(b.seen) for b in backends) == before  # no backend reached


async def test_scorer_down_fail_open(
    backends: list[Backend], closed_port: Callable[[], int]
) -> None:
    port = closed_port()
    # Envoy 1.40 does not fail open in FULL_DUPLEX_STREAMED: still a 500 (docs/envoy.md).
    async with EnvoyProcess(render_envoy_config(0, port, 0, failure_mode_allow=True)) as e:
        status, _ = await post(e.listener_port, BODY)
        assert status == 500
    # BUFFERED without a default destination: the request continues, but ORIGINAL_DST has
    # no endpoint → 503 from Envoy.
    cfg = render_envoy_config(0, port, 0, failure_mode_allow=True, body_mode="BUFFERED")
    async with EnvoyProcess(cfg) as e:
        status, text = await post(e.listener_port, BODY)
        assert status == 503, text
        stats = await asyncio.to_thread(e.stats, "http.main.ext_proc.failure_mode_allowed")
        assert stats["http.main.ext_proc.failure_mode_allowed"] >= 1
    # BUFFERED with fail_open_endpoint: it reaches that backend; a client-sent destination
    # header is ignored.
    target = backends[2]
    cfg = render_envoy_config(
        0,
        port,
        0,
        failure_mode_allow=True,
        body_mode="BUFFERED",
        fail_open_endpoint=target.endpoint,
    )
    async with EnvoyProcess(cfg) as e:
        status, text = await post(
            e.listener_port, BODY, {"x-gateway-destination-endpoint": backends[0].endpoint}
        )
        assert status == 200
        assert json.loads(text)["backend"] == target.name


async def test_fail_open_default_is_overwritten_by_the_scorer(
    scorer: App, backends: list[Backend]
) -> None:
    cfg = render_envoy_config(
        0,
        scorer.extproc_port,
        0,
        failure_mode_allow=True,
        body_mode="BUFFERED",
        fail_open_endpoint=backends[0].endpoint,
    )
    async with EnvoyProcess(cfg) as e:
        seen = set()
        for _ in range(3):
            status, text = await post(e.listener_port, BODY)
            assert status == 200
            seen.add(json.loads(text)["backend"])
        assert seen == {"b0", "b1", "b2"}


async def test_streaming_response_survives_scorer_shutdown(
    backends: list[Backend], transport: str
) -> None:
    app = App(make_config([backends[0].endpoint], server={"extproc_transport": transport}))
    await app.start()
    stopped = False
    try:
        async with EnvoyProcess(render_envoy_config(0, app.extproc_port, 0)) as e:
            url = f"http://127.0.0.1:{e.listener_port}/sse"
            backends[0].release.clear()
            async with aiohttp.ClientSession() as s, s.post(url, data=BODY) as r:
                assert (await asyncio.wait_for(r.content.readline(), 5)).startswith(b"data:")
                app.config.server.grace_period_s = 0.2
                await app.stop()
                stopped = True
                backends[0].release.set()
                rest = await asyncio.wait_for(r.read(), 5)
            assert b"[DONE]" in rest
    finally:
        if not stopped:
            await app.stop()
