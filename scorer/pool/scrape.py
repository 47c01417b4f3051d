"""The load view: scrape each worker's Prometheus endpoint in the background.

One shared aiohttp `ClientSession`; every `load.scrape_interval_s` all workers with a
`metrics_url` are scraped concurrently, each bounded by `load.scrape_timeout_s`. A scrape
fills `Worker.scraped` (`ScrapedLoad`); the request path only reads that object.

Metric names understood (sources cited where they are defined):

- vLLM (vllm/v1/metrics/loggers.py, PrometheusStatLogger; docs/design/metrics.md):
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (0..1; v0 and early v1 called it `vllm:gpu_cache_usage_perc`),
  `vllm:cache_config_info{block_size, num_gpu_blocks, ...}` (value 1, facts in labels),
  `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`
  (one sample per change, value = wall time; the newest wins),
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (counters).
- SGLang (python/sglang/srt/metrics/collector.py; docs/references/production_metrics.md):
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage` (0..1),
  `sglang:cache_hit_rate` (0..1), `sglang:max_total_num_tokens` (KV capacity in tokens).

Data-parallel engines expose one sample per engine (label `engine`): running and waiting
are summed, usage is averaged.

The staleness rule (documented in docs/policy.md and used by the policies through
`fresh_scrape`): a scrape older than `load.stale_after_s` (or none yet) is IGNORED — its
waiting queue and KV usage count as unknown and only the router's own in-flight
accounting counts. A failing scrape never marks a worker unhealthy by itself and never
makes it look saturated (a slow or timed-out scrape is not evidence; a metrics port can
fail while the serving port is fine). A REFUSED or RESET connection is reported as
evidence to scorer.pool.health, which confirms it with a probe of the serving endpoint
before ejecting anyone. Staleness is visible per worker
in `GET /debug/pool` and in `kv_scorer_scrape_stale{endpoint}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.parser import parse_labels

from scorer.config import Config
from scorer.pool.health import METRICS_REFUSED, describe, is_refusal
from scorer.pool.workers import Pool, PoolChange, ScrapedLoad, Worker
from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SCRAPES = Counter(
    "kv_scorer_scrape",
    "Metrics scrapes of workers by result (ok, error, timeout, bad_payload).",
    ["endpoint", "result"],
)
SCRAPE_STALE = Gauge(
    "kv_scorer_scrape_stale",
    "1 when the worker's last good scrape is older than load.stale_after_s (ignored).",
    ["endpoint"],
)
SCRAPE_FAILURES = Gauge(
    "kv_scorer_scrape_consecutive_failures",
    "Consecutive failed scrapes of the worker's metrics endpoint.",
    ["endpoint"],
)
BLOCK_SIZE_MISMATCH = Gauge(
    "kv_scorer_worker_block_size_mismatch",
    "1 when the engine's vllm:cache_config_info block_size differs from pool.block_size.",
    ["endpoint"],
)

# Families we read; every other line of the page is skipped unparsed (a vLLM page is
# mostly histograms we do not need, and parsing them 5x a second per worker is waste).
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
CACHE_INFO = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
VLLM_QUERIES = "vllm:prefix_cache_queries"
VLLM_HITS = "vllm:prefix_cache_hits"
SGLANG_HIT_RATE = "sglang:cache_hit_rate"
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
# Requests past their first token (the TTFT histogram's count) and finished (every
# finished_reason, abort included): with running + waiting they give the requests the
# engine holds before their first token (ScrapedLoad.before_first). vLLM v1 observes the
# TTFT at each request's first token and counts request_success at its end
# (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
VLLM_FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
VLLM_FINISHED = "vllm:request_success_total"
_WANTED = (
    *RUNNING,
    *WAITING,
    *USAGE,
    CACHE_INFO,
    LORA_INFO,
    VLLM_QUERIES,
    VLLM_HITS,
    SGLANG_HIT_RATE,
    SGLANG_CAPACITY,
    VLLM_FIRST_TOKENS,
    VLLM_FINISHED,
)


@dataclass(slots=True)
class ParsedMetrics:
    """What one metrics page said (None = the page did not say)."""

    engine: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    capacity_tokens: int | None = None
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    cache_hit_rate: float | None = None
    first_tokens: float | None = None  # requests past their first token (counter)
    finished: float | None = None  # requests finished, any reason (counter)


# Memory per scrape is bounded: a page is read up to this size, a larger one is a bad
# payload (vLLM's page is ~10-30 KB, a few hundred KB with many LoRA adapters).
MAX_PAGE_BYTES = 4 * 1024 * 1024

# The lines of the families we read, found in one C scan of the page (anchored on the
# newline: a `^` with re.MULTILINE is tried at every position and costs 4x more).
_WANTED_LINE = re.compile("\n((?:" + "|".join(map(re.escape, _WANTED)) + ")[^\n]*)")


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(name, label text, value) of each sample line of the families we read.

    Prometheus text format (prometheus/docs exposition_formats.md): `name{labels} value
    [timestamp]`. Only the few lines we read are looked at, and their labels are left as
    text: prometheus_client's parser, run on them before, cost ~0.4 ms per vLLM page, five
    times a second per worker, on the event loop. A malformed line we read raises
    ValueError, as the library's parser did (tests/pool/test_pool_scrape_parse.py compares
    the two on generated pages).
    """
    for line in _WANTED_LINE.findall("\n" + text):
        brace = line.find("{")
        if brace != -1:
            close = line.rfind("}")
            if close < brace:
                raise ValueError(f"unclosed labels: {line[:200]!r}")
            name, labels = line[:brace].rstrip(), line[brace + 1 : close]
            fields = line[close + 1 :].split()
        else:
            name, *fields = line.split()  # space or tab after the name
            labels = ""
        if not 1 <= len(fields) <= 2:
            raise ValueError(f"not a sample line: {line[:200]!r}")
        yield name, labels, float(fields[0])


