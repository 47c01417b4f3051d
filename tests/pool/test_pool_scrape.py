"""The load view: scraping real HTTP servers serving vLLM / SGLang metrics pages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from configs import make_config
from prometheus_client import REGISTRY

from scorer.pool.scrape import MAX_PAGE_BYTES, LoadScraper, fresh_scrape, parse_metrics
from scorer.pool.workers import Pool

# The shape of a vLLM v1 /metrics page (names and label sets as vLLM 0.10+ prints them).
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="qwen"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="qwen"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="qwen"}} {usage}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="qwen"}} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="qwen"}} 250.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="qwen"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="qwen"}} 3.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="qwen"}} 3.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="qwen"}} 0.12
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="4096",num_cpu_blocks="None"}} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}} 1.7e9
vllm:lora_requests_info{{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="law"}} 1.8e9
"""  # noqa: E501

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="qwen"} 0.5
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="qwen"} 160000.0
"""


@dataclass
class FakeEngine:
    """A real HTTP server on 127.0.0.1:0 whose /metrics page and behaviour we control."""

    running: float = 2
    waiting: float = 1
    usage: float = 0.25
    block_size: int = 16
    mode: str = "ok"  # ok | error | slow | garbage | sglang
    hits: int = 0
    port: int = 0
    runner: web.AppRunner | None = field(default=None, repr=False)

    async def handler(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.mode == "error":
            return web.Response(status=500, text="boom")
        if self.mode == "slow":
            await asyncio.sleep(0.6)
        if self.mode == "garbage":
            return web.Response(text="<html>not metrics</html>\n")
        if self.mode == "sglang":
            return web.Response(text=SGLANG_PAGE)
        if self.mode == "huge":  # a valid page padded past the scraper's bound
            pad = "# HELP padding " + "x" * 1000 + "\n"
            return web.Response(text=SGLANG_PAGE + pad * (MAX_PAGE_BYTES // 1000))
        page = VLLM_PAGE.format(
            running=self.running, waiting=self.waiting, usage=self.usage, block_size=self.block_size
        )
        return web.Response(text=page, content_type="text/plain")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    try:
        for _ in range(2):
            e = FakeEngine()
            app = web.Application()
            app.router.add_get("/metrics", e.handler)
            e.runner = web.AppRunner(app)
            await e.runner.setup()
            site = web.TCPSite(e.runner, "127.0.0.1", 0)
            await site.start()
            e.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            started.append(e)
        yield started
    finally:
        for e in started:
            if e.runner is not None:
                await e.runner.cleanup()


def make_scraper(
    engines: list[FakeEngine],
    dead_port: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    **load: float,
) -> tuple[LoadScraper, Pool]:
    workers = [
        {"endpoint": f"127.0.0.1:{8000 + i}", "metrics_url": e.url} for i, e in enumerate(engines)
    ]
    if dead_port is not None:
        workers.append(
            {"endpoint": "127.0.0.1:8099", "metrics_url": f"http://127.0.0.1:{dead_port}/metrics"}
        )
    # The timeout is generous: on a loaded machine a loopback scrape can take a while, and
    # only the test of timeouts itself should ever see one.
    cfg = make_config(
        workers,
        pool={"block_size": 16},
        load={"scrape_interval_s": 0.05, "scrape_timeout_s": 10.0, **load},
    )
    pool = Pool.from_config(cfg)
    return LoadScraper(cfg, pool, clock=clock), pool


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition the scrape loop reaches (bounded; not a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class ManualClock:
    """The scraper's clock, moved by the test: staleness never depends on load."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def gauge(name: str, endpoint: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"endpoint": endpoint})


def test_parse_vllm_page() -> None:
    p = parse_metrics(VLLM_PAGE.format(running=3, waiting=4, usage=0.5, block_size=32))
    assert p.engine == "vllm"
    assert (p.running, p.waiting, p.kv_usage) == (3, 4, 0.5)
    assert (p.block_size, p.num_gpu_blocks) == (32, 4096)
    assert p.lora_running == ["sql", "chat"] and p.lora_waiting == ["law"]  # newest sample
    assert p.cache_hit_rate == 0.25


