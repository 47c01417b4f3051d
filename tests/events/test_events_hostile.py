"""The event path cannot die: hostile frames and publishers cost one counted drop each, the
subscriber keeps applying normal events afterwards and its memory stays bounded."""

from __future__ import annotations

import asyncio
import resource
import time
import tracemalloc
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvev_publisher import Publisher, stored, until

from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.events import EventIngest
from scorer.events.subscriber import Subscriber
from scorer.index import BlockIndex
from scorer.pool import Pool

BS = 16
HASHER = BlockHasher(BS)
TOKENS = list(range(1000, 1000 + 8 * BS))
KEYS = HASHER.keys(TOKENS)
EP = "10.0.0.1:8000"


def blk(i: int) -> list[int]:
    return TOKENS[i * BS : (i + 1) * BS]


def ingest(endpoint: str, **events: Any) -> EventIngest:
    cfg = Config.model_validate(
        {
            "pool": {
                "workers": [{"endpoint": EP, "events": {"endpoint": endpoint}}],
                "block_size": BS,
            },
            "events": {"replay_timeout_s": 0.5, "reconnect_interval_s": 0.05, **events},
        }
    )
    return EventIngest(cfg, Pool.from_config(cfg), BlockIndex(cfg.index), HASHER)


def matched(ing: EventIngest) -> int:
    m = ing.index.match(KEYS).get(EP)
    return m.blocks if m else 0


def frames(seq: int, events: list[Any], rank: int | None = None) -> list[bytes]:
    batch: list[Any] = [time.time(), events] + ([] if rank is None else [rank])
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


async def test_deeply_nested_frame_is_counted_and_the_stream_goes_on(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    ing = ingest(pub.endpoint)
    await ing.start()
    try:
        await pub.wait_subscribed()
        # ~5 KB nested 5,000 deep: msgspec raises RecursionError, which once killed the task.
        await pub.raw([b"", (0).to_bytes(8, "big"), b"\x91" * 5000 + b"\xc0"])
        await pub.raw([b"", (0).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\x91" * 5000])
        await pub.publish([stored([1], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        sub = ing.subscribers[EP]
        assert sub.stats.decode_errors == {"depth": 2}
        assert sub.stats.restarts == 0
    finally:
        await ing.stop()
        await pub.close()


async def test_oversized_frame_never_reaches_memory(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    ing = ingest(pub.endpoint, max_message_bytes=1 << 20)
    await ing.start()
    try:
        await pub.wait_subscribed()
        huge = bytes(48 << 20)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        await pub.pub.send_multipart([b"", (0).to_bytes(8, "big"), huge], copy=False)
        # ZMQ disconnects the peer on the declared length; the SUB reconnects and subscribes
        # again (the XPUB sees it), then normal events flow.
        # The unsubscribe of the dropped connection comes first (bounded: a few messages).
        for _ in range(16):
            if (await asyncio.wait_for(pub.pub.recv(), 10.0))[:1] == b"\x01":
                break
        else:
            raise AssertionError("the SUB never subscribed again after the oversized frame")
        await pub.publish([stored([1], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown < 24 << 10, f"RSS peak grew {grown} KiB for a 48 MiB frame"
        assert ing.subscribers[EP].stats.messages == 1
    finally:
        await ing.stop()
        await pub.close()


async def test_failed_subscriber_task_is_restarted(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publisher(ctx)
    ing = ingest(pub.endpoint, restart_backoff_s=0.01)
    original = Subscriber._receive
    calls = {"n": 0}

    async def failing_once(self: Subscriber, sub: zmq.asyncio.Socket) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        await original(self, sub)

    monkeypatch.setattr(Subscriber, "_receive", failing_once)
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        await until(lambda: sub.stats.restarts == 1 and calls["n"] == 2)
        # The new socket's subscription may race the first messages: publish until applied
        # (bounded), as a live publisher keeps publishing.
        for i in range(100):
            await pub.publish([stored([1], None, blk(0))])
            try:
                await until(lambda: matched(ing) == 1, timeout=0.1)
                break
            except AssertionError:
                assert i < 99
        assert ing.index_report()["workers"][EP]["stream"]["restarts"] == 1
    finally:
        await ing.stop()
        await pub.close()


async def test_many_ranks_are_bounded_per_worker() -> None:
    ing = ingest("tcp://127.0.0.1:9", max_ranks_per_worker=4)
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for rank in range(2000):  # a publisher announcing 2,000 data-parallel ranks
            await sub.handle(frames(0, [stored([rank + 10], None, blk(1))], rank=rank))
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert ing.index.ranks(EP) == 4
        assert sub.stats.drops == {"ranks": 1996}
        assert grown < 256 << 10, grown
        await sub.handle(frames(1, [stored([1], None, blk(0))], rank=0))
        assert matched(ing) == 1
    finally:
        await ing.stop()


async def test_oversized_event_is_dropped_the_rest_applies() -> None:
    ing = ingest("tcp://127.0.0.1:9", max_blocks_per_event=4)
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        big = stored(list(range(100, 105)), None, TOKENS[: 5 * BS])
        await sub.handle(frames(0, [big, stored([1], None, blk(0))]))
        assert sub.stats.drops == {"event_blocks": 1}
        assert ing.index.stats(EP)["blocks"]["GPU"] == 1 and matched(ing) == 1
    finally:
        await ing.stop()


async def test_event_rate_is_bounded_per_worker() -> None:
    ing = ingest("tcp://127.0.0.1:9", max_events_per_s=10)
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        now = [100.0]
        sub.clock = lambda: now[0]
        for seq in range(15):  # 15 events in one instant: one second of burst (10) passes
            await sub.handle(frames(seq, [stored([1000 + seq], None, blk(7))]))
        assert sub.stats.drops == {"rate": 5}
        assert sub.stats.gaps == 0  # dropped messages are consumed, not replayed
        now[0] += 1.0  # a second later the bucket is full again
        await sub.handle(frames(15, [stored([1], None, blk(0))]))
        assert matched(ing) == 1 and sub.stats.drops == {"rate": 5}
    finally:
        await ing.stop()


async def test_an_exception_while_applying_costs_one_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ing = ingest("tcp://127.0.0.1:9")
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        real = sub.applier.apply

        def boom(*a: Any, **k: Any) -> None:
            raise KeyError("bug")

        monkeypatch.setattr(sub.applier, "apply", boom)
        await sub.handle(frames(0, [stored([1], None, blk(0))]))
        monkeypatch.setattr(sub.applier, "apply", real)
        await sub.handle(frames(1, [stored([1], None, blk(0))]))
        assert sub.stats.drops == {"internal": 1} and matched(ing) == 1
    finally:
        await ing.stop()
