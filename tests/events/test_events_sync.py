"""Warm start and restarts through the replay socket: on every (re)connection the
subscriber reads what the worker's replay buffer keeps (real ZMQ, loopback)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kvev_publisher import Publisher, cleared, removed, stored, until

from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.events import EventIngest
from scorer.events.subscriber import BURST, Subscriber
from scorer.index import BlockIndex
from scorer.pool import Pool
from scorer.tasks import cancel_and_wait

BS = 16
HASHER = BlockHasher(BS)
TOKENS = list(range(1000, 1000 + 8 * BS))
KEYS = HASHER.keys(TOKENS)
EP = "10.0.0.1:8000"


def blk(i: int) -> list[int]:
    return TOKENS[i * BS : (i + 1) * BS]


def ingest(pub: Publisher) -> EventIngest:
    ev: dict[str, Any] = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
    cfg = Config.model_validate(
        {
            "pool": {"workers": [{"endpoint": EP, "events": ev}], "block_size": BS},
            "events": {"replay_timeout_s": 1.0, "reconnect_interval_s": 0.05},
        }
    )
    return EventIngest(cfg, Pool.from_config(cfg), BlockIndex(cfg.index), HASHER)


def matched(ing: EventIngest) -> int:
    m = ing.index.match(KEYS).get(EP)
    return m.blocks if m else 0


class Running:
    """An EventIngest on `pub`: started on enter; on exit stopped, and the publisher closed
    (the one in `pub` then: a restart test swaps in the new engine's)."""

    def __init__(self, pub: Publisher) -> None:
        self.pub = pub
        self.ing = ingest(pub)

    async def __aenter__(self) -> Running:
        await self.ing.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.ing.stop()
        finally:
            await self.pub.close()


async def chain(pub: Publisher, n: int, send: bool = True) -> None:
    """Publish blocks 0..n-1 of the chain, one message each."""
    for i in range(n):
        await pub.publish([stored([100 + i], 100 + i - 1 if i else None, blk(i))], send=send)


async def test_scorer_started_next_to_a_warm_worker_knows_its_cache(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    await chain(pub, 5, send=False)  # the worker's cache before the scorer starts
    r = Running(pub)
    ing = r.ing
    async with r:
        sub = ing.subscribers[EP]
        await until(lambda: matched(ing) == 5)  # from the replay buffer alone
        assert sub.stats.syncs == {"ok": 1} and sub.stats.warm_messages == 5
        # Live messages continue the sequence: no restart, no gap, no duplicate.
        await pub.wait_subscribed()
        await pub.publish([stored([105], 104, blk(5))])
        await until(lambda: matched(ing) == 6)
        assert sub.stats.purges == {} and sub.stats.gaps == 0
        assert sub.stats.last_seq == {0: 5}


async def _restart(ctx: zmq.asyncio.Context, old: Publisher) -> Publisher:
    """A new engine on the same addresses (empty buffer, seq from 0)."""
    port = int(old.endpoint.rsplit(":", 1)[1])
    rport = int(old.replay_endpoint.rsplit(":", 1)[1])
    await old.close()
    for _ in range(1500):  # ZMQ releases the ports in its I/O thread: retry, bounded (~30 s)
        try:
            return Publisher(ctx, port=port, replay_port=rport)
        except zmq.ZMQError:
            await asyncio.sleep(0.02)
    raise AssertionError("could not rebind the publisher's ports")


async def test_restarted_engine_that_has_not_published_drops_the_old_blocks(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    r = Running(pub)
    ing = r.ing
    async with r:
        await pub.wait_subscribed()
        await chain(pub, 4)
        await until(lambda: matched(ing) == 4)
        sub = ing.subscribers[EP]
        pub = r.pub = await _restart(ctx, pub)
        # No event from the new engine: the sync on reconnection sees its empty buffer.
        await until(lambda: matched(ing) == 0)
        assert sub.stats.purges == {"restart": 1}
        await pub.wait_subscribed()
        await pub.publish([stored([900], None, blk(0))])  # the new engine's seq 0
        await until(lambda: matched(ing) == 1)
        assert sub.stats.purges == {"restart": 1}


async def test_restarted_engine_that_published_past_our_seq_is_detected(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    r = Running(pub)
    ing = r.ing
    async with r:
        await pub.wait_subscribed()
        await chain(pub, 2)
        await until(lambda: matched(ing) == 2)
        sub = ing.subscribers[EP]
        pub = r.pub = await _restart(ctx, pub)
        # The new engine got further than the old one before we reconnected: same seqs,
        # other batches (timestamps), other blocks.
        for i in range(3):
            await pub.publish([stored([700 + i], 700 + i - 1 if i else None, blk(i))], send=False)
        await until(lambda: sub.stats.purges.get("restart") == 1 and matched(ing) == 3)
        assert ing.index.lookup_engine(EP, 0, 100) is None  # the old engine's blocks are gone


async def test_scorer_started_after_a_reset_skips_the_history_before_it(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM never empties its replay buffer (vllm/distributed/kv_events.py): after
    /reset_prefix_cache it still holds the earlier run's stores and evictions, then the
    AllBlocksCleared. A fresh scorer applies only what follows the clear, so the clear does
    not wipe the speculative entries it wrote meanwhile (an e2e bench's policy run lost
    832 of them that way)."""
    pub = Publisher(ctx)
    await chain(pub, 3, send=False)  # the earlier run
    await pub.publish([removed([100])], send=False)
    await pub.publish([stored([103], 102, blk(3)), cleared()], send=False)  # the reset
    await pub.publish([stored([200], None, blk(0))], send=False)  # this run's first store
    r = Running(pub)
    ing = r.ing
    # Routed before the sync: blocks 0-5 on their way to the worker.
    ing.index.insert_speculative(EP, KEYS[:6], ttl_s=60.0)
    async with r:
        sub = ing.subscribers[EP]
        await until(lambda: sub.stats.syncs != {})
        assert sub.stats.syncs == {"ok": 1}
        assert sub.stats.sync_skipped == 5 and sub.stats.warm_messages == 1
        assert ing.applier.stats[EP].cleared == 0 and ing.applier.stats[EP].removed == 0
        assert sub.stats.purges == {}
        assert matched(ing) == 6  # block 0 stored, 1-5 still speculative
        assert ing.index.stats(EP)["speculative"] == 5
        # The live stream continues after the buffer's last seq: no gap, no restart.
        await pub.wait_subscribed()
        await pub.publish([stored([201], 200, blk(1))])
        await until(lambda: ing.index.stats(EP)["speculative"] == 4)
        assert sub.stats.gaps == 0 and sub.stats.last_seq == {0: 6}


async def test_buffer_ending_in_a_clear_leaves_the_stream_at_its_last_seq(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    await chain(pub, 2, send=False)
    await pub.publish([cleared()], send=False)
    r = Running(pub)
    ing = r.ing
    async with r:
        sub = ing.subscribers[EP]
        await until(lambda: sub.stats.syncs != {})
        assert sub.stats.sync_skipped == 3 and sub.stats.warm_messages == 0
        assert matched(ing) == 0 and sub.stats.last_seq == {0: 2}
        await pub.wait_subscribed()
        await pub.publish([stored([300], None, blk(0))])
        await until(lambda: matched(ing) == 1)
        assert sub.stats.gaps == 0 and sub.stats.replays == {}


async def test_replay_cut_by_the_routers_hwm_is_requested_again_from_the_hole(
    ctx: zmq.asyncio.Context,
) -> None:
    """Past its send HWM vLLM's ROUTER drops the rest of a reply, end marker included: the
    sync asks again from the first seq it lacks until the reply is whole."""
    pub = Publisher(ctx)
    pub.reply_limit = 3
    await chain(pub, 8, send=False)
    r = Running(pub)
    ing = r.ing
    ing.config.events.replay_timeout_s = 0.2  # each cut round ends in this much silence
    async with r:
        sub = ing.subscribers[EP]
        await until(lambda: sub.stats.syncs != {})
        assert sub.stats.syncs == {"ok": 1} and sub.stats.warm_messages == 8
        assert pub.replay_requests == [0, 3, 6]
        assert matched(ing) == 8 and sub.stats.last_seq == {0: 7}


async def test_sync_applies_a_long_buffer_in_bursts(ctx: zmq.asyncio.Context) -> None:
    """A warm start's buffer (vLLM keeps 10,000 batches) is applied a burst at a time, with
    the loop's other work in between: held for seconds, it let speculative entries expire
    before the BlockStored confirming them was read."""
    pub = Publisher(ctx)
    n = 300
    for i in range(n):
        await pub.publish([stored([5000 + i], None, blk(i % 8))], send=False)
    ticks = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ing = ingest(pub)
    cfg = ing.config
    ev = cfg.pool.workers[0].events
    assert ev is not None
    sub = Subscriber(EP, ev, ing.applier, cfg.events, ctx, on_message=lambda m: seen.append(ticks))
    t = asyncio.create_task(ticker())
    await sub.start()
    try:
        await until(lambda: sub.stats.syncs != {})
        assert sub.stats.warm_messages == n and len(seen) == n
        longest = max(seen.count(v) for v in set(seen))
        assert longest <= BURST
    finally:
        await cancel_and_wait(t)
        await sub.stop()
        await pub.close()


async def test_ingest_stop_keeps_the_callers_cancel(ctx: zmq.asyncio.Context) -> None:
    """stop() waits for the closes of workers that left; a cancel of the caller meanwhile
    ends stop() (with `suppress(CancelledError): await task` it was swallowed, stop()
    returned as if done, and the close it waited for was cancelled half-way)."""
    pub = Publisher(ctx)
    ing = ingest(pub)
    await ing.start()
    release = asyncio.Event()
    closing = asyncio.create_task(release.wait())  # a worker's close still under way
    ing._closing.add(closing)
    stopper = asyncio.create_task(ing.stop())
    try:
        await until(lambda: not ing.subscribers)  # stop() waits for the close now
        await asyncio.sleep(0)
        stopper.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await stopper
        assert not closing.done()  # the close goes on
        assert ing._context is None  # the context went all the same
    finally:
        release.set()
        await closing
        await pub.close()


async def test_a_leaving_worker_takes_its_block_size_mismatch_series_along() -> None:
    """Per-endpoint series must not grow with churn: the pool's "removed" drops it."""
    from prometheus_client import REGISTRY

    from scorer.events.decode import BlockStored, EventBatch

    ev: dict[str, Any] = {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None}
    cfg = Config.model_validate(
        {"pool": {"workers": [{"endpoint": EP, "events": ev}], "block_size": BS}}
    )
    pool = Pool.from_config(cfg)
    ing = EventIngest(cfg, pool, BlockIndex(cfg.index), HASHER)
    name = "kv_scorer_block_size_mismatch_total"
    ing.applier.apply(EP, EventBatch(0.0, [BlockStored([1], None, list(range(2 * BS)), 2 * BS)]))
    assert REGISTRY.get_sample_value(name, {"endpoint": EP}) == 1.0
    pool.remove(EP, "deleted")
    assert REGISTRY.get_sample_value(name, {"endpoint": EP}) is None


async def test_a_reconnect_sync_asks_from_the_last_seq_applied(
    ctx: zmq.asyncio.Context,
) -> None:
    """A worker we follow is asked from our last seq, not its whole buffer again (the
    lock live messages wait on is held for what we missed only)."""
    pub = Publisher(ctx)
    r = Running(pub)
    ing = r.ing
    async with r:
        await pub.wait_subscribed()
        await chain(pub, 4)
        await until(lambda: matched(ing) == 4)
        sub = ing.subscribers[EP]
        # Two messages the SUB missed while disconnected (in the replay buffer only).
        for i in (4, 5):
            await pub.publish([stored([100 + i], 100 + i - 1, blk(i))], send=False)
        await sub._locked_sync()  # what a reconnection runs
        assert pub.replay_requests[-1] == 3
        assert matched(ing) == 6 and sub.stats.last_seq == {0: 5}
        assert sub.stats.purges == {} and sub.stats.syncs == {"ok": 2}
