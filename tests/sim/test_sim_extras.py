"""Simulator details: connect-mode PUB, a real tokenizer, client disconnects."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvscorer_tools.sim.kvevents import KVEventPublisher, all_blocks_cleared
from kvscorer_tools.sim.prompts import HFTokenizer, SyntheticTokenizer
from kvscorer_tools.sim.worker import SimConfig, running_workers

QWEN3 = Path(__file__).resolve().parents[1] / "fixtures/tokenizers/qwen3"


async def test_connect_mode_publisher_reaches_a_bound_subscriber() -> None:
    # vLLM connects its PUB socket when the address is not a wildcard: the subscriber binds.
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind("tcp://127.0.0.1:*")
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        pub = KVEventPublisher(endpoint, era="map")  # auto mode: no "*" → connect
        await pub.start()
        try:
            assert pub.bound_endpoint == endpoint
            frames = None
            for _ in range(50):  # bounded: resend until the connection is up
                pub.publish([all_blocks_cleared("map")], ts=2.0)
                try:
                    frames = await asyncio.wait_for(sub.recv_multipart(), 0.1)
                    break
                except TimeoutError:
                    continue
            assert frames is not None
            assert msgspec.msgpack.decode(frames[2]) == [2.0, [{"type": "AllBlocksCleared"}], 0]
        finally:
            await pub.stop()
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_real_tokenizer_matches_apply_chat_template() -> None:
    tok = HFTokenizer(QWEN3)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    # Expected ids from transformers' AutoTokenizer.apply_chat_template(msgs,
    # add_generation_prompt=True) on the same tokenizer files.
    assert tok.encode_chat(msgs, True) == [
        151644, 8948, 198, 3430, 9814, 13, 151645, 198, 151644, 872, 198, 9707, 1879, 151645,
        198, 151644, 77091, 198,
    ]  # fmt: skip
    assert tok.encode("Hello world") == [9707, 1879]


def test_synthetic_tokenizer_is_deterministic_and_prefix_stable() -> None:
    a, b = SyntheticTokenizer(), SyntheticTokenizer()
    assert a.encode("one two three") == b.encode("one two three")
    assert a.encode("one two three four")[:3] == a.encode("one two three")
    assert all(1000 <= t < 32000 for t in a.encode("x y z"))


@pytest.mark.slow
async def test_worker_with_real_tokenizer() -> None:
    cfg = SimConfig(port=0, speed=100.0, tokenizer=str(QWEN3))
    async with running_workers([cfg]) as (w,), aiohttp.ClientSession() as s:
        async with s.post(w.url + "/tokenize", json={"prompt": "Hello world"}) as r:
            assert (await r.json())["tokens"] == [9707, 1879]
        body = {"prompt": "Hello world", "max_tokens": 2}
        async with s.post(w.url + "/v1/completions", json=body) as r:
            out = await r.json()
        assert out["usage"]["prompt_tokens"] == 2


async def test_client_disconnect_frees_the_request() -> None:
    cfg = SimConfig(port=0, block_size=4, capacity_blocks=256, speed=1.0)
    async with running_workers([cfg]) as (w,):
        async with aiohttp.ClientSession() as s:
            body = {"prompt": list(range(1, 20)), "max_tokens": 500, "stream": True}
            async with s.post(w.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()  # first token arrived: request is running
                assert len(w.engine.running) == 1
                assert w.engine.cache.pinned_blocks > 0
            # leaving the block closes the connection mid-stream
        for _ in range(3000):  # bounded (~30 s) for a loaded machine
            if not w.engine.running and w.engine.cache.pinned_blocks == 0:
                break
            await asyncio.sleep(0.01)
        assert not w.engine.running
        assert w.engine.cache.pinned_blocks == 0
        assert len(w.engine.cache) == 4  # the prompt's full blocks stay cached


async def test_debug_kv_cache_reports_the_prefix_cache() -> None:
    """GET /debug/kv_cache: the engine cache's block count (and hashes on request)."""
    import aiohttp

    from kvscorer_tools.sim.worker import SimWorker

    sim = SimWorker(SimConfig(port=0, block_size=16, speed=100.0))
    async with sim as w, aiohttp.ClientSession() as s:
        async with s.get(w.url + "/debug/kv_cache") as r:
            assert (await r.json())["blocks"] == 0
        body = {"model": w.config.model, "prompt": list(range(1, 50)), "max_tokens": 1}
        async with s.post(w.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        async with s.get(w.url + "/debug/kv_cache?hashes=1") as r:
            doc = await r.json()
    assert doc["blocks"] == 3 == len(doc["block_hashes"])  # 49 tokens: 3 full blocks
    assert set(doc["block_hashes"]) == set(w.engine.cache.cached_hashes())