def _labels(text: str) -> dict[str, str]:
    """Parse a label set (only for the two info metrics whose facts are in labels).

    Short ones are cached: they rarely change between scrapes. Callers do not mutate it.
    """
    return _labels_cached(text) if len(text) <= 1024 else _parse_labels(text)


def _parse_labels(text: str) -> dict[str, str]:
    try:
        return parse_labels(text)
    except (IndexError, KeyError) as e:  # the library's parser raises these too
        raise ValueError(f"bad labels: {text[:200]!r}") from e


_labels_cached = functools.lru_cache(maxsize=64)(_parse_labels)


def _adapters(value: str | None) -> list[str]:
    return [a for a in (value or "").split(",") if a]


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw in ("", "None"):
        return None
    try:
        return int(float(raw))
    except (ValueError, OverflowError):  # "inf" is a float but no block count
        return None


def parse_metrics(text: str) -> ParsedMetrics:
    """Parse a vLLM or SGLang Prometheus text page; raises ValueError on a malformed page."""
    out = ParsedMetrics()
    running: list[float] = []
    waiting: list[float] = []
    usage: list[float] = []
    queries = hits = 0.0
    firsts: float | None = None
    done: float | None = None
    lora_at = -1.0
    for sname, labels, value in _samples(text):
        if sname.startswith("vllm:"):
            out.engine = "vllm"
        elif sname.startswith("sglang:"):
            out.engine = "sglang"
        if sname in RUNNING:
            running.append(value)
        elif sname in WAITING:
            waiting.append(value)
        elif sname in USAGE:
            usage.append(value)
        elif sname == CACHE_INFO:
            facts = _labels(labels)
            out.block_size = _int_label(facts, "block_size")
            out.num_gpu_blocks = _int_label(facts, "num_gpu_blocks")
        elif sname == LORA_INFO:
            # One sample per state change, the value is its wall time: newest wins.
            if value >= lora_at:
                lora_at = value
                facts = _labels(labels)
                out.lora_running = _adapters(facts.get("running_lora_adapters"))
                out.lora_waiting = _adapters(facts.get("waiting_lora_adapters"))
        elif sname in (VLLM_QUERIES, VLLM_QUERIES + "_total"):
            queries += value
        elif sname in (VLLM_HITS, VLLM_HITS + "_total"):
            hits += value
        elif sname == VLLM_FIRST_TOKENS:
            firsts = (firsts or 0.0) + value
        elif sname == VLLM_FINISHED:
            done = (done or 0.0) + value
        elif sname == SGLANG_HIT_RATE:
            out.cache_hit_rate = value
        elif sname == SGLANG_CAPACITY:
            if not math.isfinite(value):
                raise ValueError(f"{sname} is {value}")  # int() would raise OverflowError
            out.capacity_tokens = int(value)
    if running:
        out.running = sum(running)
    if waiting:
        out.waiting = sum(waiting)
    if usage:
        # Some versions report percent (0..100) despite the name; normalise to 0..1.
        u = sum(usage) / len(usage)
        out.kv_usage = u / 100.0 if u > 1.0 else u
    if queries > 0:
        out.cache_hit_rate = hits / queries
    out.first_tokens, out.finished = firsts, done
    if out.engine is None:
        raise ValueError("no vLLM or SGLang load metric on the page")
    return out


