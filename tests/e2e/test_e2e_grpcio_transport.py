"""End to end with `server.extproc_transport: grpcio` (the non-default transport) behind a
real Envoy: the whole test_e2e_envoy suite again (the `scorer` fixture below overrides
conftest's for the imported tests), plus track_responses off in both body modes
(test_e2e_variants runs the shutdown-while-streaming test on both transports). The
default (asyncio) runs every other e2e test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from e2e_helpers import Backend, scorer_config
from test_e2e_envoy import *  # noqa: F403  (re-run the suite on this transport)
from test_e2e_envoy import body

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import render_envoy_config


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scorer(backends: list[Backend]) -> AsyncIterator[App]:
    cfg = scorer_config(
        [b.endpoint for b in backends],
        server={
            "host": "127.0.0.1", "extproc_port": 0, "health_port": 0, "admin_port": 0,
            "grace_period_s": 0.5, "extproc_transport": "grpcio",
        },
    )  # fmt: skip
    app = App(cfg)
    await app.start()
    assert app.extproc_server is not None and app.extproc_h2 is None
    try:
        yield app
    finally:
        await app.stop()


@pytest.mark.parametrize("transport", ["asyncio", "grpcio"])
async def test_track_responses_off_both_body_modes(backends: list[Backend], transport: str) -> None:
    cfg = scorer_config(
        [b.endpoint for b in backends],
        server={"host": "127.0.0.1", "extproc_port": 0, "health_port": 0, "admin_port": 0,
                "extproc_transport": transport},
        extproc={"track_responses": False},
    )  # fmt: skip
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
                    async with s.post(url, data=body()) as r:
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
