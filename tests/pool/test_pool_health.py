"""Worker health from evidence (scorer.pool.health), in process with real sockets.

A worker is a real TCP listener on loopback; "killing" it closes the port, "bringing it
back" listens on the same port again. Evidence comes from the parts that see it: the
scraper (refused metrics connection), the KV-event subscriber (ZMQ disconnect) and
`Pool.report` (the data path's failed requests).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web
from configs import make_config

from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.events.ingest import EventIngest
from scorer.index import BlockIndex
from scorer.pool.health import EJECTIONS, EVIDENCE, HealthMonitor, describe
from scorer.pool.scrape import LoadScraper
from scorer.pool.workers import Pool, Worker


@asynccontextmanager
async def listening(port: int) -> AsyncIterator[asyncio.Server]:
    """A worker's serving port: accepts and closes connections."""

    async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


def _config(workers: list[Any], **over: Any) -> Config:
    sections: dict[str, Any] = {
        "pool": {"health": {"probe_interval_s": 0.05, "probe_max_interval_s": 0.2}},
        "load": {"scrape_timeout_s": 0.2},
        **over,
    }
    return make_config(workers, **sections)


def _count(counter: Any, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


async def test_killed_worker_is_ejected_on_evidence_and_readmitted_when_back(
    closed_port: Callable[[], int],
) -> None:
    alive_port, dead_port = closed_port(), closed_port()
    alive, dead = f"127.0.0.1:{alive_port}", f"127.0.0.1:{dead_port}"
    config = _config([alive, dead])
    pool = Pool.from_config(config)
    index = BlockIndex(config.index)
    hasher = BlockHasher(16)
    keys = hasher.keys(list(range(64)))
    index.insert_speculative(dead, keys, ttl_s=3600)
    pool.inflight.routed("r1", dead, 100, 6.0, 6.0)
    monitor = HealthMonitor(config, pool, index)
    await monitor.start()
    before = _count(EJECTIONS, "request_failed")
    try:
        async with listening(alive_port):
            # Evidence against the live worker is dismissed by its probe.
            pool.report(alive, "request_failed", "HTTP 503")
            w_alive = pool.get(alive)
            assert w_alive is not None
            assert await monitor.wait_until(lambda: w_alive.health.dismissed == 1, 10)
            assert w_alive.healthy

            # The dead worker's port is closed: the probe confirms, it is ejected.
            pool.report(dead, "request_failed", "HTTP 503")
            w_dead = pool.get(dead)
            assert w_dead is not None
            assert await monitor.wait_until(lambda: not w_dead.healthy, 10)
            assert _count(EJECTIONS, "request_failed") == before + 1
            assert [w.endpoint for w in pool.eligible(None, None)] == [alive]
            # Its cache and in-flight accounting are gone; a late finish is harmless.
            assert dead not in index.match(keys)
            assert w_dead.inflight.requests == 0 and w_dead.inflight.prefill_tokens == 0
            pool.inflight.finished("r1")
            assert w_dead.inflight.requests == 0
            view = describe(w_dead, 0.0)
            assert view["reason"] == "request_failed"
            assert "Refused" in view["detail"] or "refused" in view["detail"]

            # More evidence while ejected changes nothing.
            pool.report(dead, "events_dropped")
            assert w_dead.health.ejections == 1

            # Back on the same port: readmitted by the backoff probes, starting empty.
            async with listening(dead_port):
                assert await monitor.wait_until(lambda: w_dead.healthy, 10)
                assert {w.endpoint for w in pool.eligible(None, None)} == {alive, dead}
                assert w_dead.health.reason is None
                assert dead not in index.match(keys)
    finally:
        await monitor.stop()


async def test_whole_fleet_scrape_timeout_ejects_nobody(closed_port: Callable[[], int]) -> None:
    """Every worker's metrics endpoint hangs past the scrape timeout: no evidence, nobody
    ejected (DESIGN.md: a slow scrape is never read as a dead worker)."""
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    mport = runner.addresses[0][1]
    # Serving ports closed too: if a timeout were taken as evidence, the probe would eject.
    workers = [
        {
            "endpoint": f"127.0.0.1:{closed_port()}",
            "metrics_url": f"http://127.0.0.1:{mport}/metrics",
        }
        for _ in range(3)
    ]
    config = _config(workers)
    pool = Pool.from_config(config)
    monitor = HealthMonitor(config, pool, BlockIndex(config.index))
    scraper = LoadScraper(config, pool)
    await monitor.start()
    await scraper.start()  # the loop runs too; scrape_all below is one deterministic round
    before = sum(_count(EVIDENCE, "metrics_refused", o) for o in ("ejected", "dismissed"))
    try:
        await scraper.scrape_all()
        assert all(w.scraped.error == "timeout" for w in pool)
        assert all(w.healthy for w in pool)
        assert all(w.health.last_evidence is None for w in pool)
        after = sum(_count(EVIDENCE, "metrics_refused", o) for o in ("ejected", "dismissed"))
        assert after == before
    finally:
        release.set()
        await scraper.stop()
        await monitor.stop()
        await runner.cleanup()


async def test_refused_metrics_port_is_evidence_and_the_serving_port_decides(
    closed_port: Callable[[], int],
) -> None:
    serving = closed_port()
    up = f"127.0.0.1:{serving}"
    down = f"127.0.0.1:{closed_port()}"
    closed_metrics = f"http://127.0.0.1:{closed_port()}/metrics"
    config = _config(
        [
            {"endpoint": up, "metrics_url": closed_metrics},
            {"endpoint": down, "metrics_url": closed_metrics},
        ]
    )
    pool = Pool.from_config(config)
    monitor = HealthMonitor(config, pool, BlockIndex(config.index))
    scraper = LoadScraper(config, pool)
    await monitor.start()
    await scraper.start()
    try:
        async with listening(serving):
            await scraper.scrape_all()
            w_up, w_down = pool.get(up), pool.get(down)
            assert w_up is not None and w_down is not None
            assert await monitor.wait_until(
                lambda: not w_down.healthy and w_up.health.dismissed >= 1, 10
            )
            assert w_up.healthy  # metrics refused, serving port fine: stays in
            assert w_down.health.reason == "metrics_refused"
    finally:
        await scraper.stop()
        await monitor.stop()


async def test_dropped_event_stream_is_evidence(closed_port: Callable[[], int]) -> None:
    """The worker's ZMQ PUB goes away (process killed): the subscriber's socket monitor
    reports it, the probe of its closed serving port confirms, it is ejected."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    zport = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"127.0.0.1:{closed_port()}"
    config = _config([{"endpoint": endpoint, "events": f"tcp://127.0.0.1:{zport}"}])
    pool = Pool.from_config(config)
    index = BlockIndex(config.index)
    ingest = EventIngest(config, pool, index, BlockHasher(16))
    monitor = HealthMonitor(config, pool, index)
    await monitor.start()
    await ingest.start()
    try:
        sub = ingest.subscribers[endpoint]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not sub.status.connected and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert sub.status.connected
        pub.close(linger=0)
        w = pool.get(endpoint)
        assert w is not None
        assert await monitor.wait_until(lambda: not w.healthy, 10)
        assert w.health.reason == "events_dropped"
    finally:
        await ingest.stop()
        await monitor.stop()
        ctx.destroy(linger=0)


async def test_disabled_health_never_ejects(closed_port: Callable[[], int]) -> None:
    dead = f"127.0.0.1:{closed_port()}"
    config = _config([dead])
    config.pool.health.enabled = False
    pool = Pool.from_config(config)
    monitor = HealthMonitor(config, pool)
    await monitor.start()
    try:
        pool.report(dead, "request_failed", "HTTP 503")
        assert not monitor._tasks
        w = pool.get(dead)
        assert w is not None and w.healthy
    finally:
        await monitor.stop()


async def test_removed_worker_stops_being_probed(closed_port: Callable[[], int]) -> None:
    """Ejection is a health state of a worker in the pool; removal (discovery) ends it."""
    dead = f"127.0.0.1:{closed_port()}"
    config = _config([dead])
    pool = Pool.from_config(config)
    monitor = HealthMonitor(config, pool)
    await monitor.start()
    try:
        pool.report(dead, "request_failed", "HTTP 503")
        w = pool.get(dead)
        assert w is not None
        assert await monitor.wait_until(lambda: not w.healthy, 10)
        probing = monitor._tasks[dead]
        pool.remove(dead, "deleted")
        assert dead not in monitor._tasks
        with contextlib.suppress(asyncio.CancelledError):
            await probing
        assert probing.cancelled()
        pool.report(dead, "request_failed", "HTTP 503")  # unknown now: ignored
        assert not monitor._tasks
    finally:
        await monitor.stop()


async def test_stop_ends_probing_even_when_a_probe_loses_the_cancel(
    closed_port: Callable[[], int],
) -> None:
    """A probe that finishes in the turn it is cancelled (Python 3.11's `wait_for` did:
    it returned the refusal and dropped the cancel) must not keep `stop()` waiting while
    the probe loop runs on against a worker that never comes back (a hang in make test)."""
    dead = f"127.0.0.1:{closed_port()}"
    config = _config([dead])
    pool = Pool.from_config(config)
    calls: list[str] = []
    looping = asyncio.Event()

    async def losing_probe(w: Worker) -> str | None:
        calls.append(w.endpoint)
        if len(calls) > 1:  # the first probe confirms the ejection; the loop's block
            looping.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()  # until cancelled, then the cancel is lost
        return "ConnectionRefusedError: refused"

    monitor = HealthMonitor(config, pool, probe=losing_probe)
    await monitor.start()
    pool.report(dead, "request_failed", "HTTP 503")
    async with asyncio.timeout(10):
        await looping.wait()
    w = pool.get(dead)
    assert w is not None and not w.healthy
    async with asyncio.timeout(10):
        await monitor.stop()
    assert not monitor._tasks
    assert len(calls) == 2  # no probe after stop()