def fresh_scrape(scraped: ScrapedLoad, now: float, stale_after_s: float) -> bool:
    """True when the last good scrape exists and is recent enough to be trusted."""
    return scraped.at > 0.0 and now - scraped.at <= stale_after_s


class LoadScraper:
    """App component: background scraping of every worker's `metrics_url`."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pool = pool
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._warned_block_size: set[str] = set()
        pool.subscribe(self._pool_changed)

    def _pool_changed(self, change: PoolChange) -> None:
        """A worker left: drop its per-endpoint series (pods churn; series must not grow)."""
        if change.change != "removed":
            return
        ep = change.worker.endpoint
        self._warned_block_size.discard(ep)
        for gauge in (SCRAPE_STALE, SCRAPE_FAILURES, BLOCK_SIZE_MISMATCH):
            with contextlib.suppress(KeyError):
                gauge.remove(ep)
        for result in ("ok", "error", "timeout", "bad_payload"):
            with contextlib.suppress(KeyError):
                SCRAPES.remove(ep, result)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the shared HTTP session and start the scrape loop (idempotent)."""
        if self._task is not None:
            return
        timeout = aiohttp.ClientTimeout(total=self.config.load.scrape_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._loop(), name="load-scraper")

    async def stop(self) -> None:
        """Stop the loop and close the session."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def routes(self) -> list[tuple[str, str, Handler]]:
        """Admin routes: `GET /debug/pool` (workers, health, load view, scrape state)."""
        return [("GET", "/debug/pool", self._debug_pool)]

    # -- scraping --------------------------------------------------------------------
    async def _loop(self) -> None:
        interval = self.config.load.scrape_interval_s
        while True:
            t0 = self.clock()
            await self.scrape_all()
            # Sleep the rest of the interval; a slow round is not followed by a burst.
            await asyncio.sleep(max(interval - (self.clock() - t0), interval / 10))

    async def scrape_all(self) -> None:
        """One round: scrape every worker that has a metrics_url, concurrently."""
        workers = [w for w in self.pool if w.config.metrics_url]
        if workers:
            await asyncio.gather(*(self.scrape(w) for w in workers))
        now = self.clock()
        stale_after = self.config.load.stale_after_s
        for w in workers:
            if self.pool.get(w.endpoint) is not w:
                continue  # left the pool during the round
            SCRAPE_STALE.labels(w.endpoint).set(
                0 if fresh_scrape(w.scraped, now, stale_after) else 1
            )

    async def scrape(self, worker: Worker) -> bool:
        """Scrape one worker and update `worker.scraped`; True on success. Never raises."""
        url = worker.config.metrics_url
        session = self._session
        if url is None or session is None:
            return False
        sc = worker.scraped
        sc.attempts += 1
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    return self._failed(worker, "error", f"HTTP {resp.status}")
                body = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > MAX_PAGE_BYTES:
                        return self._failed(
                            worker, "bad_payload", f"metrics page over {MAX_PAGE_BYTES} bytes"
                        )
        except TimeoutError:
            return self._failed(worker, "timeout", "timeout")
        except (aiohttp.ClientError, OSError) as e:
            if is_refusal(e):
                # The worker's own host refused or reset us: evidence for scorer.pool.health
                # (which confirms it on the serving port). Timeouts above are not evidence.
                self.pool.report(worker.endpoint, METRICS_REFUSED, f"{type(e).__name__}: {e}")
            return self._failed(worker, "error", f"{type(e).__name__}: {e}")
        if self.pool.get(worker.endpoint) is not worker:
            return False  # left the pool while we waited: keep no series for it
        try:
            # The exposition format is UTF-8 (prometheus/docs exposition_formats.md).
            parsed = parse_metrics(body.decode("utf-8", "replace"))
        except ValueError as e:
            return self._failed(worker, "bad_payload", f"bad metrics page: {e}")
        self.apply(worker, parsed)
        return True

    def apply(self, worker: Worker, parsed: ParsedMetrics) -> None:
        """Store a parsed page in the worker's load view (also used by tests and the sim)."""
        sc = worker.scraped
        sc.engine = parsed.engine
        sc.running = parsed.running or 0.0
        sc.waiting = parsed.waiting or 0.0
        sc.kv_usage = parsed.kv_usage or 0.0
        sc.lora_running = parsed.lora_running
        sc.lora_waiting = parsed.lora_waiting
        sc.cache_hit_rate = parsed.cache_hit_rate
        sc.before_first = None
        if (
            self.config.load.first_token_counts
            and parsed.first_tokens is not None
            and parsed.finished is not None
        ):
            # Every request the engine has seen is finished, still held or past its first
            # token: held ones before it = held + finished - first tokens. The counters can
            # drift from that for good: a request aborted before its first token may count
            # as finished (one too many), one aborted after it by its client may never count
            # as finished (one too few). The drift is `first_token_base`, re-anchored
            # whenever the count leaves what is possible, [waiting, held]: exactly when the
            # engine is idle (0 held, 0 before the first token).
            held = sc.running + sc.waiting
            raw = parsed.finished - parsed.first_tokens
            if math.isfinite(raw):  # a counter page of +Inf / NaN says nothing
                bf = held + raw - sc.first_token_base
                if bf > held:
                    sc.first_token_base = raw
                elif bf < sc.waiting:
                    sc.first_token_base = raw + held - sc.waiting
                sc.before_first = held + raw - sc.first_token_base
        expected = self.config.pool.block_size
        if parsed.block_size is not None:
            sc.block_size = parsed.block_size
        if parsed.num_gpu_blocks is not None:
            sc.num_gpu_blocks = parsed.num_gpu_blocks
        elif parsed.capacity_tokens is not None:
            # SGLang reports capacity in tokens; express it in our blocks.
            sc.num_gpu_blocks = parsed.capacity_tokens // expected
        mismatch = sc.block_size is not None and sc.block_size != expected
        sc.block_size_mismatch = mismatch
        BLOCK_SIZE_MISMATCH.labels(worker.endpoint).set(1 if mismatch else 0)
        if mismatch and worker.endpoint not in self._warned_block_size:
            self._warned_block_size.add(worker.endpoint)
            log.error(
                "worker %s reports block_size=%s but pool.block_size=%s: its cache "
                "matches are wrong until the configuration agrees",
                worker.endpoint,
                sc.block_size,
                expected,
            )
        sc.at = self.clock()
        sc.pages += 1
        sc.error = None
        sc.failures = 0
        SCRAPE_FAILURES.labels(worker.endpoint).set(0)
        SCRAPES.labels(worker.endpoint, "ok").inc()
        for listener in self.pool.page_listeners:
            listener(worker)

    def _failed(self, worker: Worker, result: str, message: str) -> bool:
        sc = worker.scraped
        sc.error = message
        sc.failures += 1
        SCRAPE_FAILURES.labels(worker.endpoint).set(sc.failures)
        SCRAPES.labels(worker.endpoint, result).inc()
        if sc.failures == 1:
            log.warning("scrape of %s failed: %s", worker.config.metrics_url, message)
        return False

    # -- admin view ------------------------------------------------------------------
    def view(self) -> list[dict[str, Any]]:
        """Every worker's health, in-flight accounting and scrape state (JSON-ready)."""
        now = self.clock()
        stale_after = self.config.load.stale_after_s
        out = []
        for w in self.pool:
            sc = w.scraped
            out.append(
                {
                    "endpoint": w.endpoint,
                    "healthy": w.healthy,
                    "health": describe(w, now),
                    "models": list(w.config.models),
                    "inflight": {
                        "requests": w.inflight.requests,
                        "prefill_tokens": w.inflight.prefill_tokens,
                        "prefill_blocks": round(w.inflight.prefill_blocks, 2),
                        "decode_blocks": round(w.inflight.decode_blocks, 2),
                        "routed_total": w.inflight.routed_total,
                    },
                    "scrape": {
                        "url": w.config.metrics_url,
                        "engine": sc.engine,
                        "fresh": fresh_scrape(sc, now, stale_after),
                        "age_s": None if sc.at <= 0 else round(now - sc.at, 3),
                        "running": sc.running,
                        "waiting": sc.waiting,
                        "kv_usage": round(sc.kv_usage, 4),
                        "block_size": sc.block_size,
                        "block_size_mismatch": sc.block_size_mismatch,
                        "num_gpu_blocks": sc.num_gpu_blocks,
                        "lora_running": sc.lora_running,
                        "lora_waiting": sc.lora_waiting,
                        "cache_hit_rate": sc.cache_hit_rate,
                        "before_first": sc.before_first,
                        "error": sc.error,
                        "consecutive_failures": sc.failures,
                        "attempts": sc.attempts,
                    },
                }
            )
        return out

    async def _debug_pool(self, request: web.Request) -> web.Response:
        prefill = self.pool.prefill
        return web.json_response(
            {
                "stale_after_s": self.config.load.stale_after_s,
                "prefill": None if prefill is None else prefill.view(),
                "workers": self.view(),
            }
        )
