"""KV events of the simulated worker over real ZMQ sockets (PUB/SUB and ROUTER/DEALER)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvscorer_tools.sim.cache import vllm_block_hashes
from kvscorer_tools.sim.kvevents import END_SEQ, KVEventPublisher, block_removed
from kvscorer_tools.sim.worker import SimConfig, SimWorker

BS = 4


async def _start(**kw: Any) -> SimWorker:
    cfg = SimConfig(
        port=0, block_size=BS, capacity_blocks=6, speed=200.0, seed=7, loras=("sql-lora",),
        kv_events="tcp://127.0.0.1:0", kv_events_mode="bind", replay="tcp://127.0.0.1:0", **kw,
    )  # fmt: skip
    w = SimWorker(cfg)
    await w.start()
    return w


async def _subscribe(ctx: zmq.asyncio.Context, w: SimWorker) -> tuple[zmq.asyncio.Socket, int]:
    """A SUB that provably receives the worker's stream, and the seq of its next batch.

    A PUB drops what it sends before the subscription reaches it (ZMQ slow joiner), so
    empty probe batches are published until one arrives (bounded), then drained."""
    assert w.events_endpoint is not None and w.publisher is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(w.events_endpoint)
    for _ in range(600):  # ~30 s
        w.publisher.publish([])
        if await sub.poll(50):
            break
    else:
        raise AssertionError("the subscription never reached the worker's PUB socket")
    base = w.publisher.next_seq  # probes published so far; every later one arrives
    for _ in range(base + 1):  # at most every probe published so far, then the last one
        _, seq, _ = await _recv(sub)
        if seq == base - 1:
            return sub, base
    raise AssertionError(f"probe {base - 1} never arrived")


async def _recv(sub: zmq.asyncio.Socket) -> tuple[bytes, int, list[Any]]:
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
    return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


async def _complete(w: SimWorker, body: dict[str, Any]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{w.url}/v1/completions", json={"max_tokens": 2, **body}) as r,
    ):
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": BS, "lora_id": kw.get("lora_id"), "medium": "GPU",
        "lora_name": kw.get("lora_name"), "extra_keys": kw.get("extra", [None] * len(hashes)),
        "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }  # fmt: skip


async def test_store_evict_reset_events_and_replay(ctx: zmq.asyncio.Context) -> None:
    w = await _start()
    try:
        assert w.events_endpoint is not None and w.replay_endpoint is not None
        sub, base = await _subscribe(ctx, w)
        a = list(range(1, 10))  # 2 full blocks + 1 token
        ha = [h.value for h in vllm_block_hashes(a, BS)]
        r = await _complete(w, {"prompt": a})
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        topic, seq, batch = await _recv(sub)
        assert (topic, seq) == (b"", base)
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        assert events == [_stored(ha, None, a[:8])]

        # Same prompt: both blocks hit, nothing new stored.
        r = await _complete(w, {"prompt": a})
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 8

        # 17 prompt tokens + 2 output = 5 blocks; the pool has 6 and holds a's 2 (unpinned):
        # one must go, a's tail block first.
        c = list(range(100, 117))
        hc = [h.value for h in vllm_block_hashes(c, BS)]
        await _complete(w, {"prompt": c})
        _, seq, (_, events, _) = await _recv(sub)
        assert seq == base + 1
        assert events == [
            {"type": "BlockRemoved", "block_hashes": [ha[1]], "medium": "GPU", "group_idx": 0},
            _stored(hc, None, c[:16]),
        ]

        # LoRA request: lora id/name and extra keys in the event and in the hash.
        lo = list(range(200, 205))
        hl = vllm_block_hashes(lo, BS, lora_name="sql-lora")
        await _complete(w, {"prompt": lo, "model": "sql-lora", "max_tokens": 1})
        _, seq, (_, events, _) = await _recv(sub)
        assert seq == base + 2
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert events[len(removed) :] == [
            _stored([hl[0].value], None, lo[:4], lora_id=1, lora_name="sql-lora",
                    extra=[["sql-lora"]])
        ]  # fmt: skip

        async with aiohttp.ClientSession() as s, s.post(f"{w.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        _, seq, (_, events, _) = await _recv(sub)
        assert (seq, events) == (base + 3, [{"type": "AllBlocksCleared"}])
        assert len(w.engine.cache) == 0

        # Replay from seq 2 over a real DEALER (0.26+ layout: topic frame).
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(w.replay_endpoint)
        await dealer.send_multipart([b"", (base + 2).to_bytes(8, "big")])
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
        assert [g[:3] for g in got] == [
            [b"", b"", (base + 2).to_bytes(8, "big")],
            [b"", b"", (base + 3).to_bytes(8, "big")],
            [b"", b"", END_SEQ],
        ]
        assert msgspec.msgpack.decode(got[1][3])[1] == [{"type": "AllBlocksCleared"}]
        assert got[2][3] == b""
        dealer.close(linger=0)
        sub.close(linger=0)
    finally:
        await w.stop()


async def test_array_era_over_the_wire(ctx: zmq.asyncio.Context) -> None:
    w = await _start(era="array", topic="kv")
    try:
        assert w.events_endpoint is not None
        sub, base = await _subscribe(ctx, w)
        p = list(range(1, 6))
        await _complete(w, {"prompt": p, "max_tokens": 1})
        topic, seq, batch = await _recv(sub)
        h = vllm_block_hashes(p, BS)[0].value
        assert (topic, seq) == (b"kv", base)
        assert batch[1] == [["BlockStored", [h], None, [1, 2, 3, 4], BS, None, "GPU", None,
                             [None], 0]]  # fmt: skip
        assert batch[2] == 0
        sub.close(linger=0)
    finally:
        await w.stop()


@pytest.mark.parametrize("layout", ["topic", "legacy"])
async def test_replay_layouts(ctx: zmq.asyncio.Context, layout: str) -> None:
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", era="map", replay_layout=layout,  # type: ignore[arg-type]
        topic="kv-events", mode="bind",
    )  # fmt: skip
    await pub.start()
    try:
        payloads = []
        for i in range(3):
            pub.publish([block_removed("map", [i])], ts=1.5)
            payloads.append(pub._buffer[-1][1])
        assert pub.next_seq == 3
        assert pub.bound_replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
        seqs = [(1).to_bytes(8, "big"), (2).to_bytes(8, "big")]
        pairs = list(zip(seqs, payloads[1:], strict=True))
        if layout == "topic":
            assert got[:2] == [[b"", b"kv-events", s, p] for s, p in pairs]
            assert got[2] == [b"", b"", END_SEQ, b""]
        else:
            assert got[:2] == [[b"", s, p] for s, p in pairs]
            assert got[2] == [b"", END_SEQ, b""]
        dealer.close(linger=0)
    finally:
        await pub.stop()
