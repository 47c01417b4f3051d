"""Warm start and restarts through the replay socket: on every (re)connection the
subscriber reads what the worker's replay buffer keeps (real ZMQ, loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kvev_publisher import Publisher, stored

from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.events import EventIngest
from scorer.index import BlockIndex
from scorer.pool import Pool

BS = 16
HASHER = BlockHasher(BS)
TOKENS = list(range(1000, 1000 + 8 * BS))
KEYS = HASHER.keys(TOKENS)
EP = "10.0.0.1:8000"


def blk(i: int) -> list[int]:
    return TOKENS[i * BS : (i + 1) * BS]


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Bounded wait for a condition the subscriber reaches asynchronously."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        c.term()


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


async def chain(pub: Publisher, n: int, send: bool = True) -> None:
    """Publish blocks 0..n-1 of the chain, one message each."""
    for i in range(n):
        await pub.publish([stored([100 + i], 100 + i - 1 if i else None, blk(i))], send=send)


async def test_scorer_started_next_to_a_warm_worker_knows_its_cache(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    await chain(pub, 5, send=False)  # the worker's cache before the scorer starts
    ing = ingest(pub)
    await ing.start()
    try:
        sub = ing.subscribers[EP]
        await until(lambda: matched(ing) == 5)  # from the replay buffer alone
        assert sub.stats.syncs == {"ok": 1} and sub.stats.warm_messages == 5
        # Live messages continue the sequence: no restart, no gap, no duplicate.
        await pub.wait_subscribed()
        await pub.publish([stored([105], 104, blk(5))])
        await until(lambda: matched(ing) == 6)
        assert sub.stats.purges == {} and sub.stats.gaps == 0
        assert sub.stats.last_seq == {0: 5}
    finally:
        await ing.stop()
        await pub.close()


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
    ing = ingest(pub)
    await ing.start()
    try:
        await pub.wait_subscribed()
        await chain(pub, 4)
        await until(lambda: matched(ing) == 4)
        sub = ing.subscribers[EP]
        pub = await _restart(ctx, pub)
        # No event from the new engine: the sync on reconnection sees its empty buffer.
        await until(lambda: matched(ing) == 0)
        assert sub.stats.purges == {"restart": 1}
        await pub.wait_subscribed()
        await pub.publish([stored([900], None, blk(0))])  # the new engine's seq 0
        await until(lambda: matched(ing) == 1)
        assert sub.stats.purges == {"restart": 1}
    finally:
        await ing.stop()
        await pub.close()


async def test_restarted_engine_that_published_past_our_seq_is_detected(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    ing = ingest(pub)
    await ing.start()
    try:
        await pub.wait_subscribed()
        await chain(pub, 2)
        await until(lambda: matched(ing) == 2)
        sub = ing.subscribers[EP]
        pub = await _restart(ctx, pub)
        # The new engine got further than the old one before we reconnected: same seqs,
        # other batches (timestamps), other blocks.
        for i in range(3):
            await pub.publish([stored([700 + i], 700 + i - 1 if i else None, blk(i))], send=False)
        await until(lambda: sub.stats.purges.get("restart") == 1 and matched(ing) == 3)
        assert ing.index.lookup_engine(EP, 0, 100) is None  # the old engine's blocks are gone
    finally:
        await ing.stop()
        await pub.close()
