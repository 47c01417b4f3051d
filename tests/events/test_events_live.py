"""Live KV-event ingestion over real ZMQ sockets (127.0.0.1, random ports)."""

from __future__ import annotations

import asyncio
import io
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from configs import make_config
from kvev_publisher import Publisher, cleared, removed, stored, until

from scorer.blocks import BlockHasher, namespace_key
from scorer.events import EventIngest
from scorer.events.cli import listen
from scorer.index import BlockIndex
from scorer.pool import Pool

BS = 16
HASHER = BlockHasher(BS)
TOKENS = list(range(1000, 1000 + 8 * BS))  # 8 blocks
KEYS = HASHER.keys(TOKENS)
EP = "10.0.0.1:8000"


def blk(i: int, j: int | None = None) -> list[int]:
    j = i + 1 if j is None else j
    return TOKENS[i * BS : j * BS]


def make_ingest(workers: list[dict[str, Any]], **index: Any) -> EventIngest:
    cfg = make_config(
        workers,
        pool={"block_size": BS},
        events={"replay_timeout_s": 0.5, "reconnect_interval_s": 0.05},
        index=index,
    )
    pool = Pool.from_config(cfg)
    return EventIngest(cfg, pool, BlockIndex(cfg.index), HASHER)


def matched(ing: EventIngest, ep: str = EP) -> int:
    m = ing.index.match(KEYS).get(ep)
    return m.blocks if m else 0


async def started(
    ctx: zmq.asyncio.Context, reply_layout: int = 4, replay: bool = True, rank: int | None = None
) -> tuple[Publisher, EventIngest]:
    pub = Publisher(ctx, reply_layout=reply_layout, rank=rank)
    ev: dict[str, Any] = {"endpoint": pub.endpoint}
    if replay:
        ev["replay_endpoint"] = pub.replay_endpoint
    ing = make_ingest([{"endpoint": EP, "events": ev}])
    await ing.start()
    await pub.wait_subscribed()
    return pub, ing


async def test_connect_mode_interleaved_exact_index(ctx: zmq.asyncio.Context) -> None:
    pub, ing = await started(ctx)
    try:
        await until(lambda: ing.status(EP).connected)
        await pub.publish([stored([101, 102], None, blk(0, 2))])
        await pub.publish([stored([103, 104, 105], 102, blk(2, 5), tagged=False)])
        await pub.publish([removed([105]), stored([106], 104, blk(4), medium="CPU")])
        await pub.publish([stored([107], 106, blk(5), medium="cpu")])
        await until(lambda: ing.status(EP).last_event_at is not None and matched(ing) == 6)
        m = ing.index.match(KEYS)[EP]
        # blocks 0-3 on GPU; block 4 was removed from GPU but stored on CPU; block 5 on CPU
        assert m.blocks == 6
        assert m.by_medium == {"GPU": 4, "CPU": 2}
        assert m.weighted == pytest.approx(4 * 1.0 + 2 * 0.3)
        await pub.publish([removed([106], medium="CPU_PINNED")])
        await until(lambda: matched(ing) == 4)  # a gap at block 4 freezes the count
        st = ing.index.stats(EP)
        assert st["blocks"] == {"GPU": 4, "CPU": 1, "DISK": 0}
        rep = ing.index_report()["workers"][EP]
        assert rep["stream"]["last_seq"] == {"0": 4}
        assert rep["stream"]["gaps"] == 0
    finally:
        await ing.stop()
        await pub.close()


