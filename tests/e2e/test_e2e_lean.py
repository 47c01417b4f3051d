"""The lean local shape (envoy/envoy.yaml: response headers SKIP, trailers SEND) against
the full one (envoy/envoy-full.yaml: response headers SEND), through a real Envoy 1.40.

Lean: Envoy sends nothing on the response path and never waits on the scorer for it; it
closes the ext_proc stream when the HTTP stream ends (done, client gone, upstream
failed), which is where the director ends the request. These tests hold the in-flight
count to zero after every kind of end, and the routing (decisions, the headers the
worker gets, the answer the client gets) identical between the two shapes. What the
lean shape gives up is the response status: asserted too, so the docs stay true; the
upstream failures come back through Envoy's access log (health evidence).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import pytest_asyncio
from configs import make_config
from e2e_helpers import Backend
from prometheus_client import REGISTRY

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.director import Completion
from scorer.envoyproc import render_envoy_config
from scorer.pool.health import HealthMonitor

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]
BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()
STREAM_BODY = json.dumps({"model": "m", "prompt": "hello", "stream": True}).encode()
# Headers that differ per request whatever the shape (host: each Envoy's listener port).
VOLATILE = {"x-request-id", "date", "x-envoy-upstream-service-time", "host"}


class Ends:
    """The director's completion hook: the requests it ended, awaited without sleeping."""

    def __init__(self, app: App) -> None:
        self.done: list[Completion] = []
        self._changed = asyncio.Event()
        app.director.completion_hooks.append(self._hook)

    def _hook(self, c: Completion) -> None:
        self.done.append(c)
        self._changed.set()

    async def until(self, n: int) -> list[Completion]:
        async def wait() -> None:
            while len(self.done) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), 10)
        return self.done[:n]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def full_envoy(scorer: App) -> AsyncIterator[EnvoyProcess]:
    """envoy/envoy-full.yaml's shape in front of the same scorer."""
    cfg = render_envoy_config(0, scorer.extproc_port, 0, response_headers=True)
    async with EnvoyProcess(cfg) as e:
        yield e


async def test_lean_ends_every_request(
    envoy: EnvoyProcess, scorer: App, backends: list[Backend]
) -> None:
    """In flight returns to zero after a non-streaming response, a stream (counted while
    open), and a client that goes away mid-stream; none of them reports a status."""
    ends = Ends(scorer)
    base = f"http://127.0.0.1:{envoy.listener_port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", data=BODY) as r:
            assert r.status == 200
            await r.read()
        await ends.until(1)
        assert len(scorer.pool.inflight) == 0

        async with s.post(base + "/sse", data=STREAM_BODY) as r:
            first = await asyncio.wait_for(r.content.readline(), 5)
            name = first.decode().split()[-1]
            b = next(b for b in backends if b.name == name)
            # The response is streaming: the request is still in flight on its worker.
            assert scorer.pool.inflight.load(b.endpoint).requests == 1
            assert len(ends.done) == 1
            b.release.set()
            assert b"[DONE]" in await asyncio.wait_for(r.read(), 5)
        await ends.until(2)
        assert len(scorer.pool.inflight) == 0

        r = await s.post(base + "/sse", data=STREAM_BODY)
        first = await asyncio.wait_for(r.content.readline(), 5)
        b = next(b for b in backends if b.name == first.decode().split()[-1])
        assert len(scorer.pool.inflight) == 1
        r.close()  # the client goes away mid-stream
        await ends.until(3)
        assert len(scorer.pool.inflight) == 0
        b.release.set()
    assert [c.status for c in ends.done[:3]] == [None, None, None]
    assert all(c.routed and c.duration_s is not None for c in ends.done[:3])


