"""Module-scoped fixtures: three echo backends, an in-process kv-scorer, a real Envoy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from configs import make_config
from e2e_helpers import SUBSET_FILTER, Backend, start_backend

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import render_envoy_config


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backends() -> AsyncIterator[list[Backend]]:
    bs: list[Backend] = []
    try:
        for i in range(3):
            bs.append(await start_backend(f"b{i}"))
        yield bs
    finally:
        for b in bs:
            b.release.set()
            await b.runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scorer(backends: list[Backend], transport: str) -> AsyncIterator[App]:
    """The scorer under test, once per ext_proc transport (tests/conftest.py)."""
    app = App(make_config([b.endpoint for b in backends], server={"extproc_transport": transport}))
    await app.start()
    assert (app.extproc_h2 is not None) == (transport == "asyncio")
    try:
        yield app
    finally:
        await app.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def envoy(scorer: App) -> AsyncIterator[EnvoyProcess]:
    """The default setup: envoy.lb metadata, FULL_DUPLEX_STREAMED, fail closed."""
    cfg = render_envoy_config(0, scorer.extproc_port, 0, extra_http_filters=[SUBSET_FILTER])
    async with EnvoyProcess(cfg) as e:
        yield e