@pytest.mark.parametrize("layout", [3, 4])
async def test_gap_is_replayed_both_layouts(ctx: zmq.asyncio.Context, layout: int) -> None:
    pub, ing = await started(ctx, reply_layout=layout)
    try:
        await pub.publish([stored([1], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        await pub.publish([stored([2], 1, blk(1))], send=False)  # lost on the wire
        await pub.publish([stored([3], 2, blk(2))], send=False)
        await pub.publish([stored([4], 3, blk(3))])
        await until(lambda: matched(ing) == 4)
        sub = ing.subscribers[EP]
        assert sorted(pub.replay_requests) == [0, 1]  # the sync on connection, the gap
        assert sub.stats.gaps == 1
        assert sub.stats.replays == {"ok": 1}
        assert sub.stats.last_seq == {0: 3}
        assert not ing.status(EP).unrecovered_gap
        assert ing.status(EP).purges == 0
    finally:
        await ing.stop()
        await pub.close()


async def test_gap_replay_cut_by_the_routers_hwm_is_completed(ctx: zmq.asyncio.Context) -> None:
    """A gap longer than what vLLM's ROUTER sends before its HWM: the replay asks again
    from the first missing seq (it purged the worker: "timeout", no end marker came)."""
    pub, ing = await started(ctx)
    try:
        ing.config.events.replay_timeout_s = 0.2  # each cut round ends in this much silence
        await pub.publish([stored([1], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        for i in range(1, 6):  # lost on the wire
            await pub.publish([stored([1 + i], i, blk(i))], send=False)
        pub.reply_limit = 2
        await pub.publish([stored([7], 6, blk(6))])
        await until(lambda: matched(ing) == 7)
        sub = ing.subscribers[EP]
        assert sub.stats.replays == {"ok": 1} and sub.stats.purges == {}
        assert pub.replay_requests == [0, 1, 3, 5, 7]
        assert sub.stats.last_seq == {0: 6} and not ing.status(EP).unrecovered_gap
    finally:
        await ing.stop()
        await pub.close()


async def test_gap_without_replay_purges(ctx: zmq.asyncio.Context) -> None:
    pub, ing = await started(ctx, replay=False)
    try:
        await pub.publish([stored([1, 2], None, blk(0, 2))])
        await until(lambda: matched(ing) == 2)
        await pub.publish([stored([3], 2, blk(2))], send=False)
        await pub.publish([stored([9], None, blk(0))])
        await until(lambda: ing.status(EP).purges == 1)
        await until(lambda: matched(ing) == 1)  # purged, then the new root block applied
        assert ing.status(EP).unrecovered_gap
        assert ing.subscribers[EP].stats.replays == {"unavailable": 1}
        assert ing.subscribers[EP].stats.purges == {"gap": 1}
    finally:
        await ing.stop()
        await pub.close()


async def test_replay_too_old_purges(ctx: zmq.asyncio.Context) -> None:
    pub, ing = await started(ctx)
    try:
        await pub.publish([stored([1], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        await pub.publish([stored([2], 1, blk(1))], send=False)
        await pub.publish([stored([3], 2, blk(2))], send=False)
        pub.buffer = pub.buffer[2:]  # the engine's replay buffer no longer reaches seq 1
        await pub.publish([stored([4], 3, blk(3))])
        await until(lambda: ing.status(EP).purges == 1)
        assert ing.subscribers[EP].stats.replays == {"too_old": 1}
        assert matched(ing) == 0
    finally:
        await ing.stop()
        await pub.close()


async def test_restart_purges(ctx: zmq.asyncio.Context) -> None:
    pub, ing = await started(ctx)
    try:
        await pub.publish([stored([1, 2, 3], None, blk(0, 3))])
        await pub.publish([stored([4], 3, blk(3))])
        await until(lambda: matched(ing) == 4)
        pub.seq = 0  # the engine restarted: sequence starts over
        pub.buffer.clear()
        await pub.publish([stored([50], None, blk(0))])
        await until(lambda: ing.status(EP).purges == 1)
        await until(lambda: matched(ing) == 1)
        assert ing.subscribers[EP].stats.purges == {"restart": 1}
        assert pub.replay_requests == [0]  # only the sync on connection
    finally:
        await ing.stop()
        await pub.close()


async def test_all_blocks_cleared_purges(ctx: zmq.asyncio.Context) -> None:
    pub, ing = await started(ctx)
    try:
        await pub.publish([stored([1, 2], None, blk(0, 2))])
        await until(lambda: matched(ing) == 2)
        await pub.publish([cleared(tagged=False)])
        await until(lambda: matched(ing) == 0)
        assert ing.subscribers[EP].stats.purges == {"cleared": 1}
    finally:
        await ing.stop()
        await pub.close()


async def test_bind_mode_and_two_ranks(
    ctx: zmq.asyncio.Context, closed_port: Callable[[], int]
) -> None:
    port = closed_port()
    ing = make_ingest(
        [{"endpoint": EP, "events": {"endpoint": f"tcp://127.0.0.1:{port}", "mode": "bind"}}]
    )
    await ing.start()
    # Two DP ranks of one worker, each its own publisher connecting to our bound SUB.
    p0 = Publisher(ctx, rank=0, connect_to=f"tcp://127.0.0.1:{port}")
    p1 = Publisher(ctx, rank=1, connect_to=f"tcp://127.0.0.1:{port}")
    try:
        await p0.wait_subscribed()
        await p1.wait_subscribed()
        await p0.publish([stored([1, 2], None, blk(0, 2))])
        await p1.publish([stored([7, 8, 9], None, blk(0, 3))])
        await p1.publish([removed([9])])
        await p0.publish([stored([3], 2, blk(2))])
        sub = ing.subscribers[EP]
        await until(lambda: sub.stats.last_seq == {0: 1, 1: 1})
        # Each rank keeps its own sequence: no gap, no purge.
        assert sub.stats.gaps == 0 and ing.status(EP).purges == 0
        assert ing.index.stats(EP)["ranks"] == [0, 1]
        assert ing.index.stats(EP)["blocks"]["GPU"] == 3 + 2
        assert matched(ing) == 3  # the best rank
        await until(lambda: ing.status(EP).connected)
    finally:
        await ing.stop()
        await p0.close()
        await p1.close()


async def test_malformed_messages_are_counted_and_stream_continues(
    ctx: zmq.asyncio.Context,
) -> None:
    pub, ing = await started(ctx)
    try:
        await pub.raw([b"", b"\x00" * 3, b"x"])  # bad seq frame
        await pub.raw([b"", (0).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        await pub.raw([b"", (0).to_bytes(8, "big")])  # 2 frames
        await pub.publish([stored([1], None, blk(0)), {"type": "Future", "x": 1}])
        await until(lambda: matched(ing) == 1)
        errs = ing.subscribers[EP].stats.decode_errors
        assert errs == {"seq": 1, "msgpack": 1, "frames": 1, "unknown_type": 1}
    finally:
        await ing.stop()
        await pub.close()


async def test_debug_score_and_index_over_http(ctx: zmq.asyncio.Context) -> None:
    other = "10.0.0.2:8000"
    ing = make_ingest([EP, other])
    ing.applier.index.add(EP, 0, [1, 2, 3], KEYS[:3])
    ing.applier.index.add(other, 0, [1], KEYS[:1], "CPU")
    ing.tokenize = lambda model, body: TOKENS if body.get("prompt") == "hello" else None
    app = web.Application()
    for method, path, handler in ing.routes():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}"
            r = await http.post(url + "/debug/score", json={"model": "m", "token_ids": TOKENS})
            body = await r.json()
            assert r.status == 200
            assert body["block_size"] == BS
            assert body["workers"][0] == {
                "endpoint": EP,
                "matched_blocks": 3,
                "matched_tokens": 3 * BS,
                "by_medium": {"GPU": 3},
                "weighted": 3.0,
            }
            assert body["workers"][1]["endpoint"] == other
            assert body["workers"][1]["by_medium"] == {"CPU": 1}
            assert body["workers"][1]["weighted"] == pytest.approx(0.3)
            r = await http.post(url + "/debug/score", json={"model": "m", "prompt": "hello"})
            assert (await r.json())["workers"][0]["matched_blocks"] == 3
            # A model named in tokens.lora_base is an adapter: its chain has its own namespace.
            ing.config.tokens.lora_base["adapter"] = "m"
            lora_keys = HASHER.keys(TOKENS, namespace_key("adapter"))
            ing.applier.index.add(other, 0, [7, 8], lora_keys[:2])
            r = await http.post(
                url + "/debug/score", json={"model": "adapter", "token_ids": TOKENS}
            )
            lora_rows = {w["endpoint"]: w["matched_blocks"] for w in (await r.json())["workers"]}
            assert lora_rows == {other: 2, EP: 0}
            r = await http.post(url + "/debug/score", json={"model": "m", "token_ids": [-1]})
            assert r.status == 400
            r = await http.post(url + "/debug/score", data=b"{nope")
            assert r.status == 400
            r = await http.get(url + "/debug/index")
            rep = await r.json()
            assert rep["workers"][EP]["blocks"] == {"GPU": 3, "CPU": 0, "DISK": 0}
            assert rep["workers"][other]["blocks"]["CPU"] == 1
    finally:
        await runner.cleanup()


async def test_cli_listen_prints_events_and_replays(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx, topic="kv", rank=1)
    try:
        await pub.publish([stored([1, b"\xab\xcd"], None, blk(0, 2), lora_name="ad")], send=False)
        await pub.publish([removed([1])], send=False)
        out = io.StringIO()
        args = Namespace(
            connect=pub.endpoint,
            bind=None,
            topic="kv",
            count=3,
            replay_from=0,
            replay_endpoint=pub.replay_endpoint,
            timeout=2.0,
        )
        task = asyncio.create_task(listen(args, out))
        await pub.wait_subscribed()
        await pub.publish([cleared()])
        assert await asyncio.wait_for(task, 10) == 0
        import json

        lines = [json.loads(x) for x in out.getvalue().splitlines()]
        assert [x["type"] for x in lines] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        first = lines[0]
        assert set(first) == {
            "seq", "topic", "dp_rank", "type", "block_hashes", "parent_block_hash",
            "token_ids", "block_size", "medium", "lora_name", "extra_keys", "group_idx",
        }  # fmt: skip
        assert first["block_hashes"] == [1, "abcd"]
        assert first["seq"] == 0 and first["topic"] == "kv" and first["dp_rank"] == 1
        assert first["lora_name"] == "ad" and first["medium"] == "GPU"
        assert lines[1]["token_ids"] is None and lines[2]["seq"] == 2
    finally:
        await pub.close()