async def test_lean_and_full_route_alike(
    envoy: EnvoyProcess, full_envoy: EnvoyProcess, scorer: App, backends: list[Backend]
) -> None:
    """The same requests through both shapes: the same decisions, the same headers at the
    worker, the same answer to the client. Only the full shape learns the status."""
    ends = Ends(scorer)
    seen: dict[str, list[tuple[str, dict[str, str], dict[str, str], bytes]]] = {}
    for label, e in (("lean", envoy), ("full", full_envoy)):
        got = seen[label] = []
        async with aiohttp.ClientSession() as s:
            for i in range(3):  # one round of round robin
                async with s.post(
                    f"http://127.0.0.1:{e.listener_port}/v1/completions",
                    data=BODY,
                    headers={"x-test-n": str(i)},
                ) as r:
                    body = await r.read()
                    client = {k.lower(): v for k, v in r.headers.items()}
                doc = json.loads(body)
                b = next(b for b in backends if b.name == doc["backend"])
                worker = {k.lower(): v for k, v in b.seen[-1].items()}
                d = scorer.decisions.query(limit=1)[0]
                assert d["endpoints"] == [b.endpoint]
                got.append(
                    (
                        f"{d['reason']} {b.name}",
                        {k: v for k, v in worker.items() if k not in VOLATILE},
                        {k: v for k, v in client.items() if k not in VOLATILE},
                        body,
                    )
                )
    assert seen["lean"] == seen["full"]
    done = await ends.until(6)
    assert len(scorer.pool.inflight) == 0
    assert [c.status for c in done] == [None] * 3 + [200] * 3


async def _post_twice(s: aiohttp.ClientSession, port: int) -> list[int]:
    """Two completions through Envoy (round robin over a dead and a live worker: one each);
    their statuses."""
    got = []
    for _ in range(2):
        async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=BODY) as r:
            await r.read()
            got.append(r.status)
    return got


async def test_upstream_failure_ends_the_request(
    backends: list[Backend], closed_port: Callable[[], int]
) -> None:
    """A worker that refuses: Envoy answers 503 itself. Both shapes end the request; only
    the full shape reports the 503 (the health monitor's request_failed evidence)."""
    dead = f"127.0.0.1:{closed_port()}"
    live = backends[0]
    # Health off: the dead worker stays eligible, so round robin sends it every other one.
    app = App(make_config([dead, live.endpoint], pool={"health": {"enabled": False}}))
    await app.start()
    ends = Ends(app)
    try:
        statuses: dict[bool, list[int]] = {}
        for full in (False, True):
            cfg = render_envoy_config(0, app.extproc_port, 0, response_headers=full)
            async with EnvoyProcess(cfg) as e, aiohttp.ClientSession() as s:
                got = statuses[full] = await _post_twice(s, e.listener_port)
            assert sorted(got) == [200, 503]
        done = await ends.until(4)
        assert len(app.pool.inflight) == 0
        by_endpoint = [(c.endpoint, c.status) for c in done]
        assert sorted(by_endpoint[:2], key=str) == sorted([(dead, None), (live.endpoint, None)])
        assert sorted(by_endpoint[2:], key=str) == sorted([(dead, 503), (live.endpoint, 200)])
    finally:
        await app.stop()


async def test_lean_upstream_failure_is_health_evidence(
    backends: list[Backend], transport: str, closed_port: Callable[[], int]
) -> None:
    """Lean: the response status never reaches ext_proc, but Envoy's access log sends the
    requests whose upstream failed (response flags UF/UC/UR/URX) to the scorer, which
    reports them as `request_failed` evidence: a dead worker without metrics or events is
    still ejected (what envoy-full.yaml learns from the response headers)."""
    dead = f"127.0.0.1:{closed_port()}"
    live = backends[0]
    app = App(make_config([dead, live.endpoint], server={"extproc_transport": transport}))
    await app.start()
    try:
        before = REGISTRY.get_sample_value(
            "kv_scorer_upstream_failure_logs_total", {"outcome": "reported"}
        )
        cfg = render_envoy_config(0, app.extproc_port, 0)
        async with EnvoyProcess(cfg) as e, aiohttp.ClientSession() as s:
            got = await _post_twice(s, e.listener_port)
            assert sorted(got) == [200, 503]
            h = app.health_monitor
            assert isinstance(h, HealthMonitor)
            w = app.pool.get(dead)
            assert w is not None
            assert await h.wait_until(lambda: not w.healthy, 10)
            assert w.health.reason == "request_failed"
            # The live worker serves everything from now on.
            for _ in range(2):
                async with s.post(
                    f"http://127.0.0.1:{e.listener_port}/v1/completions", data=BODY
                ) as r:
                    assert r.status == 200
        after = REGISTRY.get_sample_value(
            "kv_scorer_upstream_failure_logs_total", {"outcome": "reported"}
        )
        assert (after or 0) - (before or 0) == 1
        assert len(app.pool.inflight) == 0
    finally:
        await app.stop()
