"""End to end through a real Envoy: KV-aware routing fed by real-format vLLM KV events.

Three simulated workers (real HTTP servers) each publish vLLM's ZMQ KV events
(kvscorer_tools.sim.kvevents, map era) for the prompts they serve and expose a vLLM /metrics page
whose waiting queue the test controls. The scorer runs in process with the `kv` policy, its
tokenizer, event subscribers and metrics scraper; speculative inserts are OFF
(index.speculative_ttl_s = 0) so every cache hit comes from the engines' events.

1. a prompt goes somewhere (reason load);
2. the same prefix again goes to that warm worker (reason kv_hit, header to the backend);
3. the warm worker's queue fills up: the request spills to another worker, the decision
   says load + spilled:busy_waiting, and /debug/decisions shows all of it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import xxhash
from aiohttp import web
from configs import make_config

from kvscorer_tools.envoyrun import EnvoyProcess
from kvscorer_tools.sim.kvevents import KVEventPublisher, block_stored
from scorer.app import App
from scorer.blocks import BlockHasher
from scorer.envoyproc import render_envoy_config
from scorer.tokens.service import Tokenization

pytestmark = pytest.mark.envoy

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers" / "qwen3"
BLOCK = 16
MODEL = "qwen3"

METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="qwen3"}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="qwen3"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="qwen3"}} 0.1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="4096"}} 1.0
"""