def test_parse_older_vllm_and_data_parallel_engines() -> None:
    page = (
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:gpu_cache_usage_perc{engine="0"} 0.2\nvllm:gpu_cache_usage_perc{engine="1"} 0.4\n'
    )
    p = parse_metrics(page)
    assert p.waiting == 5 and p.kv_usage == pytest.approx(0.3)


def test_parse_sglang_page() -> None:
    p = parse_metrics(SGLANG_PAGE)
    assert p.engine == "sglang"
    assert (p.running, p.waiting, p.kv_usage, p.cache_hit_rate) == (7, 3, 0.28, 0.5)
    assert p.capacity_tokens == 160000


def test_parse_rejects_a_page_without_engine_metrics() -> None:
    with pytest.raises(ValueError):
        parse_metrics("# HELP up whatever\nup 1\n")


async def test_fresh_scrape_fills_the_load_view(engines: list[FakeEngine]) -> None:
    engines[0].running, engines[0].waiting, engines[0].usage = 5, 2, 0.4
    engines[1].mode = "sglang"
    scraper, pool = make_scraper(engines)
    await scraper.start()
    try:
        await until(lambda: all(w.scraped.at > 0 for w in pool), "a first scrape of each")
        w0, w1 = list(pool)
        assert (w0.scraped.running, w0.scraped.waiting, w0.scraped.kv_usage) == (5, 2, 0.4)
        assert w0.scraped.block_size == 16 and not w0.scraped.block_size_mismatch
        assert w0.scraped.num_gpu_blocks == 4096 and w0.scraped.engine == "vllm"
        assert w1.scraped.engine == "sglang" and w1.scraped.waiting == 3
        assert w1.scraped.num_gpu_blocks == 160000 // 16  # tokens → our blocks
        # Values follow the engine on the next rounds.
        engines[0].waiting = 9
        await until(lambda: w0.scraped.waiting == 9, "the new value")
        assert w0.scraped.waiting == 9
        assert fresh_scrape(w0.scraped, scraper.clock(), scraper.config.load.stale_after_s)
    finally:
        await scraper.stop()
    assert scraper._session is None


async def test_failing_and_stale_scrapes_are_visible_not_saturating(
    engines: list[FakeEngine], unused_tcp_port: int
) -> None:
    clock = ManualClock()
    scraper, pool = make_scraper(engines, dead_port=unused_tcp_port, clock=clock, stale_after_s=0.3)
    w0, w1, dead = list(pool)
    engines[0].waiting = 50  # would be busy if trusted
    await scraper.scrape_all()  # before start(): no session, nothing happens, never raises
    assert w0.scraped.at == 0 and w0.scraped.attempts == 0
    await scraper.start()
    try:
        await until(lambda: w0.scraped.waiting == 50, "a good scrape")
        engines[0].mode = "error"
        engines[1].mode = "garbage"
        clock.t += 1.0  # the good scrape is now older than stale_after_s, by the clock
        hits = engines[0].hits

        def failed_rounds() -> bool:
            view = {v["endpoint"]: v for v in scraper.view()}
            return bool(
                # three failed rounds, all after the clock moved
                view[w0.endpoint]["scrape"]["consecutive_failures"] >= 3
                and engines[0].hits >= hits + 3
                # the gauges are set by a scrape round after the data went stale
                and gauge("kv_scorer_scrape_stale", w0.endpoint) == 1
                and view[w1.endpoint]["scrape"]["error"]
                and view[dead.endpoint]["scrape"]["error"]
            )

        await until(failed_rounds, "failed rounds on every worker")
        view = {v["endpoint"]: v for v in scraper.view()}
        v0 = view[w0.endpoint]["scrape"]
        assert v0["fresh"] is False and v0["error"] == "HTTP 500"
        assert v0["consecutive_failures"] >= 3 and v0["age_s"] >= 1.0
        assert view[w1.endpoint]["scrape"]["error"].startswith("bad metrics page")
        assert "ConnectionRefused" in (view[dead.endpoint]["scrape"]["error"] or "") or (
            view[dead.endpoint]["scrape"]["error"] or ""
        ).startswith("ClientConnector")
        assert all(w.healthy for w in pool)  # scrape failures never mark workers unhealthy
        assert not fresh_scrape(w0.scraped, scraper.clock(), 0.3)
        assert gauge("kv_scorer_scrape_stale", w0.endpoint) == 1
        assert (gauge("kv_scorer_scrape_consecutive_failures", w0.endpoint) or 0) >= 3
        # Recovery: the next good scrape is fresh again and the failure count resets.
        engines[0].mode = "ok"
        await until(lambda: w0.scraped.failures == 0, "a good scrape again")
        assert w0.scraped.failures == 0 and w0.scraped.error is None
        assert fresh_scrape(w0.scraped, scraper.clock(), 0.3)
    finally:
        await scraper.stop()


