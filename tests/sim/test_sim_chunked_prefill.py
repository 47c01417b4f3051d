"""Chunked prefill in the shared scheduler (vLLM v1's `schedule()`), step by step.

`schedule_step` is what both the simulated worker and the routing replay run, so these
tests drive it directly, with a tiny step loop, and then once through a real simulated
worker over ZMQ (the BlockStored batches a subscriber sees).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvscorer_tools.sim import cli
from kvscorer_tools.sim.cache import PrefixCache, vllm_block_hashes
from kvscorer_tools.sim.scheduler import Progress, Step, release, schedule_step
from kvscorer_tools.sim.worker import SimConfig, SimWorker

BUDGET = 8192


@dataclass(eq=False)
class Req:
    name: str
    prompt_tokens: int
    keys: list[int]
    extra_blocks: int
    output_tokens: int = 4
    progress: Progress | None = None
    tokens: list[int] = field(default_factory=list)  # the steps that gave it a token
    first_step: int = -1
    done_step: int = -1


def _key(*parts: object) -> int:
    # Deterministic in every process (str hashing is salted per process).
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _req(name: str, prompt: int, bs: int, *, prefix: list[int] | None = None, out: int = 4) -> Req:
    """A request whose full blocks are keyed (name, i), after an optional shared prefix."""
    prefix = prefix or []
    n = prompt // bs
    keys = prefix[:n] + [_key(name, i) for i in range(len(prefix[:n]), n)]
    extra = -(-(prompt - n * bs + out) // bs)
    return Req(name, prompt, keys, extra, out)


class Loop:
    """A minimal engine loop over `schedule_step` (the sim's and the replay's logic)."""

    def __init__(self, bs: int, capacity: int = 100_000, threshold: int = 0) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.cache = PrefixCache(capacity, bs, on_evict=self._evicted)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.threshold = threshold
        self.steps: list[Step[Req]] = []

    def _evicted(self, hashes: list[int]) -> None:
        self.events.append(("removed", len(self.steps), hashes))

    def _stored(self, r: Req, keys: list[int]) -> None:
        self.events.append(("stored", len(self.steps), r.name, keys))

    def step(self) -> Step[Req]:
        n = len(self.steps)
        step = schedule_step(
            self.waiting,
            self.running,
            self.cache,
            max_num_seqs=256,
            max_num_batched_tokens=BUDGET,
            long_prefill_token_threshold=self.threshold,
            block_keys=lambda r: r.keys,
            on_admit=lambda a: None,
            on_store=self._stored,
        )
        self.steps.append(step)
        self.running.extend(a.request for a in step.admitted)
        for r in step.first:
            r.first_step = n
        for r in step.tokens_out:
            r.tokens.append(n)
            if len(r.tokens) >= r.output_tokens:
                r.done_step = n
                self.running.remove(r)
                release(self.cache, r)
        return step

    def drain(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.waiting and not self.running:
                return
            self.step()
        raise AssertionError("did not drain")


def test_20k_prompt_takes_three_steps_and_stores_its_blocks_step_by_step() -> None:
    loop = Loop(bs=16)
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.drain()
    prefill = [[(r.name, n) for r, n in s.chunks] for s in loop.steps if s.chunks]
    assert prefill == [[("long", 8192)], [("long", 8192)], [("long", 3616)]]
    assert long.first_step == 2  # the step that computes the last chunk
    # Full blocks are stored as each step computes them: 512, 512, then the last 226.
    stored = [e for e in loop.events if e[0] == "stored"]
    assert stored == [
        ("stored", 0, "long", long.keys[0:512]),
        ("stored", 1, "long", long.keys[512:1024]),
        ("stored", 2, "long", long.keys[1024:1250]),
    ]
    assert loop.cache.reserved_blocks == 0 and loop.cache.pinned_blocks == 0


def test_evictions_come_chunk_by_chunk_before_each_chunks_stores() -> None:
    # 1,300 blocks, 1,000 of them cached and evictable (an earlier request's): the long
    # prompt's chunks evict only what each step needs, least recently freed first, and
    # each step's BlockRemoved precede its BlockStored (vLLM allocates, then caches).
    loop = Loop(bs=16, capacity=1300)
    old = _req("old", 16_000, 16, out=1)
    loop.waiting.append(old)
    loop.drain()
    assert len(loop.cache) == 1000 and loop.cache.pinned_blocks == 0
    loop.events.clear()
    loop.steps.clear()
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.drain()
    got = [(e[0], e[1], len(e[-1])) for e in loop.events]
    assert got == [
        ("removed", 0, 212),  # 300 never-used blocks, then 212 of old's
        ("stored", 0, 512),
        ("removed", 1, 512),
        ("stored", 1, 512),
        ("removed", 2, 227),  # 226 full blocks + the partial/output block
        ("stored", 2, 226),
    ]
    removed = [h for e in loop.events if e[0] == "removed" for h in e[2]]
    assert removed == list(reversed(old.keys))[:951]  # freed tail first, evicted in order


def test_blocks_of_a_running_prefill_are_hits_as_soon_as_computed() -> None:
    loop = Loop(bs=16)
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.step()
    # After the first chunk only its 512 blocks are in the cache (vLLM caches full blocks
    # up to num_computed_tokens at allocate_slots).
    assert loop.cache.match(long.keys) == 512
    loop.step()
    assert loop.cache.match(long.keys) == 1024


def test_decode_is_not_stalled_for_the_whole_long_prefill() -> None:
    loop = Loop(bs=16)
    d = _req("decode", 100, 16, out=10)
    loop.waiting.append(d)
    loop.step()  # d's prefill (first token)
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.drain()
    # d decodes in every step of the long prefill (it runs first and takes 1 token),
    # where a one-step prefill would have given it one token for the whole prompt.
    assert long.first_step == 3
    assert d.tokens[:4] == [0, 1, 2, 3]
    assert [n for _, n in loop.steps[1].chunks] == [BUDGET - 1]  # the decode's token


def _long_then_short(threshold: int) -> tuple[Loop, Req, Req]:
    """A 20k-token prompt, one step later a 300-token one; run until both are done."""
    loop = Loop(bs=16, threshold=threshold)
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.step()
    short = _req("short", 300, 16)
    loop.waiting.append(short)
    loop.drain()
    return loop, long, short


def test_short_request_behind_a_long_prefill() -> None:
    # vLLM's default (no long_prefill_token_threshold): the running prefill takes the whole
    # budget first, a short request arriving meanwhile shares the long one's last step.
    loop, long, short = _long_then_short(0)
    assert long.first_step == 2 and short.first_step == 2
    assert [(r.name, n) for r, n in loop.steps[2].chunks] == [("long", 3616), ("short", 300)]

    # With --long-prefill-token-threshold the long prompt leaves budget every step: the
    # short one gets its first token before the long one finishes.
    loop, long, short = _long_then_short(4096)
    assert short.first_step == 1
    assert long.first_step == 4  # 4 x 4096 + 3616
    assert short.first_step < long.first_step


def _reference(reqs: list[Req], bs: int, capacity: int) -> tuple[int, int, list[Any]]:
    """The former admission (whole prompt in the admitting step), one request at a time."""
    events: list[Any] = []
    cache = PrefixCache(capacity, bs, on_evict=lambda hs: events.append(("removed", hs)))
    for r in reqs:
        lookup = r.keys[: (r.prompt_tokens - 1) // bs]
        cache.lookup(lookup, r.prompt_tokens)
        stored = cache.admit(r.keys, r.extra_blocks)
        if stored:
            events.append(("stored", stored))
        cache.release(r.keys, r.extra_blocks)
    return cache.hits_tokens, cache.queries_tokens, events


def test_hit_accounting_unchanged_for_prompts_that_fit_one_step() -> None:
    bs, capacity = 16, 400
    rng = random.Random(11)
    prefixes = [[_key("p", g, i) for i in range(400)] for g in range(4)]
    reqs = []
    for i in range(120):
        prompt = rng.randrange(20, BUDGET + 1)
        reqs.append(_req(f"r{i}", prompt, bs, prefix=rng.choice(prefixes), out=rng.randrange(1, 9)))
        if prompt // bs + reqs[-1].extra_blocks > capacity:
            reqs.pop()
    hits, queries, ref_events = _reference(reqs, bs, capacity)
    loop = Loop(bs=bs, capacity=capacity)
    for r in reqs:  # one at a time, each to completion
        r.progress = None
        loop.waiting.append(r)
        loop.drain()
        assert r.first_step == r.tokens[0]  # one prefill step
    assert (loop.cache.hits_tokens, loop.cache.queries_tokens) == (hits, queries)
    assert hits > 0 and loop.cache.evictions > 0
    events = [("removed", e[2]) if e[0] == "removed" else ("stored", e[3]) for e in loop.events]
    assert events == ref_events
    assert loop.cache.reserved_blocks == 0 and loop.cache.pinned_blocks == 0


def test_reservation_keeps_blocks_for_a_prefill_in_progress() -> None:
    # A second request cannot take the blocks the first one's later chunks will fill.
    bs = 16
    loop = Loop(bs=bs, capacity=1300)
    long = _req("long", 20_000, bs)  # 1250 full blocks + 1 extra
    loop.waiting.append(long)
    loop.step()
    assert loop.cache.pinned_blocks == 512
    assert loop.cache.reserved_blocks == 1250 - 512 + long.extra_blocks
    other = _req("other", 1000, bs)  # 63 blocks + 1: does not fit beside the reservation
    loop.waiting.append(other)
    loop.step()
    assert other.progress is None and list(loop.waiting) == [other]
    loop.drain()
    assert other.first_step > long.first_step
    assert loop.cache.reserved_blocks == 0 and loop.cache.pinned_blocks == 0


def test_abort_mid_prefill_gives_back_pinned_and_reserved_blocks() -> None:
    loop = Loop(bs=16, capacity=2000)
    long = _req("long", 20_000, 16)
    loop.waiting.append(long)
    loop.step()
    loop.running.remove(long)
    release(loop.cache, long)
    assert loop.cache.reserved_blocks == 0 and loop.cache.pinned_blocks == 0
    assert len(loop.cache) == 512  # its computed blocks stay cached, evictable
    assert loop.cache.free_blocks == 2000


# --- the simulated worker over real ZMQ ------------------------------------------------


async def test_sim_publishes_a_long_prompts_blocks_in_one_batch_per_step(
    ctx: zmq.asyncio.Context,
) -> None:
    bs = 16
    cfg = SimConfig(
        port=0, block_size=bs, capacity_blocks=2000, speed=200.0, seed=3,
        max_num_batched_tokens=BUDGET, kv_events="tcp://127.0.0.1:0", kv_events_mode="bind",
    )  # fmt: skip
    w = SimWorker(cfg)
    await w.start()
    sub = ctx.socket(zmq.SUB)
    try:
        assert w.events_endpoint is not None and w.publisher is not None
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.events_endpoint)
        for _ in range(600):  # the slow joiner: probe until one arrives (bounded)
            w.publisher.publish([])
            if await sub.poll(50):
                break
        else:
            raise AssertionError("the subscription never reached the worker's PUB socket")
        base = w.publisher.next_seq
        for _ in range(base + 1):
            _, seq, _ = await asyncio.wait_for(sub.recv_multipart(), 5)
            if int.from_bytes(seq, "big") == base - 1:
                break
        prompt = [1000 + i % 30_000 for i in range(20_000)]
        hashes = [h.value for h in vllm_block_hashes(prompt, bs)]
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{w.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r,
        ):
            assert r.status == 200, await r.text()
            body = await r.json()
        assert body["usage"]["prompt_tokens"] == 20_000
        batches = []
        for _ in range(3):
            _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            _, events, _ = msgspec.msgpack.decode(payload)
            batches.append((int.from_bytes(seq, "big"), events))
        assert [seq for seq, _ in batches] == [base, base + 1, base + 2]
        got = [
            [(e["type"], e["block_hashes"], e["parent_block_hash"]) for e in events]
            for _, events in batches
        ]
        assert got == [
            [("BlockStored", hashes[0:512], None)],
            [("BlockStored", hashes[512:1024], hashes[511])],
            [("BlockStored", hashes[1024:1250], hashes[1023])],
        ]
        assert batches[2][1][0]["token_ids"] == prompt[1024 * bs : 1250 * bs]
        assert w.engine.steps >= 4  # three prefill steps, then the second token
    finally:
        sub.close(linger=0)
        await w.stop()


def test_cli_long_prefill_token_threshold_reaches_the_engine() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["sim", "--long-prefill-token-threshold", "2048"])
    cfg = cli.config_from_args(args)
    assert cfg.long_prefill_token_threshold == 2048
    assert SimWorker(cfg).engine.long_prefill_token_threshold == 2048
    with pytest.raises(ValueError, match="long-prefill-token-threshold"):
        cli.config_from_args(parser.parse_args(["sim", "--long-prefill-token-threshold", "-1"]))