@dataclass
class SimWorker:
    """A worker: serves completions, publishes BlockStored for the full blocks it computed."""

    name: str
    tokens: Tokenization
    publisher: KVEventPublisher
    waiting: int = 0
    stored: set[int] = field(default_factory=set)
    served: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.served += 1
        self.headers.append(dict(request.headers))
        ids = self.tokens.tokenize_body(MODEL, body).token_ids
        # Engine block hashes are opaque to the scorer; chain them like vLLM does.
        parent: int | None = None
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        first_parent: int | None = None
        for i in range(len(ids) // BLOCK):
            chunk = ids[i * BLOCK : (i + 1) * BLOCK]
            h = xxhash.xxh3_64_intdigest(repr((parent, chunk)).encode()) >> 4
            if h not in self.stored:
                if not new_hashes:
                    first_parent = parent
                self.stored.add(h)
                new_hashes.append(h)
                new_tokens.extend(chunk)
            parent = h
        if new_hashes:
            self.publisher.publish(
                [block_stored("map", new_hashes, first_parent, new_tokens, BLOCK)]
            )
        return web.json_response({"backend": self.name, "prompt_tokens": len(ids)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS.format(waiting=float(self.waiting)))


@dataclass
class Stack:
    workers: list[SimWorker]
    app: App
    envoy: EnvoyProcess
    tokens: Tokenization

    def worker(self, name: str) -> SimWorker:
        return next(w for w in self.workers if w.name == name)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack() -> AsyncIterator[Stack]:
    base = make_config(tokens={"models": {MODEL: {"tokenizer": str(TOKENIZER)}}})
    engine_tokens = Tokenization(base, BlockHasher(BLOCK))
    workers: list[SimWorker] = []
    app: App | None = None
    try:
        for i in range(3):
            pub = KVEventPublisher("tcp://127.0.0.1:0", mode="bind")
            await pub.start()
            w = SimWorker(f"w{i}", engine_tokens, pub)
            workers.append(w)
            web_app = web.Application()
            web_app.router.add_post("/v1/completions", w.completions)
            web_app.router.add_get("/metrics", w.metrics)
            w.runner = web.AppRunner(web_app, access_log=None)
            await w.runner.setup()
            site = web.TCPSite(w.runner, "127.0.0.1", 0)
            await site.start()
            w.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        config = make_config(
            [
                {
                    "endpoint": w.endpoint,
                    "events": {"endpoint": w.publisher.bound_endpoint, "mode": "connect"},
                    "metrics_url": f"http://{w.endpoint}/metrics",
                }
                for w in workers
            ],
            pool={"block_size": BLOCK},
            tokens={"models": {MODEL: {"tokenizer": str(TOKENIZER)}}},
            index={"speculative_ttl_s": 0},
            load={"scrape_interval_s": 0.05, "stale_after_s": 30.0},  # never stale under load
            extproc={"decision_headers": True},
            policy="kv",
            policies={"kv": {"credit_decay": 0}},
        )
        app = App(config)
        await app.start()
        events = app.events
        # ZMQ slow joiner: a PUB drops what it sends before the SUB's subscription
        # arrives. Publish empty batches until each stream has applied one (a first
        # message is never a gap), so no real event is lost. Bounded, not a fixed sleep.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not all(events.status(w.endpoint).last_event_at is not None for w in workers):
            assert loop.time() < deadline, "KV-event streams did not come up"
            for w in workers:
                if events.status(w.endpoint).last_event_at is None:
                    w.publisher.publish([])
            await asyncio.sleep(0.02)
        cfg = render_envoy_config(0, app.extproc_port, 0)
        async with EnvoyProcess(cfg) as envoy:
            yield Stack(workers, app, envoy, engine_tokens)
    finally:
        if app is not None:
            await app.stop()
        for w in workers:
            if w.runner is not None:
                await w.runner.cleanup()
            await w.publisher.stop()
        engine_tokens.close()


_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota")
_words = itertools.cycle(_WORDS)


def long_prompt(n_words: int, seed: str) -> str:
    return seed + " " + " ".join(next(_words) + str(i % 7) for i in range(n_words))


async def complete(stack: Stack, prompt: str) -> tuple[str, dict[str, Any]]:
    url = f"http://127.0.0.1:{stack.envoy.listener_port}/v1/completions"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r,
    ):
        assert r.status == 200, await r.text()
        body = await r.json()
    return str(body["backend"]), body


async def newest_decision(stack: Stack, **query: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{stack.app.admin_port}/debug/decisions"
    async with aiohttp.ClientSession() as s, s.get(url, params={"limit": "1", **query}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["count"] == 1
    return dict(body["decisions"][0])


async def wait_indexed(stack: Stack, prompt: str, endpoint: str) -> None:
    keys = stack.tokens.tokenize_body(MODEL, {"model": MODEL, "prompt": prompt}).block_keys
    index = stack.app.parts.index
    for _ in range(1500):  # bounded (~30 s) for a loaded machine
        m = index.match(keys, [endpoint]).get(endpoint)
        if m is not None and m.blocks == len(keys):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"events for {endpoint} never reached the index")


@pytest.mark.asyncio(loop_scope="module")
async def test_repeated_prefix_goes_to_the_warm_worker(stack: Stack) -> None:
    prompt = long_prompt(400, "repeat")
    first, _ = await complete(stack, prompt)
    d = await newest_decision(stack)
    assert d["reason"] == "load" and d["policy"] == "kv"
    warm = stack.worker(first)
    await wait_indexed(stack, prompt, warm.endpoint)  # learnt from the worker's events
    for i in range(3):
        name, body = await complete(stack, prompt + f" and then question {i}?")
        assert name == first
        d = await newest_decision(stack)
        assert d["reason"] == "kv_hit" and d["endpoint"] == warm.endpoint
        assert d["matched_tokens"] >= (body["prompt_tokens"] // BLOCK - 2) * BLOCK
        assert set(d["stages_us"]) >= {"match", "score", "tokenize", "total"}
    assert warm.headers[-1].get("x-kv-scorer-reason") == "kv_hit"
    assert int(warm.headers[-1]["x-kv-scorer-matched-tokens"]) > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_saturated_warm_worker_spills_with_reason(stack: Stack) -> None:
    prompt = long_prompt(300, "spill")
    first, _ = await complete(stack, prompt)
    warm = stack.worker(first)
    await wait_indexed(stack, prompt, warm.endpoint)
    name, _ = await complete(stack, prompt)
    assert name == first
    warm.waiting = 12  # the engine's queue fills up (>= busy_waiting 5)
    try:
        pw = stack.app.pool.workers[warm.endpoint]
        for _ in range(1500):  # bounded (~30 s) for a loaded machine
            if pw.scraped.waiting == 12:
                break
            await asyncio.sleep(0.02)
        assert pw.scraped.waiting == 12
        name, _ = await complete(stack, prompt)
        assert name != first
        d = await newest_decision(stack)
        assert d["reason"] == "load" and "spilled:busy_waiting" in d["notes"]
        cands = {c["endpoint"]: c for c in d["candidates"]}
        assert cands[warm.endpoint]["filtered"] == "busy_waiting"
        assert cands[warm.endpoint]["matched_blocks"] > 0 and cands[warm.endpoint]["waiting"] == 12
        # /debug/decisions filters by endpoint: the warm worker's last decision is the hit.
        d_warm = await newest_decision(stack, endpoint=warm.endpoint)
        assert d_warm["reason"] == "kv_hit"
    finally:
        warm.waiting = 0