async def test_oversized_page_is_a_bad_payload_read_no_further(engines: list[FakeEngine]) -> None:
    scraper, pool = make_scraper(engines[:1])
    await scraper.start()
    try:
        w = next(iter(pool))
        assert await scraper.scrape(w) and w.scraped.waiting == 1
        engines[0].mode = "huge"
        assert not await scraper.scrape(w)
        assert w.scraped.error == f"metrics page over {MAX_PAGE_BYTES} bytes"
        assert w.scraped.waiting == 1  # the last good view is kept, not the huge page's
        engines[0].mode = "sglang"  # the same page without the padding is read
        assert await scraper.scrape(w) and w.scraped.waiting == 3
    finally:
        await scraper.stop()


async def test_slow_engine_times_out(engines: list[FakeEngine]) -> None:
    engines[0].mode = "slow"  # answers after 0.6 s, the timeout is 0.3 s
    scraper, pool = make_scraper(engines[:1], scrape_timeout_s=0.3)
    await scraper.start()
    try:
        w = next(iter(pool))
        ok = await scraper.scrape(w)
        assert not ok and w.scraped.error == "timeout"
    finally:
        await scraper.stop()


async def test_block_size_mismatch_is_reported_once(
    engines: list[FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engines[0].block_size = 32
    scraper, pool = make_scraper(engines[:1])
    await scraper.start()
    try:
        w = next(iter(pool))
        with caplog.at_level(logging.ERROR, logger="scorer.pool.scrape"):
            for _ in range(3):
                assert await scraper.scrape(w)
        assert w.scraped.block_size == 32 and w.scraped.block_size_mismatch
        assert gauge("kv_scorer_worker_block_size_mismatch", w.endpoint) == 1
        assert sum("block_size=32" in r.getMessage() for r in caplog.records) == 1
        assert scraper.view()[0]["scrape"]["block_size_mismatch"] is True
    finally:
        await scraper.stop()


async def test_debug_pool_route(engines: list[FakeEngine]) -> None:
    scraper, pool = make_scraper(engines)
    app = web.Application()
    for method, path, handler in scraper.routes():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await scraper.start()
    try:
        await scraper.scrape_all()
        next(iter(pool)).inflight.requests = 4
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/debug/pool") as r:
            body = await r.json()
        assert r.status == 200 and body["stale_after_s"] == 2.0
        first = body["workers"][0]
        assert first["inflight"]["requests"] == 4
        assert first["scrape"]["fresh"] is True and first["scrape"]["waiting"] == 1
        assert first["scrape"]["lora_running"] == ["sql", "chat"]
    finally:
        await scraper.stop()
        await runner.cleanup()
