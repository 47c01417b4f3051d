"""Event-stream staleness over real ZMQ: an engine that stores nothing new is not stale.

A worker whose requests are all cache hits publishes no BlockStored; only a request that
made it compute (and so store) blocks it did not hold starts the silence clock."""

from __future__ import annotations

import random
import time
from typing import Any

import zmq.asyncio
from kvev_publisher import Publisher, stored, until

from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.events import EventIngest
from scorer.index import BlockIndex
from scorer.policy.base import PolicyContext, build_policy
from scorer.policy.parts import Parts
from scorer.pool import Pool
from scorer.routing import RoutingRequest

BS = 16
HASHER = BlockHasher(BS)
TOKENS = list(range(1000, 1000 + 10 * BS))
KEYS = HASHER.keys(TOKENS)
EP = "10.0.0.1:8000"


class Clock:
    """The policy's clock: real monotonic time (the subscriber stamps events with it)
    plus a skip the test moves instead of sleeping."""

    def __init__(self) -> None:
        self.skip = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skip


def _request(n: int, tokens: list[int]) -> RoutingRequest:
    keys = HASHER.keys(tokens)
    return RoutingRequest(
        request_id=f"r{n}",
        model="m",
        body={"model": "m", "prompt": "x"},
        block_keys=keys,
        token_ids=list(tokens),
        block_size=BS,
        prompt_tokens=len(tokens),
    )


def _note(decision: Any) -> str | None:
    return next(c.note for c in decision.candidates if c.endpoint == EP)


async def test_all_hit_requests_never_make_a_silent_stream_stale(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    cfg = Config.model_validate(
        {
            "pool": {
                "workers": [{"endpoint": EP, "events": {"endpoint": pub.endpoint}}],
                "block_size": BS,
            },
            "events": {"stale_after_s": 30},
            "policies": {"kv": {"speculative": False}},
        }
    )
    pool = Pool.from_config(cfg)
    index = BlockIndex(cfg.index)
    ing = EventIngest(cfg, pool, index, HASHER)
    parts = Parts(index=index, events=ing)
    pctx = PolicyContext(pool=pool, config=cfg, rng=random.Random(7), parts=parts)
    pol = build_policy("kv", pctx, {"speculative": False})
    clock = Clock()
    pol.clock = clock  # type: ignore[attr-defined]
    scorer = pol.plugin("dynamo_cost")  # type: ignore[attr-defined]
    w = pool.workers[EP]
    await ing.start()
    try:
        await pub.wait_subscribed()
        # The engine stores the whole prompt (one real BlockStored over ZMQ).
        await pub.publish([stored([i + 1 for i in range(10)], None, TOKENS)])
        await until(lambda: (m := index.match(KEYS).get(EP)) is not None and m.blocks == 10)
        last = ing.status(EP).last_event_at
        assert last is not None
        # Requests whose every full block it holds: it computes nothing new, says nothing.
        for n in range(3):
            d = pol.decide(_request(n, TOKENS[: (4 + n) * BS + 5]), list(pool))
            assert d.endpoint == EP and _note(d) is None
        clock.skip += 40  # past events.stale_after_s of silence
        d = pol.decide(_request(10, TOKENS), list(pool))
        assert _note(d) is None and not scorer.stream_stale(w, clock())
        # A request with blocks it does not hold: it must store them; silence now is stale.
        more = TOKENS + list(range(5000, 5000 + 2 * BS))
        d = pol.decide(_request(11, more), list(pool))
        assert _note(d) is None
        clock.skip += 40
        assert scorer.stream_stale(w, clock())
        d = pol.decide(_request(12, TOKENS), list(pool))
        assert _note(d) == "stale_events"
        # The engine publishes the new blocks: fresh again.
        await pub.publish([stored([11, 12], 10, more[10 * BS :])])
        await until(lambda: ing.status(EP).last_event_at != last)
        clock.skip = 0.0
        assert not scorer.stream_stale(w, clock())
        assert index.match(HASHER.keys(more))[EP].blocks == 12
    finally:
        await ing.stop()
        await pub.close()


def test_silence_clocks_of_removed_workers_are_forgotten() -> None:
    # A rolling update replaces every pod many times: the per-worker silence clocks stay
    # as many as the live workers (not the workers ever routed to).
    from scorer.events.subscriber import StreamStatus

    cfg = Config.model_validate(
        {"pool": {"workers": [{"endpoint": EP, "events": {"endpoint": "tcp://127.0.0.1:1"}}]}}
    )
    pool = Pool.from_config(cfg)
    index = BlockIndex(cfg.index)

    class Events:
        def status(self, ep: str) -> StreamStatus:
            return StreamStatus(last_event_at=1.0)

    parts = Parts(index=index, events=Events())  # type: ignore[arg-type]
    pctx = PolicyContext(pool=pool, config=cfg, rng=random.Random(7), parts=parts)
    pol = build_policy("kv", pctx, {})
    scorer = pol.plugin("dynamo_cost")  # type: ignore[attr-defined]
    template = pool.workers[EP].config
    prev = EP
    for n in range(300):
        ep = f"10.0.2.{n}:8000"
        pool.add(template.model_copy(update={"endpoint": ep}))
        pool.remove(prev, "deleted")
        prev = ep
        d = pol.decide(_request(n, TOKENS[: 2 * BS]), list(pool))
        assert d.endpoint == ep
    assert ep in scorer._routed_since
    assert len(scorer._routed_since) <= 2 * len(pool.workers) + 16
